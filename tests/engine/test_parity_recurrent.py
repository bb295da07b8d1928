"""Qwen3.5 (3 Gated DeltaNet layers to 1 gated full-attention layer) against transformers on
the same random weights, from safetensors and from a GGUF file as llama.cpp's converter
writes it (tests/gguf_families.py: Q8_0 blocks, value heads in tiled order, A stored as
-exp(A_log), norms as 1 + w; transformers runs on the file's values): mixed batches with
chunked prefills, recompute and swap preemption, n > 1 forks that copy the parent's state,
prefix hits that resume from a state snapshot (and none without snapshots), a budget short
of a slot per sequence, a multimodal checkpoint's language model, and the Gated DeltaNet
recurrence itself (its chunked form against the token-by-token one and transformers')."""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from pagecli.layers.gated_delta import chunked_rule, l2_normalize, recurrent_step
from tests.oracle import check_greedy, check_logprobs

NEW_TOKENS = 16
TOP = 5


@pytest.fixture(scope="module", params=["safetensors", "gguf"])
def qwen35(request, family_models, tmp_path_factory):
    """(model path, transformers on the same values) for each source."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_families import write_family_gguf

    path = reference = family_models["qwen3_5"]
    if request.param == "gguf":
        out = tmp_path_factory.mktemp("qwen35_gguf")
        path, reference = write_family_gguf(path, out, "qwen35", "q8_0")
    hf = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    return path, hf


def test_the_gguf_keeps_its_blocks_and_writes_transformers_weights(qwen35, tmp_path):
    """From the GGUF: the DeltaNet projections stay Q8_0 blocks (in the file's tiled order),
    and the float32 checkpoint written for transformers (baselines) holds the reference's
    values in transformers' order, bit for bit."""
    from safetensors.torch import load_file

    from pagecli.loader.gguf_convert import write_float_weights

    path, hf = qwen35
    if path.suffix != ".gguf":
        pytest.skip("a GGUF file's conversion")
    llm = LLM(str(path), dtype="float32", block_size=4)
    formats = llm.engine.runner.model.weight_formats
    assert formats["in_proj"] == formats["out_proj"] == ["q8_0"], formats
    write_float_weights(path, tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    expected = hf.state_dict()
    assert set(written) == set(expected) - {"lm_head.weight"}
    for name, tensor in written.items():
        assert torch.equal(tensor, expected[name]), name


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (n,), generator=gen).tolist() for n in lengths]


def generate(path, prompts, logprobs=None, n=1, **engine_config):
    llm = LLM(str(path), dtype="float32", block_size=4, **engine_config)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs, n=n
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    return llm, outputs


def test_mixed_batch_with_chunked_prefills(qwen35):
    path, hf = qwen35
    prompts = prompts_of(0, [1, 5, 24, 63, 64, 65, 100, 150, 230])
    llm, outputs = generate(path, prompts, logprobs=TOP, max_num_batched_tokens=32)
    stats = llm.engine.stats()
    assert stats.chunked_prefills > 0
    assert "recurrent states" in llm.engine.runner.memory.line()
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == NEW_TOKENS
        check_greedy(hf, prompt, output.token_ids)
        check_logprobs(hf, prompt, output, TOP)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_recomputes_or_swaps_the_state(qwen35, mode):
    """A KV budget that cannot hold every sequence: a preempted sequence starts again from a
    zeroed state (recompute), or its state goes to host memory with its blocks (swap)."""
    path, hf = qwen35
    prompts = prompts_of(7, [20, 40, 60, 80, 100, 110])
    extra = {"preemption_mode": "swap", "swap_space": 0.01} if mode == "swap" else {}
    llm, outputs = generate(
        path,
        prompts,
        num_kv_blocks=60,  # blocks of 4 tokens of the one attention layer
        max_num_batched_tokens=32,
        **extra,
    )
    stats = llm.engine.stats()
    if mode == "swap":  # the state goes to a host slot beside the blocks, and comes back
        assert stats.preemptions_swap > 0 and llm.engine.runner.num_swap_states > 0
    else:
        assert stats.preemptions_recompute > 0
    for prompt, output in zip(prompts, outputs):
        check_greedy(hf, prompt, output.token_ids)


