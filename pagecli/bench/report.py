"""The results of `pagecli bench` on stdout (a Rich table, one JSON object, or CSV rows), the
machine they ran on, and the progress lines on stderr."""

from __future__ import annotations

import csv
import json
import os
import platform
import sys

from rich.console import Console
from rich.table import Table

PIPE_WIDTH = 240  # a file or pipe gets the whole table, never a cropped one

COLUMNS = [  # (header, row key, format)
    ("engine", "engine", "{}"),
    ("backend", "backend", "{}"),
    ("test", "test", "{}"),
    ("workload", "workload", "{}"),
    ("requests", "num_requests", "{}"),
    ("prompt tok", "prompt_tokens", "{:,}"),
    ("output tok", "output_tokens", "{:,}"),
    ("wall s", "wall_s", "{:.2f}"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("total tok/s", "total_tokens_per_s", "{:.1f}"),
    ("t/s mean ± std", "tokens_per_s_mean", None),
    ("TTFT p50/p99 ms", "ttft_s", None),
    ("TPOT p50/p99 ms", "tpot_s", None),
    ("ITL p50/p99 ms", "itl_s", None),
    ("E2E p50/p99 ms", "e2e_s", None),
    ("peak KV", "peak_kv_blocks", None),
    ("prefix hits", "prefix_hit_rate", "{:.1%}"),
    ("preempt", "preemptions", "{}"),
    # the spec scenario: decode rates without and with speculative decoding
    ("dec tok/s off", "decode_tokens_per_s_off", "{:.1f}"),
    ("dec tok/s on", "decode_tokens_per_s_on", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("accepted", "acceptance_rate", "{:.0%}"),
    ("mean len", "mean_accepted_length", "{:.2f}"),
    ("same tokens", "identical", "{}"),
]
# Shown only in a report of --endpoint rows (one with "endpoints"): the in-process table
# keeps its columns.
SERVING_COLUMNS = {"backend", "itl_s", "e2e_s"}
LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def _cell(row: dict, key: str, fmt: str | None) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key in LATENCY_KEYS:
        return f"{1000 * value['p50']:.0f} / {1000 * value['p99']:.0f}"
    if key == "tokens_per_s_mean":
        return f"{value:.1f} ± {row['tokens_per_s_std']:.1f}"
    if key == "peak_kv_blocks":
        return f"{value}/{row['num_kv_blocks']} ({row['peak_kv_usage']:.0%})"
    return fmt.format(value)


def format_weights(formats: dict[str, str]) -> str:
    """Each layer type's weight format on one line: "embed_tokens q8_0 · qkv_proj q4_1 · ..."."""
    return " · ".join(f"{layer} {fmt}" for layer, fmt in formats.items())


def print_report(report: dict, json_out: bool, csv_out: bool) -> None:
    if json_out:
        print(json.dumps(report, indent=2))
        return
    if csv_out:
        flat = [
            {
                **{
                    k: _info_cell(k, v)
                    for k, v in report.items()
                    if k != "results" and k != "comparison"
                },
                **flatten(row),
            }
            for row in report["results"]
        ]
        keys = list(dict.fromkeys(k for row in flat for k in row))
        writer = csv.DictWriter(sys.stdout, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(flat)
        return
    rows = report["results"]
    serving = "endpoints" in report
    used = [
        c
        for c in COLUMNS
        if any(r.get(c[1]) is not None for r in rows) and (serving or c[1] not in SERVING_COLUMNS)
    ]
    if serving:
        concurrency = report.get("max_concurrency")
        rate = report.get("request_rate")
        title = (
            f"pagecli bench · {report['scenario']} · {len(rows)} endpoint"
            f"{'s' if len(rows) != 1 else ''} · request rate "
            f"{'inf' if rate == 'inf' else f'{rate:g}/s'} · max concurrency "
            f"{concurrency if concurrency is not None else 'unlimited'}"
        )
        caption = f"workload drawn with the vocabulary of {report.get('workload_model')}"
    else:
        title = (
            f"pagecli bench · {report['scenario']} · {report['model']} · {report['dtype']} · "
            f"{report['device']} · {report['threads']} threads"
        )
        caption = report.get("dtype_reason")
    table = Table(title=title, caption=caption)
    for header, _, _ in used:
        table.add_column(
            header,
            justify="left" if header in ("engine", "backend", "test", "workload") else "right",
        )
    for row in rows:
        table.add_row(*(_cell(row, key, fmt) for _, key, fmt in used))
    console = Console(soft_wrap=False)
    if not console.is_terminal:  # a file or pipe gets the whole table, never a cropped one
        console = Console(soft_wrap=False, width=PIPE_WIDTH)
    console.print(table)
    if report.get("weight_formats"):
        console.print(f"weights: {format_weights(report['weight_formats'])}")
    if report.get("threads_reason"):
        per_rank = " per rank" if report.get("tensor_parallel_size", 1) > 1 else ""
        console.print(f"threads: {report['threads']}{per_rank}, {report['threads_reason']}")
    if report.get("tensor_parallel_size", 1) > 1:
        console.print(f"tensor parallel: {report['tensor_parallel_size']} ranks")
    if report.get("memory_line"):
        console.print(f"memory: {report['memory_line']}")
    from pagecli.bench.floor import floor_line

    floor = floor_line(report)
    if floor:
        console.print(f"decode floor: {floor}")
    for row in rows:
        for turn in row.get("turns", []):
            cached = (
                "cache reuse not reported"
                if turn["cached_tokens"] is None
                else f"{turn['cached_tokens']:.0f} reused from the cache"
            )
            who = f"{row['engine']} " if serving else ""
            console.print(
                f"{who}turn {turn['turn']}: {turn['prompt_tokens']:.0f} prompt tokens, "
                f"{cached}, TTFT {1000 * turn['ttft_s']:.0f} ms"
            )
        if row.get("ttft_first_session_s") is not None and row.get("ttft_later_sessions_s"):
            console.print(
                f"first turn TTFT: first session "
                f"{1000 * row['ttft_first_session_s']:.0f} ms, later sessions "
                f"{1000 * row['ttft_later_sessions_s']:.0f} ms"
            )
    for name, value in report.get("comparison", {}).items():
        label = (
            "prefix cache speed-up (wall time off / on)"
            if name == "prefix_cache_speedup"
            else f"{name} output tok/s"
        )
        console.print(f"{label}: {value:.2f}x")


def _info_cell(key: str, value):
    """A report-level figure as one CSV cell."""
    if key == "weight_formats":
        return format_weights(value)
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return value


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested figures as flat CSV columns (`ttft_s_p50`); lists as JSON text."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}_"))
        elif isinstance(value, list):
            out[f"{prefix}{key}"] = json.dumps(value)
        else:
            out[f"{prefix}{key}"] = value
    return out


def note(message: str) -> None:
    """A progress line on stderr."""
    print(f"pagecli: bench: {message}", file=sys.stderr, flush=True)


def machine() -> str:
    """The CPU model and core count, and the GPU where the local engine ran on one (torch is
    imported only where it ran: a bench of remote servers names this client's CPU alone)."""
    from pagecli.engine.cpu_threads import cpu_model

    name = cpu_model(platform.processor() or platform.machine())
    torch = sys.modules.get("torch")
    gpu = torch.cuda.get_device_name(0) if torch and torch.cuda.is_available() else None
    return f"{name}, {os.cpu_count()} CPUs" + (f", {gpu}" if gpu else "")
