"""Greedy parity with transformers for the families of models/ (tiny random safetensors):
Gemma 3 (3 sliding layers to 1 global, per-type RoPE, sandwich norms, 1 + w, gelu-tanh,
scaled embeddings), Phi-3 (fused checkpoint tensors, partial rotary, LongRoPE, a window),
Phi-4, SmolLM3 (NoPE layers), OLMo 2 (post-norms, full-width q/k norm), OLMo 3 (OLMo 2 with
windows and RoPE per layer type), Granite (the four multipliers), Mistral and Ministral (real
sliding windows).

Prompts run past the windows (24 tokens) and past Phi-3's original context (64), in chunked
prefills, under preemption (recompute and swap), with prefix-cache hits; each run must take
the layer program, not the Python loop.
"""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from pagecli_kernels import layers_cpu, native
from pagecli_kernels.settings import kernel_settings
from tests.oracle import check_greedy, check_logprobs, compare_with_generate
from tests.tiny_models import VOCAB, WINDOW, kv_memory

FAMILIES = [
    "gemma3",
    "phi3",
    "phi4",
    "smollm3",
    "olmo2",
    "olmo3",
    "granite",
    "mistral_window",
    "ministral",
]
LENGTHS = [1, 5, WINDOW, WINDOW + 1, 31, 64, 65, 100, 150, 230]
NEW_TOKENS = 16
TOP = 5


def random_prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_models):
    from transformers import AutoModelForCausalLM

    path = family_models[request.param]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return request.param, path, hf


@pytest.fixture
def program_calls(monkeypatch) -> list[int]:
    """How many steps ran the native layer program (stays 0 where the loop ran)."""
    calls = [0]
    original = layers_cpu.LayerProgram.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(layers_cpu.LayerProgram, "__call__", counted)
    return calls


def generate(path, prompts, new_tokens=NEW_TOKENS, logprobs=None, **engine_config):
    llm = LLM(str(path), dtype="float32", **engine_config)
    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    return llm, outputs


def test_parity_mixed_batch(family, program_calls):
    name, path, hf = family
    prompts = random_prompts(FAMILIES.index(name))
    llm, outputs = generate(path, prompts, block_size=4, max_num_batched_tokens=64, logprobs=TOP)
    assert llm.engine.stats().chunked_prefills > 0
    if native.enabled():
        assert program_calls[0] > 0  # the one-call path, not the Python loop
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == NEW_TOKENS
        check(hf, name, prompt, output.token_ids)
        # the whole distribution: tied tiny models echo their input token by a wide margin,
        # so the greedy ids alone would not see the attention
        check_logprobs(hf, prompt, output, TOP)
    compare_with_generate(hf, prompts[-1], outputs[-1].token_ids)


def check(hf, name: str, prompt: list[int], output: list[int]) -> None:
    """check_greedy (one forward over prompt + output), except for a LongRoPE model's
    sequence that grows past its original context (phi3: 64 tokens): transformers generates
    its first tokens with the short factors, then drops its cache and goes on with the long
    ones, while one forward over the whole takes the long ones throughout; pagecli follows
    generate (test_long_rope_switches_as_transformers_does)."""
    if name == "phi3" and len(prompt) <= 64 < len(prompt) + len(output):
        compare_with_generate(hf, prompt, output)
    else:
        check_greedy(hf, prompt, output)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parity_under_preemption_and_prefix_hits(family, mode):
    name, path, hf = family
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    prompts = random_prompts(7, [20, 40, 60, 80, 100])
    prompts += [shared + [5, 6, 7], shared + [8, 9]]  # the second finds the first's blocks
    # the KV memory of 60 blocks of 4 = 240 slots of every layer for seven sequences of up to
    # 116 tokens; with windows, of 30 (their tables give back what they no longer read: at 60
    # nothing is preempted)
    blocks = 30 if getattr(hf.config, "sliding_window", None) else 60
    extra = {"preemption_mode": "swap", "swap_space": 0.01} if mode == "swap" else {}
    llm, outputs = generate(
        path,
        prompts,
        block_size=4,
        kv_cache_memory=kv_memory(hf.config, blocks, 4),
        max_num_batched_tokens=32,
        **extra,
    )
    stats = llm.engine.stats()
    if mode == "swap":
        assert stats.preemptions_swap > 0
    else:
        assert stats.preemptions_recompute > 0
    assert stats.prefix_hit_tokens > 0
    for prompt, output in zip(prompts, outputs):
        check(hf, name, prompt, output.token_ids)


