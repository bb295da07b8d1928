"""`--quantization`: validation, the refusals, and the quantize-at-load formats and bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagecli import LLM, SamplingParams
from pagecli.config import EngineConfig
from pagecli.loader.quantize import quantize_q4_k, quantize_weight
from pagecli.loader.resolve import ModelLoadError


def test_config_rejects_an_unknown_quantization():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, q8_0, q4_k"):
        EngineConfig(quantization="q3_k")


def test_cli_rejects_an_unknown_quantization(capsys):
    from pagecli.cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--quantization", "q3_k"])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2 and err.startswith("pagecli: ") and "q3_k" in err


def test_requantizing_a_gguf_is_refused():
    with pytest.raises(ModelLoadError, match="a GGUF keeps its own formats"):
        LLM(quantization="q8_0")


def test_q8_0_at_load_is_ggml_q8_0():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    ours = quantize_weight("model.layers.0.mlp.up_proj.weight", x, "q8_0")
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.format.name == "q8_0" and np.array_equal(ours.data.numpy(), theirs)


def test_q4_k_quantizer_round_trip():
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    blocks = quantize_q4_k(x)
    assert blocks.shape == (8, 2 * 144)
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    # 4-bit levels with per-32 scales and mins: ggml's Q4_K is at about 7% RMS error on
    # Gaussian rows; a broken scale or nibble order lands far above.
    assert np.sqrt(np.mean((back - x) ** 2)) < 0.08


@pytest.mark.parametrize(("mode", "projection"), [("q8_0", "q8_0"), ("q4_k", "q4_1")])
def test_quantize_at_load_on_a_tiny_model(tiny_models, mode, projection):
    # hidden 64 and intermediate 128 are not whole 256-value super-blocks: q4_k takes Q4_1
    llm = LLM(str(tiny_models["llama3"]), quantization=mode, num_kv_blocks=32)
    formats = llm.engine.runner.model.weight_formats
    assert formats["qkv_proj"] == [projection] and formats["down_proj"] == [projection]
    assert formats["embed_tokens"] == ["q8_0"] and formats["lm_head"] == ["q8_0"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], params)
    assert len(out.token_ids) == 8
