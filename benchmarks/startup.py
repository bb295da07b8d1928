"""Start-up cost of the real `pagecli` process on the default model: wall time from process
start to exit, and the process's peak RSS, median of N runs after one warm-up (warm page cache,
the GGUF's converted folder already made).

| case           | command                                                  | target  |
| -------------- | -------------------------------------------------------- | ------- |
| help           | pagecli --help                                           | < 0.3 s |
| generate-help  | pagecli generate --help                                  |         |
| generate-1     | echo '{"prompt":"hi"}' | pagecli generate --max-tokens 1 | < 3 s   |
| generate       | echo '{"prompt":"hi"}' | pagecli generate (256 tokens)   |         |
| chat-1         | printf 'hi\\n' | pagecli chat --max-tokens 1             | < 3 s   |
| cold-1         | generate-1, the GGUF not yet converted (kernels built)   |         |

Peak RSS target for a one-record generate: < 600 MB.

    .venv/bin/python benchmarks/startup.py [--runs 5] [--cases help,generate-1] [--json]

The box it runs on may be shared: the medians (and the spread shown beside them) say how
noisy the run was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_script = Path(sys.executable).with_name("pagecli")
PAGECLI = str(_script) if _script.exists() else (shutil.which("pagecli") or "pagecli")
RECORD = b'{"prompt": "hi"}\n'

# name -> (arguments, stdin, fresh cache dir per run, target seconds, target MB)
CASES: dict[str, tuple[list[str], bytes, bool, float | None, float | None]] = {
    "help": (["--help"], b"", False, 0.3, None),
    "generate-help": (["generate", "--help"], b"", False, None, None),
    "generate-1": (["generate", "--max-tokens", "1"], RECORD, False, 3.0, 600.0),
    "generate": (["generate"], RECORD, False, None, 600.0),
    "chat-1": (["chat", "--max-tokens", "1"], b"hi\n", False, 3.0, None),
    "cold-1": (["generate", "--max-tokens", "1"], RECORD, True, None, None),
}


def run_once(args: list[str], stdin: bytes, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one run of the real process."""
    with tempfile.TemporaryFile() as inp:
        inp.write(stdin)
        inp.seek(0)
        start = time.perf_counter()
        pid = os.posix_spawn(
            PAGECLI,
            [PAGECLI, *args],
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, inp.fileno(), 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
        )
        _, status, usage = os.wait4(pid, 0)  # this child's own rusage
        wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"pagecli {' '.join(args)} exited {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_maxrss / 1024  # Linux: KiB


def fresh_cache() -> str:
    """A cache dir where only the GGUF conversion is missing: the built kernels and the CPU
    dtype probe are copied from the user cache (building the kernels takes seconds more)."""
    from pagecli.loader.resolve import cache_root

    cache = tempfile.mkdtemp(prefix="pagecli-startup-")
    user = cache_root()
    if (user / "kernels").is_dir():
        shutil.copytree(user / "kernels", Path(cache) / "kernels")
    if (user / "cpu_dtype_probe.json").is_file():
        shutil.copy(user / "cpu_dtype_probe.json", cache)
    return cache


def measure(name: str, runs: int) -> dict:
    args, stdin, cold, target_s, target_mb = CASES[name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    walls, rss = [], []
    for i in range(runs + (0 if cold else 1)):  # warm: one uncounted warm-up run first
        cache = fresh_cache() if cold else None
        if cache is not None:
            env["PAGECLI_CACHE_DIR"] = cache
        try:
            wall, peak = run_once(args, stdin, env)
        finally:
            if cache is not None:
                shutil.rmtree(cache, ignore_errors=True)
        if cold or i > 0:
            walls.append(wall)
            rss.append(peak)
    return {
        "case": name,
        "command": "pagecli " + " ".join(args),
        "runs": runs,
        "wall_s_median": statistics.median(walls),
        "wall_s_min": min(walls),
        "wall_s_max": max(walls),
        "peak_rss_mb_median": statistics.median(rss),
        "target_s": target_s,
        "target_mb": target_mb,
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<14} {'wall s (median)':>16} {'min..max':>13} {'peak RSS MB':>12}  target")
    for r in rows:
        targets = []
        if r["target_s"] is not None:
            targets.append(f"< {r['target_s']:g} s")
        if r["target_mb"] is not None:
            targets.append(f"< {r['target_mb']:g} MB")
        spread = f"{r['wall_s_min']:.2f}..{r['wall_s_max']:.2f}"
        print(
            f"{r['case']:<14} {r['wall_s_median']:>16.2f} {spread:>13} "
            f"{r['peak_rss_mb_median']:>12.0f}  {', '.join(targets)}"
        )
    print(f"(median of {rows[0]['runs']} runs each; {os.cpu_count()} CPUs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    opts = parser.parse_args()
    names = [n.strip() for n in opts.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)} (known: {', '.join(CASES)})")
    rows = [measure(name, opts.runs) for name in names]
    if opts.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