def llm_state_gib(config, slots: int) -> float:
    """GiB of the state slots the engine keeps for `slots` sequences (float32)."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim += config.linear_num_value_heads * config.linear_value_head_dim
    per_layer = conv_dim * (config.linear_conv_kernel_dim - 1) + (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    )
    layers = config.layer_types.count("linear_attention")
    return slots * layers * per_layer * 4 / 2**30


def test_forked_samples_start_from_the_parents_state(qwen35):
    """n = 3 greedy samples of one prompt: each fork gets a copy of the state the prompt left,
    so every sample is transformers' greedy output."""
    path, hf = qwen35
    (prompt,) = prompts_of(3, [45])
    llm, (output,) = generate(path, [prompt], n=3, max_num_batched_tokens=32)
    assert len(output.outputs) == 3
    for sample in output.outputs:
        check_greedy(hf, prompt, sample.token_ids)
    assert llm.engine.block_manager.num_free_state_slots == llm.engine.runner.num_state_slots


def test_without_snapshots_a_prompt_seen_twice_is_computed_again(qwen35):
    """With no state snapshots (--state-snapshot-stride 0) a prefix hit would skip tokens the
    recurrent state must see: the second request finds nothing and gives the first's tokens."""
    path, hf = qwen35
    (prompt,) = prompts_of(5, [90])
    llm = LLM(str(path), dtype="float32", block_size=4, state_snapshot_stride=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0].token_ids
    second = llm.generate([{"prompt_token_ids": prompt}], params)[0].token_ids
    assert llm.engine.stats().prefix_hit_tokens == 0
    assert first == second
    check_greedy(hf, prompt, first)


@pytest.mark.parametrize("stride", [1, 4])
def test_a_second_turn_resumes_from_a_state_snapshot(qwen35, stride):
    """A chat's second turn (the first turn's prompt and reply, then more): the prefix hit
    ends at the last state snapshot of turn one (blocks of `stride`), its state restored from
    it; the output is a cold engine's and transformers'. A prompt seen again resumes at the
    snapshot saved where its prefill stopped short of its end."""
    path, hf = qwen35
    first, more = prompts_of(6, [150, 30])
    options = {"max_num_batched_tokens": 64, "state_snapshot_stride": stride}
    llm, (reply,) = generate(path, [first], **options)
    step = 4 * stride
    second = first + reply.token_ids + more
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (warm,) = llm.generate([{"prompt_token_ids": second}], params)
    computed = len(first) + NEW_TOKENS - 1  # turn one's tokens with K/V and state
    assert warm.num_cached_tokens == computed // step * step
    llm.engine.check_invariants()
    cold_llm, (cold,) = generate(path, [second], **options)
    assert cold_llm.engine.stats().prefix_hit_tokens == 0
    assert warm.token_ids == cold.token_ids
    check_greedy(hf, second, warm.token_ids)
    (again,) = llm.generate([{"prompt_token_ids": first}], params)
    assert again.num_cached_tokens == (len(first) - 1) // step * step
    assert again.token_ids == reply.token_ids


def test_speculation_and_tight_budgets_end_in_one_line(qwen35):
    from pagecli.errors import KVCacheMemoryError, ModelLoadError

    path, hf = qwen35
    with pytest.raises(ModelLoadError, match="speculative decoding over recurrent"):
        LLM(str(path), dtype="float32", speculative_config={"method": "ngram"})
    one = llm_state_gib(hf.config, 1)
    with pytest.raises(KVCacheMemoryError, match="does not hold a state slot per sequence"):
        LLM(str(path), dtype="float32", kv_cache_memory=one * 8)  # 4 states: 4 snapshots


