"""bfloat16 correctness as agreement with transformers in float32 (a script, not a test).

Over the 24 parity prompts of tests/engine/test_parity_default.py (1 to 500 tokens, default
model): transformers in float32 generates 32 greedy tokens per prompt (its own generate), the
reference. Then,
teacher-forced on prompt + reference, each model's top-1 prediction at those 32 positions is
compared with the reference token:

- transformers in bfloat16: one forward pass over the whole sequence;
- pagecli in bfloat16 (and float32 as a check): the engine's model runner on its own paged
  cache, the prompt as one prefill chunk, then the reference tokens one decode step at a time
  (so both the prefill and the decode attention kernels are exercised).

The issue's bar: pagecli-bf16 agrees at least as often as transformers-bf16, within one
percentage point.

    .venv/bin/python benchmarks/bf16_agreement.py [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagecli import LLM  # noqa: E402
from pagecli.layers.attention import AttentionMetadata  # noqa: E402
from tests.engine.test_parity_default import NEW_TOKENS, PROMPT_LENGTHS, TEXT  # noqa: E402
from tests.oracle import hf_generate  # noqa: E402


def note(text: str) -> None:
    print(f"bf16_agreement: {text}", file=sys.stderr, flush=True)


def parity_prompts(tokenizer_dir: Path) -> list[list[int]]:
    """The parity test's prompts (same text, lengths and offsets)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.encode(TEXT * 8, add_special_tokens=False)
    return [ids[(7 * i) % 97 : (7 * i) % 97 + n] for i, n in enumerate(PROMPT_LENGTHS)]


def hf_reference(hf, prompt: list[int]) -> list[int]:
    """transformers' own greedy continuation of NEW_TOKENS tokens (generate, KV cache)."""
    return hf_generate(hf, prompt, NEW_TOKENS)


@torch.inference_mode()
def hf_predictions(hf, prompt: list[int], reference: list[int]) -> list[int]:
    """transformers' top-1 at the reference positions, teacher-forced in one pass."""
    logits = hf(input_ids=torch.tensor([prompt + reference])).logits[0]  # [P + N, V]
    start = len(prompt) - 1
    return logits[start : start + len(reference)].argmax(-1).tolist()


@torch.inference_mode()
def pagecli_predictions(llm: LLM, prompt: list[int], reference: list[int]) -> list[int]:
    """pagecli's top-1 at the reference positions: the prompt as one prefill chunk, then
    each reference token as a decode step, on blocks 0.. of the runner's cache."""
    runner = llm.engine.runner
    model, block_size = runner.model, runner.block_size
    total = len(prompt) + len(reference)
    num_blocks = -(-total // block_size)
    table = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)  # [1, blocks]
    preds = []

    def forward(ids: list[int], start: int, decode: bool) -> torch.Tensor:
        n = len(ids)
        positions = torch.arange(start, start + n)  # [n]
        lens = torch.tensor([start + n], dtype=torch.int32)  # [1]
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),  # block b holds positions b * bs .. (table = arange)
            num_decode_tokens=1 if decode else 0,
            decode_block_tables=table if decode else None,
            decode_seq_lens=lens if decode else None,
            prefill_block_tables=None if decode else table,
            prefill_seq_lens=None if decode else lens,
            prefill_query_start_loc=None if decode else torch.tensor([0, n], dtype=torch.int32),
        )
        hidden = model(torch.tensor(ids), positions, meta)  # [n, H]
        return model.compute_logits(hidden[-1:])[0]  # [V]

    preds.append(int(forward(prompt, 0, decode=False).argmax()))
    for j, token in enumerate(reference[:-1]):
        preds.append(int(forward([token], len(prompt) + j, decode=True).argmax()))
    return preds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-float32", action="store_true", help="no pagecli-float32 row")
    parser.add_argument(
        "--quantization",
        default="none",
        help="none (default): the GGUF dequantized, so pagecli's bfloat16 weights are "
        "transformers' bfloat16 weights; auto: the file's blocks (activations in --dtype)",
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from pagecli.loader.resolve import resolve_model

    path = resolve_model(None).path
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = parity_prompts(path)
    note("transformers float32: reference continuations")
    hf32 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    references = [hf_reference(hf32, p) for p in prompts]
    del hf32
    rows = []
    hf16 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    note("transformers bfloat16")
    rows.append(
        ("transformers bfloat16", [hf_predictions(hf16, p, r) for p, r in zip(prompts, references)])
    )
    del hf16
    for dtype in ["bfloat16"] + ([] if args.skip_float32 else ["float32"]):
        note(f"pagecli {dtype}")
        llm = LLM(
            None,
            dtype=dtype,
            quantization=args.quantization,
            num_threads=args.threads,
            block_size=16,
            num_kv_blocks=64,
        )
        preds = [pagecli_predictions(llm, p, r) for p, r in zip(prompts, references)]
        rows.append((f"pagecli {dtype}", preds))
        del llm

    total = sum(len(r) for r in references)
    print(
        f"teacher-forced top-1 agreement with transformers float32, {len(prompts)} prompts x "
        f"{NEW_TOKENS} tokens = {total} positions"
    )
    for name, preds in rows:
        agree = sum(a == b for p, r in zip(preds, references) for a, b in zip(p, r))
        print(f"{name:<24}{agree:>6}/{total}  {100 * agree / total:6.2f}%")


if __name__ == "__main__":
    main()
