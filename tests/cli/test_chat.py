"""`pagecli chat`: the REPL driven through prompt-toolkit's pipe input on the default model,
the piped (non-terminal) mode as a real process, and one end-to-end run in a pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from pagecli.chat.console import Chat
from pagecli.chat.framing import messages
from pagecli.chat.repl import Repl, SlashCompleter
from pagecli.chat.state import DATA_DIR_ENV, ChatState
from pagecli.chat.turn import run_turn
from pagecli.cli.app import main
from tests.cli.helpers import PAGECLI, TIMEOUT_S, env, no_traceback

# Longer than one 16-token block, so sessions that share it share whole KV blocks.
SYSTEM = (
    "You are a terse assistant. Answer every question in as few words as you can, "
    "and never apologise."
)
STATS = re.compile(r"(\d+) prefilled · (\d+) reused · TTFT [\d.]+ s · (\d+) tokens")
BLOCK = 16


@pytest.fixture(scope="module")
def llm():
    """The chat's backend: the local engine on its own thread, driven synchronously."""
    from pagecli.backends.local import LocalBackend
    from pagecli.backends.sync import SyncBackend
    from pagecli.config import EngineConfig

    backend = SyncBackend(LocalBackend(EngineConfig(kv_cache_memory=0.25)))
    backend.start()
    yield backend
    backend.close()


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "data"))
    return tmp_path / "data"


def make_chat(llm, stdout=None, system=SYSTEM, **params) -> tuple[Chat, io.StringIO, io.StringIO]:
    out, err = stdout or io.StringIO(), io.StringIO()
    state = ChatState(llm, system, {"temperature": 0.0, "max_tokens": 4, **params})
    return Chat(state, stdout=out, stderr=err), out, err


def drive(chat: Chat, keys: str) -> int:
    """Type `keys` into the REPL (they must end it) and return its exit code."""
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        return Repl(chat, input=pipe, output=DummyOutput()).run()


def stats_lines(err: str) -> list[tuple[int, int, int]]:
    """(prefilled, reused, generated) of every stats line."""
    return [tuple(int(g) for g in m.groups()) for m in STATS.finditer(err)]


def contents(chat: Chat, role: str) -> list[str]:
    return [m["content"] for m in chat.state.current.session.messages if m["role"] == role]


def full_blocks(num_tokens: int) -> int:
    """Tokens in the full blocks of `num_tokens` computed tokens: what a later turn reuses."""
    return num_tokens // BLOCK * BLOCK


def test_replies_stream_to_stdout_and_turns_reuse_the_conversation(llm, data_dir):
    chat, out, err = make_chat(llm)
    keys = 'Hi\rTwo\x1b\rlines\r"""\rA\rblock"""\r\x04'
    assert drive(chat, keys) == 0
    assert contents(chat, "user") == ["Hi", "Two\nlines", "A\nblock"]
    replies = contents(chat, "assistant")
    assert out.getvalue() == "".join(reply + "\n" for reply in replies)  # stdout: replies only
    stats = stats_lines(err.getvalue())
    assert len(stats) == 3 and all(generated == 4 for _, _, generated in stats)
    session = chat.state.current.session
    first_turn = stats[0][0] + stats[0][1] + 4 - 1  # its prompt and all but the last token
    assert stats[1][1] >= full_blocks(first_turn)
    assert stats[2][1] > stats[1][1]
    assert len(session.token_ids) == sum(stats[2])  # prompt of turn 3 + its 4 tokens
    assert "+Hi" in (data_dir / "history").read_text()


def test_slash_commands_answer_in_one_line_on_stderr(llm, data_dir):
    chat, out, err = make_chat(llm)
    script = """/help
/params
/set temperature 0.5
/set temperature hot
/set top_q 1
/set max_tokens none
/set stop ["\\n", "END"]
/nope
/system
/system Be brief.
/new side
/new side
/sessions
/switch nowhere
/switch default
/prompt Hello
/stats
/blocks
/clear
/regen
/load nothing-saved
/exit
"""
    keys = script.replace("\n", "\r")
    assert drive(chat, keys) == 0
    text = err.getvalue()
    assert out.getvalue() == ""
    for line in [
        "/regen",  # /help
        "temperature = 0.5",
        "error: bad value for temperature: 'hot'",
        "error: unknown parameter 'top_q' (did you mean top_p?)",
        "max_tokens = None",
        "stop = ['\\n', 'END']",
        "error: unknown command /nope",
        SYSTEM,
        "new session 'side'",
        "error: a session named 'side' exists",
        "error: no session named 'nowhere'",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>",
        "prefix hit rate",  # /stats
        "GiB mapped weights + ",  # /stats: what the engine holds
        "kernels: native on, layers on, isa ",  # /stats: the CPU kernels' choices
        "cached-free",  # /blocks' legend
        "error: no turn to regenerate",
        "nothing-saved.json: no such session file",
    ]:
        assert line in text, line
    assert re.search(r"^\* side +0 turns", text, re.M)
    assert chat.handle("word " * 6000)  # longer than the KV cache: one line, the chat goes on
    assert "error: prompt of" in err.getvalue() and "does not fit" in err.getvalue()
    assert out.getvalue() == "\n" and chat.state.current.num_turns == 0
    assert set(chat.state.conversations) == {"default", "side"}
    side = chat.state.conversations["side"]
    assert side.system == "Be brief." and side.params["temperature"] == 0.5
    no_traceback(err.getvalue().encode())