def test_long_rope_switches_as_transformers_does(family_models):
    """Phi-3's LongRoPE: transformers rotates a sequence of at most 64 tokens (the original
    context) with the short factors and a longer one, every token of it, with the long ones:
    its generate drops the cache when a sequence grows past 64. pagecli recomputes such a
    sequence whole at that point, and keeps long sequences' blocks apart from short ones'
    in the prefix cache (the same tokens, other factors)."""
    from transformers import AutoModelForCausalLM

    path = family_models["phi3"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    (short,) = random_prompts(5, [56])
    llm = LLM(str(path), dtype="float32", block_size=4)

    def run(prompt: list[int], new_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": prompt}], params)[0].token_ids

    inside = run(short, 4)  # 60 tokens: the short factors throughout
    check_greedy(hf, short, inside)
    hits = llm.engine.stats().prefix_hit_tokens
    long_prompt = short + [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 65 tokens: the long factors
    check_greedy(hf, long_prompt, run(long_prompt, 8))
    assert llm.engine.stats().prefix_hit_tokens == hits  # not the short run's blocks
    crossing = run(short + [9], 20)  # grows past 64: recomputed whole, then long
    assert llm.engine.scheduler.counters.long_context_restarts == 1
    compare_with_generate(hf, short + [9], crossing)
    assert llm.engine.stats().prefix_hit_tokens > hits  # short blocks, then long ones


def test_torch_ops_parity(family, program_calls):
    """The same with the native small ops and attention off (the kernel settings' native):
    the torch versions of every block (the norm styles, partial rotary, gelu-tanh, windowed
    attention), as a machine without a C compiler runs them."""
    name, path, hf = family
    prompts = random_prompts(FAMILIES.index(name) + 50, [3, 30, 70])
    with kernel_settings(native=False):
        _, outputs = generate(path, prompts, block_size=4, max_num_batched_tokens=32)
    assert program_calls[0] == 0
    for prompt, output in zip(prompts, outputs):
        check(hf, name, prompt, output.token_ids)


@pytest.mark.parametrize("name", ["gemma3", "mistral_window"])
def test_a_prompt_that_fits_only_because_windows_give_blocks_back(family_models, name):
    """A KV budget of 40 blocks of every layer (160 tokens) and a prompt of 200: full KV
    cannot hold it (the request is refused with --no-hybrid-kv-cache), the hybrid cache can
    (Gemma 3's window tables, or Mistral's one window table, hold only the blocks of their
    window and one step), and the output is transformers'."""
    from transformers import AutoModelForCausalLM

    from pagecli.errors import RequestError

    path = family_models[name]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    (prompt,) = random_prompts(3, [200])
    budget = {"block_size": 4, "kv_cache_memory": kv_memory(hf.config, 40, 4)}
    full = LLM(str(path), dtype="float32", hybrid_kv_cache=False, **budget)
    with pytest.raises(RequestError, match="exceeds the KV cache"):
        full.engine.check_request(prompt, SamplingParams(max_tokens=NEW_TOKENS))
    llm, (output,) = generate(path, [prompt], max_num_batched_tokens=32, **budget)
    assert llm.engine.capacity_tokens >= len(prompt) + NEW_TOKENS
    stats = llm.engine.stats()
    assert stats.window_freed_blocks > 0 and stats.preemptions_recompute == 0
    assert "window-24" in llm.engine.runner.memory.line()
    check(hf, name, prompt, output.token_ids)


def test_a_second_turn_reuses_every_table(family_models):
    """Gemma 3's second turn (the first turn's prompt and reply, then more) finds the first
    turn's blocks in every table: the full-attention table's from the start, the window
    tables' near the end (freed by the window as the first turn ran, still findable), and
    its output is a cold engine's and transformers'."""
    from transformers import AutoModelForCausalLM

    path = family_models["gemma3"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    first, more = random_prompts(4, [150, 30])
    options = {"block_size": 4, "max_num_batched_tokens": 32}
    llm, (reply,) = generate(path, [first], **options)
    assert llm.engine.stats().window_freed_blocks > 0
    second = first + reply.token_ids + more
    hits = llm.engine.stats().prefix_hit_tokens
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (warm,) = llm.generate([{"prompt_token_ids": second}], params)
    found = llm.engine.stats().prefix_hit_tokens - hits
    assert found == (len(first) + NEW_TOKENS - 1) // 4 * 4  # every full block of turn one
    assert warm.num_cached_tokens == found
    _, (cold,) = generate(path, [second], **options)
    assert warm.token_ids == cold.token_ids
    check(hf, "gemma3", second, warm.token_ids)


@pytest.mark.parametrize("name", ["gemma3", "ministral"])
def test_forked_samples_share_window_tables_and_copy_on_write(family_models, name):
    """n = 3 greedy samples of a prompt longer than the windows: the forks share every table's
    blocks (a window table's given-back entries included), each copies its last block before
    writing it, and every sample is transformers' greedy output."""
    from transformers import AutoModelForCausalLM

    path = family_models[name]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    (prompt,) = random_prompts(8, [75])
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    assert stats.cow_copies > 0 and stats.window_freed_blocks > 0
    assert len(output.outputs) == 3
    for sample in output.outputs:
        check_greedy(hf, prompt, sample.token_ids)