def test_a_budget_short_of_a_slot_per_sequence_runs_fewer_at_once(qwen35):
    """States take at most half of --kv-cache-memory: room for 7 states gives 3 slots beside
    the 4 snapshots (not --max-num-seqs' 128); 6 prompts wait their turn for a slot and every
    output is transformers'."""
    path, hf = qwen35
    one = llm_state_gib(hf.config, 1)
    budget = 2 * 7.5 * one
    prompts = prompts_of(9, [30, 50, 70, 20, 40, 60])
    llm, outputs = generate(path, prompts, kv_cache_memory=budget, max_num_batched_tokens=64)
    runner = llm.engine.runner
    assert (runner.num_state_slots, runner.num_snapshots) == (3, 4)
    assert runner.memory.states <= budget * 2**30 / 2
    for prompt, output in zip(prompts, outputs):
        check_greedy(hf, prompt, output.token_ids)
    with pytest.raises(ValueError, match="state_snapshot_stride must be an integer >= 0"):
        LLM(str(path), state_snapshot_stride=-1)


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_chunked_recurrence_equals_the_token_by_token_one(n):
    """The chunked form of the gated delta rule (prefill) against one recurrent step per token
    (decode), in float64, from a nonzero state, and against transformers' own reference."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(n)
    heads, dk, dv = 3, 8, 6
    q = l2_normalize(torch.randn(heads, n, dk, generator=gen, dtype=torch.float64)) * dk**-0.5
    k = l2_normalize(torch.randn(heads, n, dk, generator=gen, dtype=torch.float64))
    v = torch.randn(heads, n, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(heads, n, generator=gen, dtype=torch.float64)
    beta = torch.rand(heads, n, generator=gen, dtype=torch.float64)
    state0 = torch.randn(heads, dk, dv, generator=gen, dtype=torch.float64)
    out, state = chunked_rule(q, k, v, g, beta, state0.clone())
    step_state = state0[None].clone()
    for t in range(n):
        o, step_state = recurrent_step(
            q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t], beta[None, :, t],
            step_state,
        )  # fmt: skip
        torch.testing.assert_close(out[:, t], o[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, step_state[0], rtol=1e-10, atol=1e-10)
    # transformers: [B, n, H, d] inputs, q unnormalized (it scales by dk^-0.5 itself)
    ref, ref_state = torch_chunk_gated_delta_rule(
        (q * dk**0.5).transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        g.t()[None], beta.t()[None], initial_state=state0[None], output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(out, ref[0].transpose(0, 1).to(out.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state[0].to(state.dtype), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny Qwen3_5ForConditionalGeneration checkpoint (one vision block, the tiny text
    model), and a Qwen3_5ForCausalLM folder with the same language model's weights."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
    )

    from tests.tiny_models import family_configs

    text = family_configs()["qwen3_5"]
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text.hidden_size,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 1,
    }
    config = Qwen3_5Config(
        text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True
    )
    torch.manual_seed(21)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    root = tmp_path_factory.mktemp("qwen35_multimodal")
    model.save_pretrained(str(root / "multimodal"))
    language = Qwen3_5ForCausalLM(text).eval()
    state = {
        name.replace("model.language_model.", "model."): tensor
        for name, tensor in model.state_dict().items()
        if not name.startswith("model.visual.")
    }
    language.load_state_dict(state)
    language.save_pretrained(str(root / "text"))
    return root / "multimodal", root / "text", model


def test_a_multimodal_checkpoint_runs_its_language_model(multimodal):
    """The released checkpoints' layout (Qwen3_5ForConditionalGeneration: the config's
    text_config, the weights under model.language_model., a vision tower beside them): the
    language model runs, greedy-exact against transformers' multimodal class on text; quantized
    at load it holds the same blocks as the text model's own checkpoint (the DeltaNet's
    in_proj parts included), so both give the same tokens."""
    path, text_path, hf = multimodal
    prompts = prompts_of(13, [1, 9, 70, 130])
    llm, outputs = generate(path, prompts, max_num_batched_tokens=32, quantization="none")
    for prompt, output in zip(prompts, outputs):
        check_greedy(hf, prompt, output.token_ids)
    quantized = []
    for folder in (path, text_path):
        llm, outputs = generate(folder, prompts, max_num_batched_tokens=32, quantization="q8_0")
        formats = llm.engine.runner.model.weight_formats
        assert formats["in_proj"] == formats["out_proj"] == ["q8_0"], formats
        quantized.append([o.token_ids for o in outputs])
    assert quantized[0] == quantized[1]
