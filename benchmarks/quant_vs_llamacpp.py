"""pagecli on quantized GGUF weights against llama.cpp, side by side: one file, one thread count.

Runs, --rounds times, on the same GGUF file (default: the default model's):
1. `llama-bench -p 512 -n 128` and `pagecli bench --scenario latency --pp 512 --tg 128`;
2. `llama-batched-bench -npp 256 -ntg 128 -npl 64` and
   `pagecli bench --num-prompts 64 --input-len 256 --output-len 128` (total tok/s);
3. benchmarks/decode_floor.py: single-stream decode time against bytes read / bandwidth;
then prints each figure of the median round next to issue 13's target. Within a round the
two engines run back to back, in turn first, so that a shared machine's drift (neighbours
come and go within minutes) moves both sides of a ratio. The llama.cpp binaries are the
static builds in ../shared/peers/llama.cpp/bin (see its README). Quiet machines only:
anything else running makes the 2-thread figures meaningless (both engines wait on
descheduled threads).

    .venv/bin/python benchmarks/quant_vs_llamacpp.py [--model FILE.gguf] [--threads 2]
        [--rounds 3] [--repetitions 3] [--skip-batched] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PAGECLI_PEERS", ROOT.parent / "shared" / "peers")) / "llama.cpp"
PAGECLI = Path(sys.executable).parent / "pagecli"


def run(cmd: list[str]) -> str:
    """stdout of `cmd` (stderr passes through), failing loudly."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


def llama_bench(model: str, threads: int, repetitions: int) -> dict[str, float]:
    out = run(
        [
            str(PEERS / "bin" / "llama-bench"),
            "-m",
            model,
            "-t",
            str(threads),
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            str(repetitions),
            "-o",
            "json",
        ]  # fmt: skip
    )
    found = {}
    for row in json.loads(out):
        test = "pp512" if row["n_prompt"] else "tg128"
        found[test] = float(row["avg_ts"])
    return found


def llama_batched(model: str, threads: int) -> float:
    out = run(
        [
            str(PEERS / "bin" / "llama-batched-bench"),
            "-m",
            model,
            "-t",
            str(threads),
            "-c",
            "40000",
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            "256",
            "-ntg",
            "128",
            "-npl",
            "64",
            "--output-format",
            "jsonl",
        ]  # fmt: skip
    )
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed"])  # total tokens (prompt + generated) per second


def pagecli_latency(model: str, threads: int, repetitions: int) -> dict[str, float]:
    out = run(
        [
            str(PAGECLI),
            "bench",
            "--model",
            model,
            "--num-threads",
            str(threads),
            "--scenario",
            "latency",
            "--pp",
            "512",
            "--tg",
            "128",
            "--repetitions",
            str(repetitions),
            "--json",
        ]  # fmt: skip
    )
    report = json.loads(out)
    return {row["test"]: row["tokens_per_s_mean"] for row in report["results"]} | {
        "weight_formats": report.get("weight_formats")
    }


def pagecli_batched(model: str, threads: int) -> float:
    out = run(
        [
            str(PAGECLI),
            "bench",
            "--model",
            model,
            "--num-threads",
            str(threads),
            "--num-prompts",
            "64",
            "--input-len",
            "256",
            "--output-len",
            "128",
            "--json",
        ]  # fmt: skip
    )
    (row,) = json.loads(out)["results"]
    return float(row["total_tokens_per_s"])


def decode_floor(model: str, threads: int) -> dict:
    out = run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "decode_floor.py"),
            "--model",
            model,
            "--threads",
            str(threads),
            "--rounds",
            "3",
            "--json",
        ]  # fmt: skip
    )
    return json.loads(out.strip().splitlines()[-1])


