"""`pagecli bench` at tiny sizes: every scenario, the JSON schema, CSV, workload files,
`--compare hf`, and `pagecli blocks --demo`.

The command runs in-process through `main()` (stdout and stderr captured apart); the model is
loaded once per prefix-caching setting and handed to the command, so the tests spend their
time on the scenarios, not on loading.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json

import pytest

from pagecli.bench import report as bench_report
from pagecli.bench.scenarios import Range, draw_workload, read_workload, summary
from pagecli.cli import bench as bench_module
from pagecli.cli import blocks as blocks_module
from pagecli.cli.app import main

# float32 pinned: `--dtype auto` is bfloat16 on CPUs with native bfloat16
TINY = ["--num-prompts", "3", "--input-len", "8:16", "--output-len", "4", "--num-kv-blocks", "256"]
TINY += ["--dtype", "float32"]
ROW_KEYS = {
    "engine",
    "num_requests",
    "prompt_tokens",
    "output_tokens",
    "wall_s",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
}
TOP_KEYS = {
    "machine",
    "model",
    "dtype",
    "dtype_reason",
    "device",
    "threads",
    "threads_reason",
    "max_num_seqs",
    "memory",
    "memory_line",
    "version",
    "scenario",
    "results",
    "kernels",
}


@pytest.fixture(scope="module")
def cached_llms():
    return {}


@pytest.fixture(autouse=True)
def reuse_models(monkeypatch, cached_llms):
    """Load each engine configuration once for the whole module."""
    from pagecli.cli.options import load_llm

    def load(config):
        key = dataclasses.replace(config, seed=0)
        if key not in cached_llms:
            cached_llms[key] = load_llm(config)
        llm = cached_llms[key]
        assert not llm.engine.has_unfinished_requests()
        return llm

    monkeypatch.setattr(bench_module, "load_llm", load)
    monkeypatch.setattr(blocks_module, "load_llm", load)
    monkeypatch.setenv("NO_COLOR", "1")


def pagecli(capsys, *args: str) -> tuple[str, str]:
    """Run `pagecli ARGS` in-process; (stdout, stderr). Fails on a non-zero exit."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    assert "Traceback" not in err
    return out, err


def check_row(row: dict) -> None:
    assert ROW_KEYS <= set(row), row
    assert row["wall_s"] > 0 and row["output_tokens_per_s"] > 0
    total = (row["prompt_tokens"] + row["output_tokens"]) / row["wall_s"]
    assert row["total_tokens_per_s"] == pytest.approx(total)


