"""Models pagecli cannot run end in one line naming what is missing: a GGUF of an arch no
family reads, a config with a RoPE type, activation or layer type pagecli lacks, a window
that is not a number of tokens, a sink tensor of the wrong shape. The CLI turns the
ModelLoadError into `pagecli: <line>` and exit 2 (the subprocess tests below)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from pagecli import LLM
from pagecli.loader.resolve import ModelLoadError
from tests.cli.helpers import run
from tests.tiny_models import COMMON


def _folder(tmp_path, name: str, **overrides):
    """A tiny Llama checkpoint folder whose config.json carries `overrides`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON), dtype=torch.float32)
    path = tmp_path / name
    model.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    config.update(overrides)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _mamba_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "mystery", "rope_theta": 1e4}}, "rope_type 'mystery'"),
        ({"hidden_act": "relu2"}, "unsupported activation 'relu2'"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention"], "sliding_window": 8},
            "unsupported layer type 'chunked_attention'",
        ),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "without a sliding_window"),
        ({"sliding_window": -3}, "sliding_window must be a positive number"),
        ({"architectures": ["MambaForCausalLM"]}, "unsupported architecture MambaForCausalLM"),
    ],
)
def test_a_config_pagecli_cannot_run_is_one_model_error(tmp_path, overrides, words):
    path = _folder(tmp_path, "bad", **overrides)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), dtype="float32", num_kv_blocks=8)
    message = str(info.value)
    assert words in message and "\n" not in message, message
    assert message.startswith(str(path)), message  # names the model


def test_a_sink_tensor_of_the_wrong_shape_is_named(tmp_path):
    from pagecli.models import weight_methods
    from pagecli.models.blocks import ModelSpec
    from pagecli.models.llama import LlamaForCausalLM

    class SinkLlama(LlamaForCausalLM):  # Llama layers with attention sinks (gpt-oss style)
        @classmethod
        def model_spec(cls, config) -> ModelSpec:
            spec = super().model_spec(config)
            layers = tuple(
                dataclasses.replace(
                    layer, attention=dataclasses.replace(layer.attention, sinks=True)
                )
                for layer in spec.layers
            )
            return dataclasses.replace(spec, layers=layers)

    from transformers import LlamaConfig

    model = SinkLlama(LlamaConfig(**COMMON), max_position=16)
    assert model.kv_layout()[0].sinks
    weights = [("model.layers.0.self_attn.sinks", torch.zeros(3))]  # 4 heads
    with pytest.raises(ValueError, match=r"layers.0.self_attn.sinks has shape \(3,\)"):
        weight_methods.load_weights(model, weights)


def test_cli_unsupported_gguf_arch_is_one_line_exit_2(tmp_path):
    path = _mamba_gguf(tmp_path / "mamba.gguf")
    proc = run(["generate", "--model", str(path)], b'{"prompt": "hi"}\n')
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 2, lines
    assert proc.stdout == b""
    assert len(lines) == 1 and lines[0].startswith("pagecli: "), lines
    assert "unsupported GGUF architecture 'mamba'" in lines[0]
    assert "gemma3" in lines[0]  # and the ones that are supported


def test_cli_unknown_rope_type_is_one_line_exit_2(tmp_path):
    path = _folder(tmp_path, "rope", rope_parameters={"rope_type": "mystery", "rope_theta": 1e4})
    proc = run(["generate", "--model", str(path)], b'{"prompt_token_ids": [1, 2]}\n')
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and "rope_type 'mystery'" in lines[0], lines
    assert "Traceback" not in proc.stderr.decode()
