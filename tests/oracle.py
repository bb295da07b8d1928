"""transformers as the oracle for greedy decoding.

`check_greedy` verifies, position by position, that each generated token is transformers'
argmax given the same prefix (one teacher-forced forward pass over prompt + output). By
induction this is exactly transformers' greedy output, except at a near-tie (top-2 logit gap
under NEAR_TIE in the reference), which is reported and allowed; any other difference fails.
`hf_generate` runs transformers' own `generate` for a direct comparison.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4


@torch.inference_mode()
def reference_logits(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' logits predicting each output token: [len(output_ids), V] float32."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = hf_model(input_ids=ids).logits[0].float()  # [P + N, V]
    start = len(prompt_ids) - 1
    return logits[start : start + len(output_ids)]


def check_greedy(hf_model, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    """Raise AssertionError unless every output token is transformers' greedy choice (or a
    near-tie with it). Returns a note for each near-tie found."""
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
