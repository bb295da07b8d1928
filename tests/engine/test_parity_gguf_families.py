"""Parity with transformers for the families' GGUF files (tests/gguf_families.py).

Each family's tiny checkpoint is written as llama.cpp's converter writes its architecture
(gemma3, phi3, smollm3, olmo2, granite, llama), with Q8_0 blocks (one Q4_0 file), and with a
reference folder that holds the file's values for transformers. pagecli runs the file
itself. It keeps the blocks and runs the native layer program on the CPU. The prompts run
past the configs' window (24) and past Phi-3's original context (64). Two checks:

- greedy ids: `check_greedy` (tests/oracle.py) against transformers on the reference;
- log-probabilities: pagecli's top-5 per generated token against transformers' log-softmax
  while it decodes the same tokens as its generate does. This check matters because the tiny
  checkpoints with tied embeddings (Gemma 3, SmolLM3, Granite) echo their last input token
  by a wide logit margin, so their greedy ids are blind to the attention; the rest of the
  distribution is not. A LongRoPE model's tokens generated before the sequence passes the
  original context come from the short factors (transformers' generate then drops its cache
  and goes on with the long ones, as pagecli does): one teacher-forced pass over the whole
  sequence would rotate every position with the long factors instead.

A Gemma 3 file whose config transformers' own GGUF reader fully understands is checked
against transformers reading the file itself, and against the reference folder.
"""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from tests.gguf_families import FAMILY_ARCHS, extra_configs, write_family_gguf
from tests.oracle import check_greedy, check_logprobs
from tests.tiny_models import VOCAB

LENGTHS = [1, 9, 31, 64, 100, 150]
NEW_TOKENS = 12
TOP = 5

# case -> (tiny checkpoint, GGUF arch, block format)
CASES = {
    **{name: (name, arch, "q8_0") for name, arch in FAMILY_ARCHS.items()},
    "granite_nobias": ("granite_nobias", "granite", "q8_0"),
    "smollm3_q4_0": ("smollm3", "smollm3", "q4_0"),
    "gemma3_linear": ("gemma3_linear", "gemma3", "q8_0"),
    "smollm3_bf16": ("smollm3", "smollm3", "bf16"),  # BF16 tensors kept as bfloat16 rows
    "olmo2_iq4_nl": ("olmo2", "olmo2", "iq4_nl"),  # the non-linear 4-bit table
}
FORMAT_NAMES = {"bf16": "bfloat16"}  # the file's type -> pagecli's format name


@pytest.fixture(scope="module")
def family_ggufs(family_models, tmp_path_factory) -> dict:
    """case -> (GGUF path, reference folder), and "gemma3_plain"."""
    from tests.tiny_models import build_tiny_models

    extra = build_tiny_models(tmp_path_factory.mktemp("gguf_extra"), extra_configs())
    models = {**family_models, **extra}
    out = tmp_path_factory.mktemp("family_gguf")
    files = {
        case: write_family_gguf(models[model], out / case, arch, fmt)
        for case, (model, arch, fmt) in CASES.items()
    }
    files["gemma3_plain"] = write_family_gguf(models["gemma3_plain"], out / "plain", "gemma3")
    return files


def _counting(monkeypatch) -> list[int]:
    """Counts the calls of the native layer program (the CPU's one-call path)."""
    from pagecli_kernels import layers_cpu

    calls = [0]
    original = layers_cpu.LayerProgram.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(layers_cpu.LayerProgram, "__call__", counted)
    return calls


def _run_and_check(path, hf, fmt: str, seed: int, monkeypatch) -> None:
    """pagecli on the file keeps the blocks and runs the layer program, and its greedy ids
    and log-probabilities are `hf`'s."""
    calls = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=64)
    formats = llm.engine.runner.model.weight_formats
    assert formats["o_proj"] == [FORMAT_NAMES.get(fmt, fmt)], formats
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert calls[0] > 0, "the native layer program did not run"
    rope = getattr(hf.config, "rope_parameters", None) or {}
    original = rope.get("original_max_position_embeddings", float("inf"))
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == NEW_TOKENS
        if not len(prompt) <= original < len(prompt) + NEW_TOKENS:  # see decoding_logprobs
            check_greedy(hf, prompt, output.token_ids)
        check_logprobs(hf, prompt, output, TOP)


@pytest.mark.parametrize("case", list(CASES))
def test_family_gguf_parity(family_ggufs, case, monkeypatch):
    from transformers import AutoModelForCausalLM

    path, reference = family_ggufs[case]
    hf = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    _run_and_check(path, hf, CASES[case][2], len(case), monkeypatch)


def test_gemma3_reference_is_transformers_reading_the_file(family_ggufs):
    """The real format (norms stored as 1 + w, llama.cpp's names and default layer pattern):
    transformers' own GGUF reader makes of the file the model of the reference folder."""
    from transformers import AutoModelForCausalLM

    from tests.engine.test_parity_gguf import hf_from_gguf

    path, reference = family_ggufs["gemma3_plain"]
    hf = hf_from_gguf(path)
    ref = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    assert hf.config.layer_types == ref.config.layer_types
    ids = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        torch.testing.assert_close(hf(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_gemma3_gguf_as_transformers_reads_it(family_ggufs, monkeypatch):
    """pagecli agrees with transformers reading the file itself."""
    from tests.engine.test_parity_gguf import hf_from_gguf

    path, _ = family_ggufs["gemma3_plain"]
    _run_and_check(path, hf_from_gguf(path), "q8_0", 6, monkeypatch)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_gemma3_gguf_window_tables_under_preemption_forks_and_turns(family_ggufs, mode):
    """A Gemma 3 file with window tables (five window-24 layers to one global): a KV budget
    that preempts (recompute or swap) while prompts share a prefix, n = 3 forks, and a
    chat's second turn that finds the first turn's blocks in every table; every output (its
    log-probabilities too) is transformers' on the file's values."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import kv_memory

    path, reference = family_ggufs["gemma3_linear"]
    hf = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(12)
    shared = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (40, 80, 100)]
    prompts += [shared + [5, 6, 7], shared + [8, 9]]
    extra = {"preemption_mode": "swap", "swap_space": 0.01} if mode == "swap" else {}
    options = {"block_size": 4, "max_num_batched_tokens": 32}
    llm = LLM(str(path), dtype="float32", kv_cache_memory=kv_memory(hf.config, 24, 4),
              **options, **extra)  # fmt: skip
    assert "window-24" in llm.engine.runner.memory.line()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    assert stats.prefix_hit_tokens > 0 and stats.window_freed_blocks > 0
    for prompt, output in zip(prompts, outputs):
        check_greedy(hf, prompt, output.token_ids)
        check_logprobs(hf, prompt, output, TOP)
    if mode == "swap":
        return
    llm = LLM(str(path), dtype="float32", **options)
    forks = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    (output,) = llm.generate([{"prompt_token_ids": prompts[3]}], forks)  # 51: a partial block
    assert llm.engine.stats().cow_copies > 0 and len(output.outputs) == 3
    for sample in output.outputs:
        check_greedy(hf, prompts[3], sample.token_ids)
    (first,) = llm.generate([{"prompt_token_ids": prompts[2]}], params)
    second = prompts[2] + first.token_ids + [3, 4, 5]
    (warm,) = llm.generate([{"prompt_token_ids": second}], params)
    assert warm.num_cached_tokens == (len(prompts[2]) + NEW_TOKENS - 1) // 4 * 4
    llm.engine.check_invariants()
    check_greedy(hf, second, warm.token_ids)
    check_logprobs(hf, second, warm, TOP)