def cpu_name() -> str:
    """lscpu's model name and number, the SIMD flags that matter here, the CPU count."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    have = set(info.get("flags", "").split())
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"]
    flags = " ".join(f for f in wanted if f in have)
    return f"{info.get('model name')} (model {info.get('model')}); {flags}; {os.cpu_count()} CPUs"


def one_round(args, number: int) -> dict:
    """Every figure once, llama.cpp and pagecli back to back (llama.cpp first in even rounds)."""
    pairs = [
        ("llama_bench", lambda: llama_bench(args.model, args.threads, args.repetitions)),
        ("pagecli_latency", lambda: pagecli_latency(args.model, args.threads, args.repetitions)),
    ]
    if not args.skip_batched:
        pairs += [
            ("llama_batched_total_tok_s", lambda: llama_batched(args.model, args.threads)),
            ("pagecli_batched_total_tok_s", lambda: pagecli_batched(args.model, args.threads)),
        ]
    found: dict = {}
    for i in range(0, len(pairs), 2):
        for key, measure in pairs[i : i + 2] if number % 2 == 0 else pairs[i : i + 2][::-1]:
            found[key] = measure()
            print(f"pagecli: quant_vs_llamacpp: round {number}: {key} = {json.dumps(found[key])}",
                  file=sys.stderr)  # fmt: skip
    found["floor"] = decode_floor(args.model, args.threads)
    ours, theirs = found["pagecli_latency"], found["llama_bench"]
    found["ratios"] = {
        "tg128": ours["tg128"] / theirs["tg128"],
        "pp512": ours["pp512"] / theirs["pp512"],
        "decode_over_floor": found["floor"]["decode_over_floor"],
    }
    if not args.skip_batched:
        found["ratios"]["B=64 total"] = (
            found["pagecli_batched_total_tok_s"] / found["llama_batched_total_tok_s"]
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--skip-batched", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from pagecli.loader.resolve import default_gguf_path

        args.model = str(default_gguf_path())
    rounds = [one_round(args, number) for number in range(args.rounds)]
    medians = {
        key: statistics.median(r["ratios"][key] for r in rounds) for key in rounds[0]["ratios"]
    }
    result = {
        "cpu": cpu_name(),
        "model": args.model,
        "threads": args.threads,
        "median_ratios": medians,
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return

    def median_of(get) -> float:
        return statistics.median(get(r) for r in rounds)

    checks = [
        ("tg128", "tg128", lambda r: r["pagecli_latency"]["tg128"],
         lambda r: r["llama_bench"]["tg128"], 1.5),
        ("pp512", "pp512", lambda r: r["pagecli_latency"]["pp512"],
         lambda r: r["llama_bench"]["pp512"], 2.0),
    ]  # fmt: skip
    if not args.skip_batched:
        checks.append(
            ("B=64 total", "B=64 total", lambda r: r["pagecli_batched_total_tok_s"],
             lambda r: r["llama_batched_total_tok_s"], 3.0)
        )  # fmt: skip
    print(f"CPU: {result['cpu']}; {args.threads} threads; {Path(args.model).name}")
    print(f"medians of {args.rounds} rounds; a ratio is the median of the rounds' own ratios")
    print("| test | pagecli t/s | llama.cpp t/s | ratio (rounds) | target |")
    print("| --- | --- | --- | --- | --- |")
    for name, key, ours, theirs, target in checks:
        each = ", ".join(f"{r['ratios'][key]:.2f}" for r in rounds)
        mark = "met" if medians[key] >= target else "missed"
        print(
            f"| {name} | {median_of(ours):.1f} | {median_of(theirs):.1f} | "
            f"{medians[key]:.2f}x ({each}) | >= {target}x ({mark}) |"
        )
    each = ", ".join(f"{r['ratios']['decode_over_floor']:.2f}" for r in rounds)
    ratio = medians["decode_over_floor"]
    mark = "met" if ratio <= 1.5 else "missed"
    print(
        f"single-stream decode: {median_of(lambda r: r['floor']['decode_ms_per_token']):.2f} "
        f"ms/token; floor {rounds[0]['floor']['weight_bytes_per_token'] / 1e6:.1f} MB / "
        f"{median_of(lambda r: r['floor']['read_bandwidth_gb_s']):.1f} GB/s -> {ratio:.2f}x "
        f"({each}; target <= 1.5x, {mark})"
    )


if __name__ == "__main__":
    main()
