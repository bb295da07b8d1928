"""transformers as the oracle for greedy decoding.

`check_greedy` verifies, position by position, that each generated token is transformers'
argmax given the same prefix (one teacher-forced forward pass over prompt + output). By
induction this is exactly transformers' greedy output, except at a near-tie (top-2 logit gap
under NEAR_TIE in the reference), which is reported and allowed; any other difference fails.
`hf_generate` runs transformers' own `generate` for a direct comparison. `check_logprobs`
compares log-probabilities with transformers decoding as its generate does: stronger than the
greedy ids where a tiny model's argmax is trivial (tied embeddings echo the input token).
"""

from __future__ import annotations

import weakref

import pytest
import torch

NEAR_TIE = 1e-4


@torch.inference_mode()
def reference_logits(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' logits predicting each output token: [len(output_ids), V] float32."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = hf_model(input_ids=ids).logits[0].float()  # [P + N, V]
    start = len(prompt_ids) - 1
    return logits[start : start + len(output_ids)]


# Checks that passed, per model: the same tokens checked again (the same workload run with
# preemption, or through other kernels, gives the same output) pass again without another
# forward pass. A failed check is never kept.
_PASSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_greedy(hf_model, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    """Raise AssertionError unless every output token is transformers' greedy choice (or a
    near-tie with it). Returns a note for each near-tie found."""
    passed = _PASSED.setdefault(hf_model, {})
    key = (tuple(prompt_ids), tuple(output_ids))
    if key in passed:
        return list(passed[key])
    notes = _check_greedy(hf_model, prompt_ids, output_ids)
    passed[key] = list(notes)
    return notes


def _check_greedy(hf_model, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    notes = []
    logits = reference_logits(hf_model, prompt_ids, output_ids)
    for step, (token, row) in enumerate(zip(output_ids, logits)):
        best = int(row.argmax())
        if token == best:
            continue
        gap = float(row[best] - row[token])
        top2 = row.topk(2).values
        if gap < NEAR_TIE and float(top2[0] - top2[1]) < NEAR_TIE:
            notes.append(f"step {step}: near-tie {best} vs {token} (gap {gap:.2e})")
            continue
        raise AssertionError(
            f"prompt of {len(prompt_ids)} tokens, step {step}: pagecli chose {token}, "
            f"transformers {best} (logit gap {gap:.3e}, not a near-tie)"
        )
    return notes


@torch.inference_mode()
def hf_generate(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    # No EOS: the engine runs with ignore_eos, which continues past EOS without masking it.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        generation_config=config,
    )
    return out[0, len(prompt_ids) :].tolist()


def compare_with_generate(hf_model, prompt_ids, output_ids) -> None:
    """Our output equals transformers' `generate` up to the first near-tie divergence."""
    ref = hf_generate(hf_model, prompt_ids, len(output_ids))
    for step, (ours, theirs) in enumerate(zip(output_ids, ref)):
        if ours != theirs:
            row = reference_logits(hf_model, prompt_ids, output_ids[:step] + [ours])[-1]
            gap = float(row[theirs] - row[ours]).__abs__()
            assert gap < NEAR_TIE, (
                f"step {step}: pagecli {ours}, transformers.generate {theirs}, gap {gap:.3e}"
            )
            return


@torch.inference_mode()
def decoding_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities for each output token as its generate decodes them:
    one at a time on its KV cache, except that a LongRoPE model's generate drops the cache
    when the sequence grows past the original context and recomputes it whole with the long
    factors (Phi3ForCausalLM.prepare_inputs_for_generation): [len(output), V] float32."""
    rope = getattr(hf.config, "rope_parameters", None) or {}
    longrope = rope.get("rope_type") == "longrope"
    original = rope.get("original_max_position_embeddings") if longrope else None
    tokens = list(prompt)
    step = hf(input_ids=torch.tensor([tokens]), use_cache=True)
    rows = [step.logits[0, -1]]
    for token in output[:-1]:
        tokens.append(token)
        if original is not None and len(tokens) == original + 1:  # generate drops its cache
            step = hf(input_ids=torch.tensor([tokens]), use_cache=True)
        else:
            # transformers 5.25 names the cache `cache`, earlier versions `past_key_values`
            cache = {"cache": step.cache} if "cache" in step else {"past_key_values": step[1]}
            step = hf(input_ids=torch.tensor([[token]]), use_cache=True, **cache)
        rows.append(step.logits[0, -1])
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def check_logprobs(hf, prompt: list[int], output, top_k: int, tol: float = 1e-3) -> None:
    """pagecli's log-probabilities (the chosen token's and the top `top_k`) equal transformers'
    for the same ids, and its top `top_k` values are transformers' top `top_k` values."""
    ref = decoding_logprobs(hf, prompt, output.token_ids)  # [N, V]
    for step, (entry, row) in enumerate(zip(output.outputs[0].logprobs, ref)):
        where = f"prompt of {len(prompt)} tokens, step {step}"
        assert abs(entry.logprob - row[entry.token_id].item()) < tol, where
        ours = {token: lp for token, lp in entry.top}
        theirs = {token: row[token].item() for token in ours}
        assert ours == pytest.approx(theirs, abs=tol), where
        top = row.topk(top_k).values.tolist()
        assert sorted(ours.values(), reverse=True) == pytest.approx(top, abs=tol), where
        assert row[entry.token_id].item() > top[0] - tol, where  # greedy: the top