def test_completion_of_commands_parameters_and_sessions(llm, data_dir):
    chat, _, _ = make_chat(llm)
    chat.state.new("second")
    completer = SlashCompleter(chat)

    def complete(text: str) -> set[str]:
        return {c.text for c in completer.get_completions(Document(text), CompleteEvent())}

    assert complete("/se") == {"/set", "/sessions"}
    assert complete("/set temp") == {"temperature"}
    assert complete("/switch s") == {"second"}
    assert complete("hello") == set()


def test_ctrl_c_clears_the_line_then_exits_and_ctrl_d_exits(llm, data_dir):
    chat, out, err = make_chat(llm)
    assert drive(chat, "typed but not sent\x03\x03") == 0
    assert drive(chat, "\x04") == 0
    assert chat.state.current.session.messages == [{"role": "system", "content": SYSTEM}]
    assert out.getvalue() == ""


class InterruptingStdout(io.StringIO):
    """Sends this process a SIGINT (a Ctrl-C) after the second piece of reply text, once."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces = 0

    def write(self, text: str) -> int:
        if text.strip():
            self.pieces += 1
            if self.pieces == 2:
                os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def test_ctrl_c_stops_a_reply_and_the_session_keeps_it(llm, data_dir):
    chat, out, err = make_chat(llm, stdout=InterruptingStdout(), max_tokens=64, ignore_eos=True)
    keys = "Tell me a long story.\r/set max_tokens 3\rGo on.\r\x04"
    assert drive(chat, keys) == 0
    interrupted, go_on = [line for line in err.getvalue().splitlines() if "prefilled" in line]
    assert interrupted.endswith("interrupted") and "interrupted" not in go_on
    assert stats_lines(interrupted)[0][2] < 64
    partial, reply = contents(chat, "assistant")
    assert out.getvalue() == f"{partial}\n{reply}\n"
    assert stats_lines(go_on)[0][1] > 0  # the kept tokens were reused

    # A KeyboardInterrupt raised from inside the stream loop is handled the same way.
    def write(delta: str) -> None:
        if delta.strip():
            raise KeyboardInterrupt

    conversation = chat.state.current
    conversation.set_param("max_tokens", 64)
    stats = run_turn(conversation, "Once more.", write)
    assert stats is not None and stats.interrupted and stats.num_generated_tokens < 64
    assert conversation.num_turns == 3
    stats = chat.state.llm.stats()  # taken on the engine thread, after the abort
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_save_load_round_trip_and_regen(llm, data_dir, tmp_path):
    chat, out, err = make_chat(llm)
    saved = tmp_path / "s.json"
    assert drive(chat, f"Hi\r/save {saved}\r/regen\r/save\r\x04") == 0
    first, again = out.getvalue().splitlines()
    assert first == again  # greedy: /regen gives the same reply
    assert chat.state.current.num_turns == 1
    assert (data_dir / "sessions" / "default.json").is_file()
    data = json.loads(saved.read_text())
    assert data["name"] == "default" and data["system"] == SYSTEM
    assert data["parameters"]["max_tokens"] == 4
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    ids = data["token_ids"]

    other, out2, err2 = make_chat(llm, system=None, max_tokens=3)
    assert drive(other, "/load default\rAnd then?\r\x04") == 0  # by name, from the data dir
    session = other.state.current.session
    assert session.token_ids[: len(ids)] == ids  # continued, not re-rendered
    assert other.state.current.params["max_tokens"] == 4  # the saved parameters
    assert "loaded session 'default': 1 turn" in err2.getvalue()
    ((_, reused, _),) = stats_lines(err2.getvalue())
    assert reused >= full_blocks(len(ids) - 1)


def test_bad_options_end_in_one_line(tmp_path, capsys):
    (tmp_path / "sys.txt").write_text("Be brief.")
    for args in (["--system", "a", "--system-file", str(tmp_path / "sys.txt")], ["--n", "2"]):
        with pytest.raises(SystemExit) as exit:
            main(["chat", *args])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("pagecli: ") and err.count("\n") == 1


def test_piped_input_lines_are_messages():
    lines = ["hi\n", "\n", '"""\n', "one\n", 'two"""\n', '"""inline"""\n', "//slash\n"]
    assert list(messages(lines)) == ["hi", "one\ntwo", "inline", "//slash"]


def test_piped_mode_is_a_scripted_conversation(tmp_path):
    """`printf 'hi\\nand then?\\n' | pagecli chat`: two replies, one line each, on stdout."""
    run_env = {**env(), DATA_DIR_ENV: str(tmp_path)}
    args = [
        "chat",
        "--temperature",
        "0",
        "--max-tokens",
        "5",
        "--kv-cache-memory",
        "0.25",
        "--session",
        "work",
    ]
    done = subprocess.run(
        PAGECLI + args,
        input=b"hi\nand then?\n",
        capture_output=True,
        timeout=TIMEOUT_S,
        env=run_env,
    )
    no_traceback(done.stderr)
    assert done.returncode == 0, done.stderr.decode()
    stats = stats_lines(done.stderr.decode())
    assert len(stats) == 2 and stats[1][1] > 0
    saved = json.loads((tmp_path / "sessions" / "work.json").read_text())  # --session saves
    replies = [m["content"] for m in saved["messages"] if m["role"] == "assistant"]
    assert done.stdout.decode() == "".join(reply + "\n" for reply in replies)
    assert len(replies) == 2 and all(replies)


# ---- a real terminal ----------------------------------------------------------------------

# Escape sequences (and one cut short at the end of what was read so far), and carriage returns.
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]|\x1b[=>]|\x1b[^A-Za-z]*$|\r")


class Terminal:
    """`pagecli` on a pseudo-terminal that is its controlling terminal (so Ctrl-C is SIGINT)."""

    def __init__(self, args: list[str], run_env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.proc = subprocess.Popen(
            PAGECLI + args,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=run_env,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.master = master
        self.raw = b""
        self.seen = 0  # how much of the screen text `expect` has consumed

    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    def read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # the child closed the terminal
            return False
        self.raw += data
        for _ in range(data.count(b"\x1b[6n")):  # prompt-toolkit asks where the cursor is
            self.send("\x1b[1;1R")
        return bool(data)

    def expect(self, pattern: str, timeout: float = TIMEOUT_S) -> re.Match:
        """Wait for `pattern` in the text after what earlier calls matched."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.compile(pattern).search(self.text(), self.seen)
            if match:
                self.seen = match.end()
                return match
            left = deadline - time.monotonic()
            assert left > 0 and self.read(min(left, 0.5)), (
                f"no {pattern!r} in: {self.text()[self.seen :]!r}"
            )

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def type(self, keys: str) -> None:
        """Type at the next prompt (once it is up, keys such as Ctrl-D reach prompt-toolkit
        rather than the tty's line discipline)."""
        self.expect(r">>> ")
        self.send(keys)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def test_end_to_end_in_a_terminal(tmp_path):
    run_env = {**env(), DATA_DIR_ENV: str(tmp_path), "TERM": "xterm-256color"}
    term = Terminal(
        [
            "chat",
            "--system",
            SYSTEM,
            "--temperature",
            "0",
            "--max-tokens",
            "4",
            "--kv-cache-memory",
            "0.25",
        ],
        run_env,
    )
    try:
        term.expect(r"KV blocks 0/\d+ in use")  # the toolbar, under the first prompt
        term.send("Hi\r")
        first = term.expect(r"Hi\n(.+)\n(\d+) prefilled · (\d+) reused")
        assert first.group(1).strip()  # the reply, then its stats line

        # A long reply, stopped with Ctrl-C once it streams; the chat goes on.
        term.type("/set max_tokens 200\r")
        term.expect(r"max_tokens = 200")
        term.type("/set ignore_eos true\r")
        term.expect(r"ignore_eos = True")
        term.type("Tell me a very long story about the sea.\r")
        term.expect(r"story about the sea\.\n[A-Za-z]{2}")  # the reply is streaming
        term.send("\x03")
        stopped = term.expect(r"(\d+) tokens( at [\d.]+ tok/s)? · interrupted")
        assert int(stopped.group(1)) < 200
        term.type("/set max_tokens 4\r")
        term.expect(r"max_tokens = 4")
        saved = tmp_path / "first.json"
        term.type(f"/save {saved}\r")
        term.expect(r"saved session 'default'")

        # A second session with the same system prompt reuses its KV blocks.
        term.type("/new second\r")
        term.expect(r"new session 'second'")
        term.type("Hello\r")
        second = term.expect(r"(\d+) prefilled · (\d+) reused")
        assert int(second.group(2)) >= BLOCK

        term.type(f"/load {saved}\r")
        term.expect(r"loaded session 'default': 2 turns \((\d+) token ids kept\)")
        term.type("/sessions\r")
        term.expect(r"\* default +2 turns")
        term.type("\x04")
        assert term.proc.wait(timeout=30) == 0
    finally:
        term.close()
    data = json.loads(saved.read_text())
    assert len(data["messages"]) == 5 and data["messages"][-1]["content"]  # the kept part
    assert "Traceback" not in term.text()
