"""Greedy ids and top-5 log-probabilities of pagecli on a real GGUF file against transformers
reading the same file (dequantized to float32), on three short real-text prompts: a check for
files too large for `make test` (a real Gemma 3 270M or Qwen2.5-Coder file), not a benchmark.

    .venv/bin/python benchmarks/real_gguf_parity.py FILE.gguf [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
]


def main() -> None:
    from pagecli import LLM, SamplingParams
    from tests.engine.test_parity_gguf import hf_from_gguf
    from tests.oracle import check_greedy, check_logprobs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    llm = LLM(str(args.path), dtype="float32", max_num_batched_tokens=256)
    prompts = [llm.engine.tokenizer.encode(text) for text in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=5)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    print(f"generated in {time.perf_counter() - start:.2f} s")
    model = llm.engine.runner.model
    print(f"layer program: {model._native[1] is not None}; weights: {model.weight_formats}")
    hf = hf_from_gguf(args.path)
    for prompt, output in zip(prompts, outputs):
        print(repr(output.outputs[0].text))
        notes = check_greedy(hf, prompt, output.token_ids)
        check_logprobs(hf, prompt, output, 5, tol=2e-3)
        print(
            f"  greedy ids and top-5 log-probabilities: transformers' ({notes or 'no near-ties'})"
        )


if __name__ == "__main__":
    main()
