"""`pagecli bench`: throughput, prefix, chat and latency scenarios, in-process through the
engine, optionally beside transformers on exactly the same workload (`--compare hf`). With
`--endpoint URL` (repeatable) the throughput, prefix and chat scenarios run against
OpenAI-compatible servers instead, one row each (bench/serving.py).

Results go to stdout (a Rich table, `--json` or `--csv`); progress and the live block display
go to stderr.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import math
import random
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from pagecli import __version__
from pagecli.bench.report import machine, note, print_report
from pagecli.bench.scenarios import (
    EngineRunner,
    Range,
    draw_workload,
    random_ids,
    rates,
    read_workload,
    run_chat,
    run_latency,
    write_workload,
)
from pagecli.cli.display import LiveDisplay
from pagecli.cli.endpoint import EndpointSettings, endpoint_options
from pagecli.cli.options import (
    CliError,
    VerboseOption,
    engine_options,
    given_options,
    load_llm,
    set_verbose,
)
from pagecli.config import EngineConfig
from pagecli_kernels.settings import report as kernel_report

WORKLOAD_PANEL = "Workload"
SERVING_PANEL = "Serving (with --endpoint)"
OUTPUT_PANEL = "Output"
DEFAULTS = {"num_prompts": 64, "input_len": "32:512", "output_len": "16:256"}
PRESETS = {"nano": {"num_prompts": 256, "input_len": "100:1024", "output_len": "100:1024"}}


class Scenario(str, enum.Enum):
    throughput = "throughput"
    prefix = "prefix"
    chat = "chat"
    latency = "latency"
    spec = "spec"


class Compare(str, enum.Enum):
    hf = "hf"


def _opt(panel: str, help: str, *decls: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=panel, **kw)


@engine_options
@endpoint_options(multiple=True)
def bench(
    ctx: typer.Context,
    *,
    scenario: Annotated[Scenario, _opt(WORKLOAD_PANEL, "What to measure.")] = Scenario.throughput,
    preset: Annotated[
        Optional[str],
        _opt(
            WORKLOAD_PANEL,
            "nano: nano-vllm's workload (256 requests, 100..1024 in and out).",
            show_default=False,
        ),
    ] = None,
    num_prompts: Annotated[
        Optional[int], _opt(WORKLOAD_PANEL, "Requests (default 64).", show_default=False)
    ] = None,
    input_len: Annotated[
        Optional[str],
        _opt(WORKLOAD_PANEL, "Prompt tokens, N or MIN:MAX (default 32:512).", show_default=False),
    ] = None,
    output_len: Annotated[
        Optional[str],
        _opt(WORKLOAD_PANEL, "Output tokens, N or MIN:MAX (default 16:256).", show_default=False),
    ] = None,
    prefix_len: Annotated[
        int, _opt(WORKLOAD_PANEL, "Shared system-prompt tokens (prefix and chat scenarios).")
    ] = 256,
    sessions: Annotated[int, _opt(WORKLOAD_PANEL, "Chat sessions (chat scenario).")] = 4,
    turns: Annotated[int, _opt(WORKLOAD_PANEL, "Turns per chat session (chat scenario).")] = 3,
    pp: Annotated[
        int, _opt(WORKLOAD_PANEL, "Prompt tokens of the pp test (latency; 0: skip).")
    ] = 512,
    tg: Annotated[
        int, _opt(WORKLOAD_PANEL, "Generated tokens of the tg test (latency; 0: skip).")
    ] = 128,
    repetitions: Annotated[int, _opt(WORKLOAD_PANEL, "Repetitions of each latency test.")] = 5,
    workload: Annotated[
        Optional[Path],
        _opt(
            WORKLOAD_PANEL,
            "Run a JSONL workload (generate's input: prompt_token_ids, max_tokens).",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    save_workload: Annotated[
        Optional[Path],
        _opt(
            WORKLOAD_PANEL,
            "Write the drawn workload as generate input.",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    compare: Annotated[
        Optional[Compare],
        _opt(
            WORKLOAD_PANEL,
            "Also run transformers (hf-static, hf-cb) on the same workload.",
            show_default=False,
        ),
    ] = None,
    hf_batch_size: Annotated[int, _opt(WORKLOAD_PANEL, "Batch size of hf-static.")] = 16,
    hf_cb: Annotated[
        bool, _opt(WORKLOAD_PANEL, "With --compare hf: include hf-cb when installed.")
    ] = True,
    json_out: Annotated[bool, _opt(OUTPUT_PANEL, "Print one JSON object.", "--json")] = False,
    csv_out: Annotated[bool, _opt(OUTPUT_PANEL, "Print CSV rows.", "--csv")] = False,
    display: Annotated[
        Optional[bool],
        _opt(
            OUTPUT_PANEL,
            "The live block display on stderr (default: when it is a terminal).",
            "--display/--no-display",
            show_default=False,
        ),
    ] = None,
    max_concurrency: Annotated[
        Optional[int],
        _opt(
            SERVING_PANEL,
            "Most requests in flight at once (default: no limit).",
            show_default=False,
        ),
    ] = None,
    request_rate: Annotated[
        float,
        _opt(
            SERVING_PANEL,
            "Requests per second, arriving as a Poisson process (inf: all at once).",
        ),
    ] = math.inf,
    verbose: VerboseOption = False,
    engine_config: EngineConfig,
    endpoint: EndpointSettings,
) -> None:
    """Measure throughput, latency, KV usage and prefix hits; optionally against transformers.

    With --endpoint URL (repeatable, NAME=URL names a row, `local` is this process's engine)
    the throughput, prefix and chat scenarios run against OpenAI-compatible servers, one row
    each, with TTFT, TPOT, ITL and end-to-end latency measured on the client; the workload is
    drawn with the vocabulary of --model.
    """
    set_verbose(verbose)
    workload_seed = engine_config.seed  # --seed draws the workload (and seeds the engine)
    if json_out and csv_out:
        raise CliError("choose one of --json and --csv", exit_code=2)
    if preset is not None and preset not in PRESETS:
        raise CliError(f"unknown --preset {preset!r} (known: {', '.join(PRESETS)})", exit_code=2)
    for name, value in (
        ("--num-prompts", num_prompts),
        ("--sessions", sessions),
        ("--turns", turns),
        ("--repetitions", repetitions),
        ("--hf-batch-size", hf_batch_size),
    ):
        if value is not None and value < 1:
            raise CliError(f"{name} must be >= 1, got {value}", exit_code=2)
    if max_concurrency is not None and max_concurrency < 1:
        raise CliError(f"--max-concurrency must be >= 1, got {max_concurrency}", exit_code=2)
    if not request_rate > 0:  # NaN too
        raise CliError(f"--request-rate must be > 0 (or inf), got {request_rate}", exit_code=2)
    if endpoint.remote:
        if compare is not None:
            raise CliError("--compare hf runs in-process only, not with --endpoint", exit_code=2)
        if scenario in (Scenario.latency, Scenario.spec):
            raise CliError(
                f"--endpoint runs the throughput, prefix and chat scenarios, not {scenario.value}",
                exit_code=2,
            )
    elif max_concurrency is not None or not math.isinf(request_rate):
        raise CliError("--max-concurrency and --request-rate need --endpoint", exit_code=2)
    if compare is not None and scenario in (Scenario.chat, Scenario.latency, Scenario.spec):
        raise CliError(
            f"--compare hf applies to the throughput and prefix scenarios, not {scenario.value}",
            exit_code=2,
        )
    chosen = {**DEFAULTS, **PRESETS.get(preset or "", {})}
    num_prompts = num_prompts or chosen["num_prompts"]
    in_range = Range.parse(input_len or chosen["input_len"], "--input-len")
    out_range = Range.parse(output_len or chosen["output_len"], "--output-len")
    show = display if display is not None else sys.stderr.isatty()

    requests = read_workload(workload) if workload is not None else None  # before loading
    if endpoint.remote:
        from pagecli.bench import serving as bench_serving

        plan, model = bench_serving.make_plan(
            engine_config,
            scenario.value,
            workload=requests,
            num_prompts=num_prompts,
            input_len=in_range,
            output_len=out_range,
            prefix_len=prefix_len,
            sessions=sessions,
            turns=turns,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            save_workload=save_workload,
        )
        report = bench_serving.bench_endpoints(endpoint, engine_config, plan, model)
        print_report(report, json_out, csv_out)
        return
    note(f"loading {engine_config.model or 'the default model'}")
    if scenario == Scenario.prefix:
        engine_config = dataclasses.replace(engine_config, enable_prefix_caching=True)
    if scenario in (Scenario.latency, Scenario.spec) and not given_options(ctx, ["max_num_seqs"]):
        # one request at a time, as in chat: the integer kernels at every batch
        engine_config = dataclasses.replace(engine_config, max_num_seqs=1)
    if scenario == Scenario.spec and engine_config.speculative_config is None:
        from pagecli.config import SpeculativeConfig

        engine_config = dataclasses.replace(engine_config, speculative_config=SpeculativeConfig())
    from pagecli.layers.moe import SparseMoE

    llm = load_llm(engine_config)
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    if requests is None:
        prefix = None
        if scenario == Scenario.prefix:
            prefix = random_ids(random.Random(workload_seed - 1), prefix_len, vocab)
        requests = draw_workload(num_prompts, in_range, out_range, vocab, workload_seed, prefix)
    if save_workload is not None:
        write_workload(save_workload, requests)
    formats = {k: "+".join(v) for k, v in engine.runner.model.weight_formats.items()}
    info = {
        "machine": machine(),
        "model": engine.source.name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "dtype_reason": engine.dtype_choice.reason,
        "device": str(engine.device),
        "threads": engine.runner.thread_choice.num_threads,
        "threads_reason": engine.runner.thread_choice.reason,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "memory": engine.runner.memory.as_dict(),
        "memory_line": engine.runner.memory.line(),
        "version": __version__,
        "scenario": scenario.value,
        "weight_formats": formats,
        "weight_bytes": engine.runner.weight_bytes,
        "active_weight_bytes": engine.runner.active_weight_bytes,
        "moe": any(isinstance(m, SparseMoE) for m in engine.runner.model.modules()),
    }
    if engine.device.type == "cpu":
        from pagecli.bench.floor import read_bandwidth

        # the decode floor's denominator, on the engine's threads (a second on 1 GiB)
        bandwidth = read_bandwidth(engine.runner.thread_choice.num_threads)
        info["read_bandwidth_gb_s"] = bandwidth / 1e9
        info["decode_floor_ms"] = 1000 * engine.runner.active_weight_bytes / bandwidth
        from pagecli_kernels import native, quant_cpu

        reason = native.unavailable_reason()
        info["cpu_attention"] = (
            f"native C kernel ({native.isa()})" if reason is None else f"torch ({reason})"
        )
        if engine.runner.weight_plan.quantized_names:
            info["cpu_quant_kernels"] = f"native C kernels ({quant_cpu.isa()})"
            # whether batches of this model's blocks multiply on AMX's tiles
            names = {name for joined in formats.values() for name in joined.split("+")}
            tiled = not names.isdisjoint(quant_cpu.TILES_FORMATS)
            info["cpu_quant_tiles"] = tiled and quant_cpu.tiles()
            # whether its products take an integer path (VNNI batch-1 K-quants; AVX2's
            # K-quants, and its Q4_0/Q4_1 under int_dots=on), in a decode step's choices (an
            # engine of one sequence at a time turns it on: spec_decode/invariance.py)
            with engine.runner.step_kernels_for(rows=1, drafts=False):
                integer = not names.isdisjoint(quant_cpu.int_dots_formats())
                info["cpu_quant_int_dots"] = integer and quant_cpu.int_dots()
        if quant_cpu.library() is not None:  # who multiplies prefill and batched panels
            info["cpu_gemm"] = quant_cpu.gemm()
            if info["dtype"] == "bfloat16":  # and bfloat16 batches of three rows or more
                info["cpu_bf16_gemm"] = _bf16_gemm_name(quant_cpu)
    with engine.runner.step_kernels_for(rows=1, drafts=False):
        info["kernels"] = kernel_report()  # every CPU kernel choice of a decode step, resolved
    rows: list[dict] = []
    comparison: dict = {}
    with LiveDisplay(enabled=show) as live:

        def refresh(force: bool = False) -> None:
            live.update(engine, force)

        if scenario == Scenario.chat:
            note(f"chat: {sessions} sessions x {turns} turns")
            rows.append(
                run_chat(llm, refresh, sessions, turns, out_range, prefix_len, workload_seed)
            )
        elif scenario == Scenario.latency:
            note(f"latency: pp{pp}, tg{tg}, {repetitions} repetitions")
            rows += run_latency(llm, refresh, pp, tg, repetitions, workload_seed)
        elif scenario == Scenario.spec:
            from pagecli.bench.spec import run_spec

            count = min(num_prompts, 3)
            note(f"spec: 4 workloads x {count} prompts, off and on, {repetitions} repetitions")
            rows += run_spec(llm, refresh, out_range.high, repetitions, count)
        else:
            note(f"pagecli: {len(requests)} requests")
            rows.append(EngineRunner(llm, refresh).run("pagecli", requests))
    if scenario == Scenario.prefix:
        del llm, engine, live  # one engine's KV cache at a time
        gc.collect()
        llm = load_llm(dataclasses.replace(engine_config, enable_prefix_caching=False))
        note(f"pagecli-no-prefix-cache: {len(requests)} requests")
        with LiveDisplay(enabled=show) as live:
            rows.append(
                EngineRunner(llm, lambda force=False: live.update(llm.engine, force)).run(
                    "pagecli-no-prefix-cache", requests
                )
            )
        comparison["prefix_cache_speedup"] = rows[1]["wall_s"] / rows[0]["wall_s"]
    if compare is not None:
        from pagecli.loader.resolve import float_checkpoint

        source_path, dtype = float_checkpoint(llm.engine.source), llm.engine.dtype
        kv_tokens = llm.engine.capacity_tokens  # hf-cb gets the same KV capacity
        del llm
        gc.collect()
        rows += baseline_rows(
            source_path, dtype, requests, hf_batch_size, hf_cb, kv_tokens, verbose
        )
        comparison.update(ratios(rows))
    report = {**info, "results": rows}
    if comparison:
        report["comparison"] = comparison
    print_report(report, json_out, csv_out)


def _bf16_gemm_name(quant_cpu) -> str:
    """Who multiplies bfloat16 batches of more rows than the row kernels take
    (pagecli_kernels.quant_cpu)."""
    from pagecli.layers.linear import BF16Linear

    if quant_cpu.bf16_gemm() == "tiles":
        return f"native (AMX tiles) to {BF16Linear.TILES_ROWS} rows, torch (oneDNN) above"
    if quant_cpu.bf16_gemm() == "float32":
        return "native (float32 panels)"
    if quant_cpu.bf16_gemm() != "pairs":
        return "torch (oneDNN)"
    return "native (VDPBF16PS)" if quant_cpu.bf16_gemm_native() else "native (portable loop)"


def baseline_rows(
    path, dtype, requests, batch_size: int, with_cb: bool, kv_tokens: int, verbose: bool
) -> list:
    """hf-static and (when available) hf-cb rows on the same workload, weights and dtype."""
    from pagecli.bench import baselines

    note(f"loading transformers ({path.name}, {str(dtype).removeprefix('torch.')})")
    model = baselines.load_hf_model(path, dtype)
    runs = []
    note(f"hf-static: {len(requests)} requests in batches of {batch_size}")
    runs.append(baselines.run_hf_static(model, requests, batch_size))
    missing = baselines.hf_cb_available()
    if with_cb and missing:
        note(f"hf-cb skipped: {missing}")
    elif with_cb:
        note(f"hf-cb: {len(requests)} requests")
        runs.append(baselines.run_hf_cb(model, requests, kv_tokens, quiet=not verbose))
    rows = []
    for run in runs:
        row = {
            "engine": run.engine,
            "num_requests": len(requests),
            "prompt_tokens": run.prompt_tokens,
            "output_tokens": run.output_tokens,
            "wall_s": run.wall_s,
        }
        rates(row)
        row["generated_tokens"] = run.generated_tokens
        rows.append(row)
    return rows


def ratios(rows: list[dict]) -> dict:
    """pagecli's output tokens/s over each baseline's."""
    ours = next((r for r in rows if r["engine"] == "pagecli"), None)
    if ours is None:
        return {}
    return {
        f"pagecli/{r['engine']}": ours["output_tokens_per_s"] / r["output_tokens_per_s"]
        for r in rows
        if r["engine"].startswith("hf-") and r["output_tokens_per_s"]
    }