def test_throughput_json_schema(capsys, tmp_path):
    from pagecli_kernels import quant_cpu

    saved = tmp_path / "work.jsonl"
    out, err = pagecli(capsys, "bench", *TINY, "--json", "--save-workload", str(saved))
    report = json.loads(out)
    assert TOP_KEYS <= set(report)
    assert report["scenario"] == "throughput" and report["dtype"] == "float32"
    assert report["device"] == "cpu" and report["threads"] >= 1
    from pagecli.loader.gguf_weights import gguf_tensor_bytes
    from pagecli.loader.resolve import default_gguf_path

    memory = report["memory"]  # counted before loading: the default model's blocks are mapped
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert 0.95 < memory["mapped"] / gguf_tensor_bytes(default_gguf_path()) <= 1
    assert memory["kv"] > 0 and memory["workspace"] > 0
    # the decode floor: the bytes one token reads (the projections, the tied Q8_0 table as
    # the output projection, one row of it) over the measured read bandwidth
    assert report["moe"] is False
    assert report["weight_bytes"] <= report["active_weight_bytes"] < 1.3 * report["weight_bytes"]
    assert report["read_bandwidth_gb_s"] > 0
    floor = report["active_weight_bytes"] / report["read_bandwidth_gb_s"] / 1e6
    assert report["decode_floor_ms"] == pytest.approx(floor)
    assert "decode floor" not in out  # JSON only on stdout
    # CI machines have a C compiler; the kernel names the instruction-set path it runs
    assert report["cpu_attention"].startswith("native C kernel (")
    assert report["dtype_reason"] == "float32, as asked (--dtype)"
    # the default model's own formats: Q4_1 projections, a Q8_0 embedding that is also the head
    assert report["weight_formats"] == {
        "embed_tokens": "q8_0",
        "qkv_proj": "q4_1",
        "o_proj": "q4_1",
        "gate_up_proj": "q4_1",
        "down_proj": "q4_1",
        "lm_head": "tied",
    }
    assert report["cpu_quant_kernels"].startswith("native C kernels (")
    assert report["cpu_gemm"] in ("native", "blas")
    assert report["cpu_quant_tiles"] is quant_cpu.tiles()
    # Q4_1 takes an integer path only under int_dots=on (AVX2); Q8_0 none
    assert report["cpu_quant_int_dots"] is False
    kernels = report["kernels"]  # every choice, resolved (pagecli_kernels.settings.report)
    assert kernels["native"] == "on" and kernels["isa"] == quant_cpu.isa()
    assert kernels["gemm"] == report["cpu_gemm"] and "auto" not in kernels.values()
    (row,) = report["results"]
    check_row(row)
    assert row["engine"] == "pagecli" and row["num_requests"] == 3 and row["output_tokens"] == 12
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(row[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < row[key]["p50"] <= row[key]["p99"]
    assert 0 < row["peak_kv_blocks"] <= row["num_kv_blocks"] == 256
    assert row["preemptions"] == 0
    assert "pagecli: bench:" in err  # progress on stderr only
    workload = read_workload(saved)
    assert len(workload) == 3 and all(n == 4 for _, n in workload)
    assert sum(len(ids) for ids, _ in workload) == row["prompt_tokens"]
    assert workload == draw_workload(3, Range(8, 16), Range(4, 4), 49152, seed=0)
    # the default output is a table (rendered from the same report)
    bench_report.print_report(report, json_out=False, csv_out=False)
    table = capsys.readouterr().out
    assert "pagecli bench · throughput" in table and "out tok/s" in table and "TTFT" in table
    assert "weights: embed_tokens q8_0 · qkv_proj q4_1" in table
    assert f"{row['peak_kv_blocks']}/256" in table  # peak KV blocks / pool


def test_kernels_option_sets_the_choices_and_json_reports_them(capsys):
    """--kernels is applied by the engine when it starts (process-wide: restored after)."""
    from pagecli_kernels import quant_cpu
    from pagecli_kernels.settings import kernel_settings

    with kernel_settings():
        args = [*TINY, "--num-prompts", "1", "--kernels", "small_batches=off,gemm=off"]
        report = json.loads(pagecli(capsys, "bench", *args, "--json")[0])
        assert not quant_cpu.small_batches() and quant_cpu.gemm() is None
    assert report["kernels"]["small_batches"] == "off" and report["kernels"]["gemm"] == "off"
    assert report["kernels"]["isa"] == quant_cpu.isa() and quant_cpu.small_batches()


def test_bfloat16_json_names_who_multiplies_its_batches(capsys):
    from pagecli_kernels import quant_cpu

    args = [*TINY[:-2], "--dtype", "bfloat16", "--quantization", "none", "--json"]
    report = json.loads(pagecli(capsys, "bench", *args)[0])
    assert report["dtype"] == "bfloat16"
    want = "torch (oneDNN)"
    if quant_cpu.bf16_gemm() == "tiles":
        want = "native (AMX tiles) to 256 rows, torch (oneDNN) above"
    elif quant_cpu.bf16_gemm() == "float32":
        want = "native (float32 panels)"
    elif quant_cpu.bf16_gemm() == "pairs":
        want = "native (VDPBF16PS)" if quant_cpu.bf16_gemm_native() else "native (portable loop)"
    assert report["cpu_bf16_gemm"] == want
    assert "cpu_bf16_gemm" not in json.loads(pagecli(capsys, "bench", *TINY, "--json")[0])


def test_workload_draw_is_seeded_and_in_range():
    a = draw_workload(5, Range(8, 16), Range(4, 6), 1000, seed=3)
    assert a == draw_workload(5, Range(8, 16), Range(4, 6), 1000, seed=3)
    assert a != draw_workload(5, Range(8, 16), Range(4, 6), 1000, seed=4)
    assert all(8 <= len(ids) <= 16 and 4 <= n <= 6 for ids, n in a)
    assert all(100 <= t <= 900 for ids, _ in a for t in ids)
    assert summary([1.0, 2.0, 3.0, 4.0])["p50"] == 2.5 and summary([]) is None


def test_prefix_scenario_with_caching_on_and_off(capsys):
    out, _ = pagecli(capsys, "bench", "--scenario", "prefix", *TINY, "--prefix-len", "32", "--json")
    report = json.loads(out)
    on, off = report["results"]
    assert (on["engine"], off["engine"]) == ("pagecli", "pagecli-no-prefix-cache")
    check_row(on)
    check_row(off)
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert on["prefix_hit_rate"] > 0 and off["prefix_hit_rate"] == 0
    assert report["comparison"]["prefix_cache_speedup"] == pytest.approx(
        off["wall_s"] / on["wall_s"]
    )


def test_chat_scenario_reuses_the_system_prompt(capsys):
    out, _ = pagecli(
        capsys,
        "bench",
        "--scenario",
        "chat",
        "--sessions",
        "2",
        "--turns",
        "2",
        "--output-len",
        "3",
        "--prefix-len",
        "40",
        "--num-kv-blocks",
        "256",
        "--json",
    )
    (row,) = json.loads(out)["results"]
    check_row(row)
    assert row["num_requests"] == 4
    first, second = row["turns"]
    assert first["cached_tokens"] > 0  # the second session reuses the system prompt
    assert second["cached_tokens"] > first["cached_tokens"]  # and each session its history
    assert row["ttft_first_session_s"] > 0 and row["ttft_later_sessions_s"] > 0


def test_latency_scenario_mean_and_std(capsys):
    out, _ = pagecli(
        capsys,
        "bench",
        "--scenario",
        "latency",
        "--pp",
        "16",
        "--tg",
        "4",
        "--repetitions",
        "2",
        "--num-kv-blocks",
        "256",
        "--csv",
    )
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for r in rows:
        assert float(r["tokens_per_s_mean"]) > 0 and float(r["tokens_per_s_std"]) >= 0
        assert r["num_requests"] == "2" and r["scenario"] == "latency"


def test_latency_scenario_warms_up_with_a_prompt_of_the_pp_length(capsys, monkeypatch):
    """As llama-bench does: one untimed prompt of --pp tokens before the timed ones (the first
    prompt of a length pays the page faults of its KV blocks and work buffers), fresh ids each
    time, and the row counts only the timed repetitions (fails without the warm-up prompt)."""
    from pagecli.bench import scenarios

    seen = []
    run = scenarios.EngineRunner.run_requests

    def recording(self, workload):
        seen.append([(tuple(ids), max_tokens) for ids, max_tokens in workload])
        return run(self, workload)

    monkeypatch.setattr(scenarios.EngineRunner, "run_requests", recording)
    out, _ = pagecli(capsys, "bench", "--scenario", "latency", "--pp", "24", "--tg", "0",
                     "--repetitions", "2", "--num-kv-blocks", "256", "--json")  # fmt: skip
    (row,) = json.loads(out)["results"]
    assert row["num_requests"] == 2 and row["prompt_tokens"] == 48
    long = [w for w in seen if len(w[0][0]) == 24]
    assert seen.index(long[0]) == len(seen) - 3  # the warm-up, then the 2 timed prompts
    assert len({w[0][0] for w in long}) == 3


def test_spec_workloads_paste_each_function_as_valid_python():
    """The spec scenario's code prompts carry each function's source as a user pastes it: valid
    Python, the body indented under its `def` (fails where the method's common indentation is
    taken from its body lines alone, as inspect.cleandoc does)."""
    import ast

    from pagecli.bench.spec import workloads

    prompts = workloads(3)
    assert list(prompts) == ["code_edit", "quote", "json_extraction", "chat"]
    for name in ("code_edit", "quote", "json_extraction"):
        assert len(prompts[name]) == 3
        for (message,) in prompts[name]:
            code = message["content"].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
            (function,) = ast.parse(code).body
            assert isinstance(function, ast.FunctionDef) and len(function.body) > 1


def test_spec_scenario_rows(capsys):
    out, err = pagecli(
        capsys,
        "bench",
        "--scenario",
        "spec",
        "--num-prompts",
        "1",
        "--output-len",
        "16",
        "--repetitions",
        "1",
        "--num-kv-blocks",
        "256",
        "--json",
    )
    report = json.loads(out)
    rows = report["results"]
    assert [row["workload"] for row in rows] == ["code_edit", "quote", "json_extraction", "chat"]
    for row in rows:
        assert row["identical"], row  # greedy: the same tokens with drafts and without
        assert 0 < row["output_tokens"] <= 16
        off, on = row["decode_tokens_per_s_off"], row["decode_tokens_per_s_on"]
        assert off > 0 and on > 0 and row["speedup"] == pytest.approx(on / off)
        assert 0 <= row["acceptance_rate"] <= 1
        assert row["mean_accepted_length"] == 0 or row["mean_accepted_length"] >= 1
    # the code edit repeats its prompt's lines: drafts are made and accepted
    edit = rows[0]
    assert edit["acceptance_rate"] > 0 and edit["mean_accepted_length"] > 1, edit
    assert "spec: 4 workloads x 1 prompts" in err


def test_latency_runs_one_sequence_at_a_time(capsys):
    """The latency scenario runs one request at a time, as chat does: an engine of one
    sequence unless --max-num-seqs is given, whose steps take the integer paths (on AVX2,
    the default model's Q4_1 too: engine/spec_decode/invariance.py); the JSON says so."""
    from pagecli_kernels import quant_cpu
    from pagecli_kernels.settings import kernel_settings

    args = ["bench", "--scenario", "latency", "--pp", "8", "--tg", "2", "--repetitions", "1"]
    args += ["--num-kv-blocks", "256", "--json"]
    one = json.loads(pagecli(capsys, *args)[0])
    several = json.loads(pagecli(capsys, *args, "--max-num-seqs", "2")[0])
    assert one["max_num_seqs"] == 1 and several["max_num_seqs"] == 2
    q4_1 = False
    if quant_cpu.int_dots():
        with kernel_settings(int_dots="on"):
            q4_1 = "q4_1" in quant_cpu.int_dots_formats()
    assert one["cpu_quant_int_dots"] is q4_1
    assert several["cpu_quant_int_dots"] is False


def test_compare_hf_on_a_tiny_workload(capsys, tmp_path):
    work = tmp_path / "work.jsonl"
    work.write_text(
        "".join(
            json.dumps({"prompt_token_ids": list(range(500, 500 + n)), "max_tokens": 4}) + "\n"
            for n in (8, 12, 16)
        )
    )
    out, err = pagecli(
        capsys,
        "bench",
        "--workload",
        str(work),
        "--num-kv-blocks",
        "256",
        "--compare",
        "hf",
        "--hf-batch-size",
        "2",
        "--json",
    )
    report = json.loads(out)
    engines = [r["engine"] for r in report["results"]]
    assert engines[:2] == ["pagecli", "hf-static"]
    for row in report["results"]:
        check_row(row)
        assert (
            row["output_tokens"] == 12
            and row["prompt_tokens"] == report["results"][0]["prompt_tokens"]
        )
    static = report["results"][1]
    assert static["generated_tokens"] == 12  # every request asks for 4: no padding waste
    assert report["comparison"]["pagecli/hf-static"] == pytest.approx(
        report["results"][0]["output_tokens_per_s"] / static["output_tokens_per_s"]
    )
    if "hf-cb" in engines:
        assert "pagecli/hf-cb" in report["comparison"]
    else:
        assert "hf-cb skipped" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input-len", "9:3"], "--input-len"),
        (["--json", "--csv"], "one of --json and --csv"),
        (["--scenario", "chat", "--compare", "hf"], "throughput and prefix"),
        (["--preset", "huge"], "unknown --preset"),
    ],
)
def test_bad_options_are_one_line_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_blocks_demo_shows_every_state_and_writes_svg(capsys, tmp_path):
    svg = tmp_path / "blocks.svg"
    out, _ = pagecli(capsys, "blocks", "--demo", "--svg", str(svg))
    assert "blocks in use" in out and "1 cell = 1 block of 16 tokens" in out
    legend = out[out.index("1 cell") :]
    for label in ("shared (ref > 1)", "in use", "cached-free (evictable)"):
        count = int(legend.split(label)[1].split()[0])
        assert count > 0, f"the demo shows no {label} blocks"
    text = svg.read_text()
    assert text.startswith("<svg") and "blocks in use" in text.replace("&#160;", " ")


def test_a_workload_that_cannot_fit_is_a_one_line_error(capsys, tmp_path):
    work = tmp_path / "too-long.jsonl"
    work.write_text(json.dumps({"prompt_token_ids": [500] * 5000, "max_tokens": 4}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--workload", str(work), "--num-kv-blocks", "256"])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2 and "workload request 1:" in err and "Traceback" not in err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "text"}\n')
    with pytest.raises(SystemExit):
        main(["bench", "--workload", str(tmp_path / "bad.jsonl"), "--num-kv-blocks", "256"])
    assert "bad.jsonl:1: a workload line needs prompt_token_ids" in capsys.readouterr().err
