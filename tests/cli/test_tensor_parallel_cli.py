"""`-tp 2` through the real commands: `pagecli generate` gives the TP=1 token ids on the
default model; a worker killed mid-run ends the run with one line, within seconds, leaving
no process; a split that cannot be made is one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.cli import helpers
from tests.cli.helpers import PAGECLI, jsonl, records, run, start

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Tell me about the moon in three sentences.",
    "List five colours:",
]


def test_tp2_equals_tp1_on_the_default_model():
    lines = jsonl(*({"id": i, "prompt": p} for i, p in enumerate(PROMPTS)))
    args = ["--temperature", "0", "--max-tokens", "40", "--kv-cache-memory", "0.25"]
    one = run(["generate", *args, "--threads", "1"], lines)
    two = run(["generate", *args, "-tp", "2", "--threads", "1"], lines)
    assert one.returncode == 0 and two.returncode == 0, two.stderr.decode()
    ids_one = {r["id"]: r["token_ids"] for r in records(one.stdout)}
    ids_two = {r["id"]: r["token_ids"] for r in records(two.stdout)}
    assert len(ids_one) == len(PROMPTS)
    assert ids_two == ids_one
    assert sum(len(ids) for ids in ids_one.values()) > 40  # not all at EOS at once


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _worker(pid: int, deadline: float) -> int:
    """The pid of rank 1: the child whose command line is multiprocessing's spawn."""
    while time.monotonic() < deadline:
        for child in _children(pid):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"multiprocessing.spawn" in cmdline and b"spawn_main" in cmdline:
                return child
        time.sleep(0.1)
    raise AssertionError("no tensor-parallel worker started")


def test_a_killed_worker_ends_the_run_with_one_line():
    def record(i: int) -> dict:
        content = f"Write a long story about dragon number {i}."
        # the first ends soon (the run is under way once it is out); the rest go on
        return {"id": i, "messages": [{"role": "user", "content": content}],
                "max_tokens": 8 if i == 0 else 400}  # fmt: skip

    lines = jsonl(*(record(i) for i in range(8)))
    proc = start(["generate", "-tp", "2", "--threads", "1", "--kv-cache-memory", "0.25"])
    proc.stdin.write(lines)
    proc.stdin.close()
    worker = _worker(proc.pid, time.monotonic() + 120)
    descendants = [worker, *_children(proc.pid)]
    first = proc.stdout.readline()  # the first record is out: the run is under way
    assert json.loads(first)["id"] in range(8)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    code = proc.wait(timeout=30)
    assert time.monotonic() - killed < 10
    err = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    assert code != 0
    lines_err = [line for line in err.splitlines() if line.strip()]
    assert lines_err == [
        "pagecli: the engine stopped: WorkerFailed: tensor-parallel rank 1 died (killed by SIGKILL)"
    ], err
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in descendants), "a process was left behind"


def test_an_impossible_split_is_one_line_and_exit_2():
    done = run(["generate", "-tp", "4"], jsonl({"prompt": "hi"}))
    assert done.returncode == 2
    err = done.stderr.decode()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("pagecli: --tensor-parallel-size 4 cannot split this model: ")
    assert "(sizes that work: 1, 2, 3, 9)" in err
    assert done.stdout == b""


def test_numa_needs_a_node_per_rank():
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    done = run(["generate", "-tp", "2", "--numa"], jsonl({"prompt": "hi"}))
    if nodes >= 2:  # a real multi-node machine: pinned, and it runs
        assert done.returncode == 0, done.stderr.decode()
        return
    assert done.returncode == 2
    err = done.stderr.decode()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"2 ranks need 2 nodes, this machine has {nodes}" in err


def test_ctrl_c_stops_every_rank_and_keeps_finished_records():
    def record(i: int) -> dict:
        content = f"Tell me a long story about the number {i}."
        return {"id": i, "messages": [{"role": "user", "content": content}],
                "max_tokens": 8 if i == 0 else 400}  # fmt: skip

    proc = start(["generate", "-tp", "2", "--threads", "1", "--kv-cache-memory", "0.25"])
    proc.stdin.write(jsonl(*(record(i) for i in range(4))))
    proc.stdin.flush()  # stdin stays open: the run is still reading when Ctrl-C comes
    worker = _worker(proc.pid, time.monotonic() + 120)
    first = json.loads(proc.stdout.readline())
    assert first["id"] == 0 and first["error"] is None
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=30)
    rest = proc.stdout.read().decode()
    err = proc.stderr.read().decode()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        pipe.close()
    assert code == 130, err
    assert "Traceback" not in err
    assert all(json.loads(line)["id"] != 0 for line in rest.splitlines())  # written once
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "rank 1 outlived Ctrl-C"


def test_bench_reports_the_size():
    done = run(["bench", "-tp", "2", "--threads", "1", "--num-prompts", "2", "--input-len", "8",
                "--output-len", "4", "--kv-cache-memory", "0.25", "--json"])  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(done.stdout)
    assert report["tensor_parallel_size"] == 2
    assert "shared by 2 tensor-parallel ranks" not in report["threads_reason"]  # as asked
    assert report["threads"] == 1


def test_ctrl_c_at_the_terminal_while_workers_start():
    """A terminal's Ctrl-C goes to the whole process group, workers included, even while
    they are still starting: no traceback from any of them, and none left behind."""
    proc = start(["generate", "-tp", "2", "--threads", "1"], start_new_session=True)
    worker = _worker(proc.pid, time.monotonic() + 60)  # spawned: importing torch now
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


FAULT_HOOK = """
import os
if os.environ.get("PAGECLI_TEST_WORKER_FAULT"):  # only tensor-parallel workers run steps
    import pagecli.engine.model_runner as mr

    step = mr.ModelRunner.run_worker_step
    calls = [0]

    def faulty(self, inputs):
        calls[0] += 1
        if calls[0] == int(os.environ["PAGECLI_TEST_WORKER_FAULT"]):
            raise RuntimeError("injected fault")
        return step(self, inputs)

    mr.ModelRunner.run_worker_step = faulty
"""


def test_a_worker_that_raises_ends_the_run_with_its_reason(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAULT_HOOK)
    messages = [{"role": "user", "content": "Count from one to one hundred."}]
    env = {"PYTHONPATH": str(tmp_path), "PAGECLI_TEST_WORKER_FAULT": "20"}
    args = ["generate", "-tp", "2", "--threads", "1", "--kv-cache-memory", "0.25"]
    proc = subprocess.Popen(
        [*PAGECLI, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**helpers.env(), **env},
    )
    started = time.monotonic()
    # ignore_eos: the reply (sampled at generate's default temperature) outlasts step 20
    record = {"messages": messages, "max_tokens": 200, "ignore_eos": True}
    _, err = proc.communicate(jsonl(record), timeout=120)
    assert proc.returncode == 1, err.decode()
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert lines == [
        "pagecli: the engine stopped: WorkerFailed: tensor-parallel rank 1 failed: "
        "RuntimeError: injected fault"
    ], err.decode()
    assert time.monotonic() - started < 60
