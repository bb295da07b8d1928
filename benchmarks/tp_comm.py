"""What tensor parallelism costs per step on this CPU: step time at TP=1 and TP=2, and the
time rank 0 spends in collectives (the all-reduce after each o_proj and down_proj, the
embedding's all-reduce, the logits' gather), per step and per all-reduce; plus a bare gloo
all-reduce of one hidden row between two processes (the latency floor of a collective).

Each case runs in a fresh process (one engine per process), decode-heavy: B prompts of 32
tokens, 64 greedy tokens each; step time = wall time of the decode steps / their count.
Quiet machines only.

    .venv/bin/python benchmarks/tp_comm.py [--model PATH.gguf] [--batches 1,16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = [(1, 2), (1, 1), (2, 1)]  # (tensor_parallel_size, threads per rank)


def run_case(model: str | None, tp: int, threads: int, batch: int, rounds: int) -> dict:
    """One engine in this process: median over `rounds` of the decode step time."""
    import torch

    from pagecli import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, num_threads=threads, num_kv_blocks=512)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    vocab = engine.hf_config.vocab_size
    prompts = [
        {"prompt_token_ids": torch.randint(0, vocab, (32,), generator=gen).tolist()}
        for _ in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    step_ms, comm_ms, reduce_us = [], [], []
    tp_state = engine.runner.tp
    for _ in range(rounds):
        for p in prompts:
            engine.add_request(str(time.monotonic_ns()) + str(id(p)), p["prompt_token_ids"], params)
        engine.step()  # the prefill step
        comm0 = tp_state.comm_seconds if tp_state else 0.0
        reduces0 = tp_state.num_collectives if tp_state else 0
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - start
        step_ms.append(elapsed / steps * 1e3)
        if tp_state:
            comm = tp_state.comm_seconds - comm0
            comm_ms.append(comm / steps * 1e3)
            reduce_us.append(comm / max(1, tp_state.num_collectives - reduces0) * 1e6)
    engine.close()
    return {
        "tp": tp,
        "threads_per_rank": threads,
        "batch": batch,
        "step_ms": statistics.median(step_ms),
        "comm_ms_per_step": statistics.median(comm_ms) if comm_ms else 0.0,
        "us_per_collective": statistics.median(reduce_us) if reduce_us else 0.0,
        # two per layer, the embedding's, and the logits' gather
        "collectives_per_step": (2 * engine.hf_config.num_hidden_layers + 2) if tp > 1 else 0,
    }


def _bare_worker(rank: int, folder: str, width: int, n: int, how: str, out) -> None:
    import torch
    import torch.distributed as dist

    from pagecli_kernels.shm_collective import ShmCollective

    torch.set_num_threads(1)
    init = os.path.join(folder, "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    x = torch.ones(1, width)
    if how == "shm":
        shm = ShmCollective(os.path.join(folder, "shm"), rank, 2, width, 30)
        reduce = shm.all_reduce
    else:
        reduce = dist.all_reduce
    for _ in range(50):
        reduce(x)
    start = time.perf_counter()
    for _ in range(n):
        reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - start) / n * 1e6)
    dist.destroy_process_group()


def bare_all_reduce(width: int, how: str, n: int = 2000) -> float:
    """Microseconds of one all-reduce of a [1, width] float32 row between 2 processes that do
    nothing else, through gloo or the shared memory segment."""
    import multiprocessing as mp

    from pagecli_kernels import shm_collective

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    folder = tempfile.mkdtemp()
    shm_collective.create(os.path.join(folder, "shm"), 2, width)
    args = (folder, width, n, how, out)
    procs = [ctx.Process(target=_bare_worker, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one child's case
    args = parser.parse_args()
    if args.case:
        tp, threads, batch = map(int, args.case.split(","))
        print(json.dumps(run_case(args.model, tp, threads, batch, args.rounds)))
        return
    from pagecli.bench.report import machine

    rows = []
    for batch in map(int, args.batches.split(",")):
        for tp, threads in CASES:
            cmd = [sys.executable, __file__, "--case", f"{tp},{threads},{batch}"]
            cmd += ["--rounds", str(args.rounds)] + (["--model", args.model] if args.model else [])
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr)
    from pagecli.loader.hf_config import load_hf_config
    from pagecli.loader.resolve import resolve_model

    hidden = load_hf_config(resolve_model(args.model)).hidden_size
    result = {
        "machine": machine(),
        "model": args.model or "SmolLM2-135M-Instruct (default)",
        "rows": rows,
        "bare_all_reduce_us": {
            f"{how}, {w} floats": bare_all_reduce(w, how)
            for how in ("gloo", "shm")
            for w in (hidden, 16 * hidden)
        },
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
