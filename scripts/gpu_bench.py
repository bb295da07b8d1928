"""GPU part of scripts/gpu_check.sh: the engine beside transformers' generate on one workload.

A dummy-weights preset in bfloat16 (random weights: throughput does not depend on them), the
same requests for both: prompt and output lengths drawn by a seed, ignore_eos. transformers
runs static batches of 16 with left padding; only each request's own tokens count as useful.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagecli import LLM, SamplingParams  # noqa: E402
from pagecli.loader.resolve import PRESETS_DIR  # noqa: E402

PRESET = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
NUM, BATCH = 64, 16


def workload(vocab: int):
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for _ in range(NUM):
        p = int(torch.randint(128, 513, (1,), generator=gen))
        o = int(torch.randint(64, 257, (1,), generator=gen))
        reqs.append((torch.randint(10, vocab - 10, (p,), generator=gen).tolist(), o))
    return reqs


def run_pagecli(reqs) -> float:
    llm = LLM(f"preset:{PRESET}", load_format="dummy", device="cuda", dtype="bfloat16")
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == sum(o for _, o in reqs)
    del llm
    torch.cuda.empty_cache()
    return wall


@torch.inference_mode()
def run_hf(reqs) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(PRESETS_DIR / f"{PRESET}.json"))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    gen_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    for i in range(0, len(reqs), BATCH):
        chunk = reqs[i : i + BATCH]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        model.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            generation_config=gen_config,
            max_new_tokens=max(o for _, o in chunk),
            min_new_tokens=1,
        )
    torch.cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    import json

    vocab = json.loads((PRESETS_DIR / f"{PRESET}.json").read_text())["vocab_size"]
    reqs = workload(vocab)
    useful = sum(o for _, o in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    print(
        f"preset {PRESET}, bfloat16, {NUM} requests, {prompt_tokens} prompt and {useful} "
        "output tokens (ignore_eos)"
    )
    ours = run_pagecli(reqs)
    print(f"pagecli    wall {ours:7.2f} s   useful output tok/s {useful / ours:8.1f}")
    theirs = run_hf(reqs)
    print(
        f"hf-static  wall {theirs:7.2f} s   useful output tok/s {useful / theirs:8.1f} "
        f"(batches of {BATCH})"
    )
    print(f"ratio pagecli / hf-static: {theirs / ours:.1f}x")
