"""Greedy parity with transformers for tiny random-weight GGUF files, one per block format.

pagecli keeps each file's blocks and computes with them (float32 activations and sums);
transformers dequantizes the same file to float32 (its own GGUF loader, its own Q/K
un-permutation). The greedy ids must agree under the near-tie rule of tests/oracle.py.
"""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from tests.gguf_models import FORMATS, VOCAB, build_tiny_ggufs
from tests.oracle import check_greedy

LENGTHS = [1, 3, 9, 31, 64, 150]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    return build_tiny_ggufs(tmp_path_factory.mktemp("gguf"))


def hf_from_gguf(path):
    """transformers' model for a GGUF file, dequantized to float32 by its GGUF loader."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("kind", [*FORMATS, "mixed", "q4_k_m"])
def test_gguf_parity(tiny_ggufs, kind):
    path = tiny_ggufs[kind]
    hf = hf_from_gguf(path)
    gen = torch.Generator().manual_seed(len(kind))
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=64)
    formats = llm.engine.runner.model.weight_formats
    expected = "q4_k" if kind in ("mixed", "q4_k_m") else kind
    assert formats["o_proj"] == [expected], formats
    if kind == "mixed":
        assert formats["qkv_proj"] == ["q4_k", "q6_k"] and formats["lm_head"] == ["q6_k"]
        assert formats["gate_up_proj"] == ["float32", "q4_k"]
    elif kind == "q4_k_m":
        assert formats["qkv_proj"] == ["q4_k", "q6_k"] and formats["down_proj"] == ["q6_k"]
        assert formats["embed_tokens"] == ["q6_k"] and formats["lm_head"] == ["tied"]
    else:
        assert formats["embed_tokens"] == [kind] and formats["lm_head"] == ["tied"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == NEW_TOKENS
        check_greedy(hf, prompt, output.token_ids)


def test_quantization_none_dequantizes(tiny_ggufs):
    llm = LLM(str(tiny_ggufs["q4_k"]), quantization="none", dtype="float32", num_kv_blocks=64)
    formats = llm.engine.runner.model.weight_formats
    assert formats["embed_tokens"] == ["float32"]
    assert formats["o_proj"] == ["float32"]
