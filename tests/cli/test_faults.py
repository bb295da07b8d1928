"""`pagecli generate` under faults: signals, a killed run resumed, a closed stdout, a producer
that waits for each answer, --unordered, --fail-fast, and bad models and flags."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.cli.helpers import (
    FAST,
    TIMEOUT_S,
    LineReader,
    jsonl,
    no_traceback,
    records,
    run,
    start,
)
from tests.sizes import size


def test_producer_waits_for_each_answer_then_sigint():
    """The pipe stays open: each record is answered before the next is written; Ctrl-C then
    exits 130 with every finished record written whole."""
    proc = start(["generate", *FAST])
    out = LineReader(proc.stdout)
    try:
        proc.stdin.write(jsonl({"id": "first", "prompt": "Hello"}))
        proc.stdin.flush()
        assert json.loads(out.next())["id"] == "first"
        proc.stdin.write(jsonl({"id": "second", "prompt": "Goodbye"}))
        proc.stdin.flush()
        assert json.loads(out.next())["id"] == "second"
        proc.send_signal(signal.SIGINT)  # stdin is still open
        assert proc.wait(timeout=60) == 130
        assert out.rest() == b""
        no_traceback(proc.stderr.read())
    finally:
        proc.kill()


def test_sigterm_writes_finished_records_and_exits_143():
    """In input order, a short record that finished behind a long one is still written."""
    proc = start(["generate", *FAST, "--progress"])
    out, err = LineReader(proc.stdout), LineReader(proc.stderr)
    try:
        proc.stdin.write(jsonl({"id": "warm", "prompt": "Hi"}))
        proc.stdin.flush()
        assert json.loads(out.next())["id"] == "warm"
        proc.stdin.write(
            jsonl(
                {"id": "long", "prompt": "Tell me a story", "max_tokens": 2000, "ignore_eos": True},
                {"id": "short", "prompt": "Hi", "max_tokens": 1},
            )
        )
        proc.stdin.flush()
        err.until(lambda line: b"2/? records" in line)  # "short" is done, waiting for "long"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        written = records(out.rest())
        assert [r["id"] for r in written] == ["short"]
        assert written[0]["usage"]["completion_tokens"] == 1
    finally:
        proc.kill()


def test_resume_after_kill(tmp_path):
    """SIGKILL after some records, then the same command with --resume: every id once."""
    ids = [f"r{i}" for i in range(4)]
    source = tmp_path / "in.jsonl"
    # the last two run long, so that the kill lands while they do: four records of --max-tokens
    # 6 came out together on a fast machine, between two looks at the file
    long = {"max_tokens": size(120, 300), "ignore_eos": True}
    source.write_bytes(
        jsonl(
            *(
                {"id": i, "prompt": f"Count to {n}", **(long if n >= 2 else {})}
                for n, i in enumerate(ids)
            )
        )
    )
    target = tmp_path / "out.jsonl"
    args = ["generate", *FAST, "--max-num-seqs", "1", "-i", str(source), "-o", str(target)]
    proc = start(args, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (target.exists() and target.read_bytes().count(b"\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    first = records(target.read_bytes())
    assert 2 <= len(first) < len(ids)
    with target.open("ab") as f:
        f.write(b'{"id": "r3", "text": "cut sh')  # a record torn by the kill
    resumed = run([*args, "--resume"])
    assert resumed.returncode == 0 and resumed.stderr == b""
    final = records(target.read_bytes())
    assert sorted(r["id"] for r in final) == ids
    assert final[: len(first)] == first  # the first run's records were kept, not redone
    assert all(r["error"] is None for r in final)


def test_closed_stdout_is_quiet(tmp_path):
    """`pagecli generate ... | head -1`: no traceback, no message."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(*({"prompt": f"Count to {n}"} for n in range(6))))
    proc = start(["generate", *FAST, "--max-num-seqs", "1", "-i", str(source)])
    try:
        first = proc.stdout.readline()
        assert json.loads(first)["id"] == 1
        proc.stdout.close()  # what `head -1` does after its line
        assert proc.wait(timeout=TIMEOUT_S) == 141
        assert proc.stderr.read() == b""
    finally:
        proc.kill()


def test_unordered_and_progress():
    stdin = jsonl(
        {"id": "long", "prompt": "Tell me a story", "max_tokens": 16, "ignore_eos": True},
        {"id": "short", "prompt": "Hi", "max_tokens": 1},
    )
    proc = run(["generate", *FAST, "--unordered", "--progress"], stdin)
    assert proc.returncode == 0
    assert [r["id"] for r in records(proc.stdout)] == ["short", "long"]
    summary = proc.stderr.decode().splitlines()[-1]
    assert summary.startswith("pagecli: 2 records (0 errors)"), summary


def test_fail_fast():
    stdin = jsonl({"id": "ok", "prompt": "Hi"}, "{oops", {"id": "never", "prompt": "Hi"})
    proc = run(["generate", *FAST, "--fail-fast"], stdin)
    assert proc.returncode == 1
    no_traceback(proc.stderr)
    out = records(proc.stdout)
    assert out[-1]["error"]["line"] == 2
    assert "never" not in [r["id"] for r in out]


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("bad-models")
    (root / "not-a-model").mkdir()
    (root / "not-a-model" / "notes.txt").write_text("hello")
    corrupt = root / "corrupt-safetensors"
    corrupt.mkdir()
    (corrupt / "config.json").write_bytes((default_model_dir / "config.json").read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\x07" * 64 + b"not a tensor file")
    (root / "corrupt.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    return {
        "missing path": (str(root / "missing"), "no such file"),
        "not a model": (str(root / "not-a-model"), "not a model"),
        "corrupt safetensors": (str(corrupt), "safetensors"),
        "corrupt gguf": (str(root / "corrupt.gguf"), "GGUF"),
        "hub id not cached": ("pagecli-tests/not-a-cached-model", "cache"),
    }


def test_bad_model_is_one_line_exit_2(bad_models):
    """Each bad --model source: one stderr line naming it and the reason, exit 2."""
    procs = {
        name: start(["generate", "--model", path]) for name, (path, _) in bad_models.items()
    }  # all at once: each only starts Python and fails
    for name, proc in procs.items():
        path, word = bad_models[name]
        out, err = proc.communicate(jsonl({"prompt": "Hi"}), timeout=TIMEOUT_S)
        lines = err.decode().splitlines()
        assert proc.returncode == 2, (name, lines)
        assert out == b"", name
        assert len(lines) == 1 and lines[0].startswith(f"pagecli: {path}"), (name, lines)
        assert word in lines[0], (name, lines[0])


@pytest.mark.parametrize(
    "args, word",
    [
        (["--no-such-flag"], "--no-such-flag"),
        (["--dtype", "float8"], "float8"),
        (["--block-size", "3"], "block_size"),
        (["--temperature", "-1"], "temperature"),
        (["--resume"], "-o FILE"),
        (["--max-line-bytes", "0"], "--max-line-bytes"),
    ],
    ids=[
        "unknown flag",
        "bad choice",
        "bad engine value",
        "bad sampling value",
        "resume no -o",
        "max line bytes",
    ],
)
def test_bad_flags_are_one_line_exit_2(args, word, capsys):
    """Caught before the model loads, so in-process through the console script's main()."""
    from pagecli.cli.app import main

    with pytest.raises(SystemExit) as exit:
        main(["generate", *args])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("pagecli: ") and word in err, err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_ctrl_c_while_the_model_loads_does_not_wait_for_the_load(command):
    """The engine loads on its own thread; a Ctrl-C in the middle ends the process at once
    (exit 130), not once loading is done."""
    proc = start([command, *FAST])
    time.sleep(4)  # imports done (about 2 s here), the engine thread is loading (about 8 s)
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert time.monotonic() - began < 2.5
    no_traceback(err)
    assert out == b""
