"""The loop of `pagecli generate`: a reader thread parses input lines onto a queue; the main
thread owns the engine: it adds requests as they arrive, steps while there is work, and blocks
on the queue only when idle, so a producer that waits for each answer before writing the next
line is served. Signals only set a flag, so a record is always written whole, and every
finished record is written before exiting.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

from pagecli.cli.jsonl import (
    BadLine,
    Job,
    encode_record,
    error_record,
    id_key,
    long_line,
    parse_line,
    result_record,
)
from pagecli.cli.jsonl_io import DEFAULT_MAX_LINE_BYTES, LongLine, read_lines
from pagecli.cli.options import CliError
from pagecli.cli.progress import GenerateProgress
from pagecli.engine.llm_engine import RequestError
from pagecli.llm import LLM
from pagecli.outputs import RequestOutput

SIGNAL_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
BROKEN_PIPE_EXIT_CODE = 141  # what a tool killed by SIGPIPE reports
QUEUE_SIZE = 1024  # parsed lines read ahead of the engine


@dataclass
class _EndOfInput:
    error: str | None = None  # why reading stopped early, if it did


class RecordWriter:
    """Writes whole JSONL records to a file descriptor, each with its own flush."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, record: dict[str, Any]) -> None:
        data = memoryview(encode_record(record))
        while data:
            written = os.write(self.fd, data)
            data = data[written:]


class GenerateRun:
    """One pass over the input: admit, step, write; returns the exit code."""

    def __init__(
        self,
        llm: LLM,
        writer: RecordWriter,
        display: GenerateProgress,
        defaults: dict[str, Any],
        *,
        system: str | None,
        ordered: bool,
        fail_fast: bool,
        done_before: set[str],
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        self.llm, self.engine, self.writer, self.display = llm, llm.engine, writer, display
        self.defaults, self.system = defaults, system
        self.ordered, self.fail_fast, self.done_before = ordered, fail_fast, done_before
        self.max_line_bytes = max_line_bytes
        self.model_name = llm.engine.source.name
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.max_in_flight = 2 * llm.config.max_num_seqs
        self.jobs: dict[int, Job] = {}  # slot (output position) -> job in the engine
        self.seen: dict[str, int] = {}  # id key -> line of its first record
        self.pending: dict[int, dict] = {}  # finished records waiting for their turn
        self.num_slots = 0
        self.next_write = 0
        self.eof = False
        self.failed = False
        self.stop_signal: int | None = None
        self._reader: threading.Thread | None = None

    # ---- the loop ------------------------------------------------------------------------

    def run(self, source: BinaryIO) -> int:
        self._reader = threading.Thread(target=self._read, args=(source,), daemon=True)
        self._reader.start()
        previous = {s: signal.signal(s, self._on_signal) for s in SIGNAL_EXIT_CODES}
        self.display.start()
        try:
            self._loop()
        except BrokenPipeError:
            self._abort_all()
            self.display.stop(summary=False)
            _silence_stdout()
            return BROKEN_PIPE_EXIT_CODE
        except BaseException:  # an engine failure: keep what finished, for --resume
            self._abort_all()
            self.display.stop(summary=False)
            with contextlib.suppress(Exception):
                self._write_pending()
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.stop_signal is not None or self.failed:
            self._abort_all()
            self._write_pending()
        self.display.update(force=True)
        self.display.stop()
        if self.stop_signal is not None:
            return SIGNAL_EXIT_CODES[self.stop_signal]
        return 1 if self.failed else 0

    @property
    def reading(self) -> bool:
        """Whether the reader thread is still waiting for input."""
        return self._reader is not None and self._reader.is_alive()

    def _loop(self) -> None:
        while self.stop_signal is None and not self.failed:
            self._take_input()
            if self.failed or self.stop_signal is not None:
                return
            if self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        self._finish(output)
            elif self.eof:
                return
            self._refresh()

    def _take_input(self) -> None:
        """Add what has arrived; wait for input only while the engine has nothing to do."""
        while not self.eof and self.engine.num_unfinished_requests < self.max_in_flight:
            if self.failed or self.stop_signal is not None:
                return
            idle = not self.engine.has_unfinished_requests()
            try:
                item = self.queue.get(timeout=0.1) if idle else self.queue.get_nowait()
            except queue.Empty:
                if not idle:
                    return
                self._refresh()
                continue
            self._handle(item)

    def _read(self, source: BinaryIO) -> None:
        """The reader thread: parse every line onto the queue, then the end marker. A line
        over max_line_bytes is dropped as it is read and answered by an error record."""
        try:
            for line, raw in enumerate(read_lines(source, self.max_line_bytes), start=1):
                if isinstance(raw, LongLine):
                    item = long_line(line, raw.num_bytes, self.max_line_bytes)
                else:
                    item = parse_line(raw, line, self.defaults, self.system)
                if item is not None:
                    self.queue.put(item)
        except OSError as exc:
            self.queue.put(_EndOfInput(f"cannot read input ({exc.strerror or exc})"))
            return
        self.queue.put(_EndOfInput())

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    # ---- records -------------------------------------------------------------------------

    def _handle(self, item: Job | BadLine | _EndOfInput) -> None:
        if isinstance(item, _EndOfInput):
            self.eof = True
            self.display.state.total = self.num_slots
            if item.error:
                print(f"pagecli: {item.error}", file=sys.stderr)
            return
        key = id_key(item.id)
        if key in self.done_before:
            self.display.state.skipped += 1
            return
        if isinstance(item, BadLine):
            self._emit_error(item, item.message)
            return
        if key in self.seen:
            self._emit_error(item, f"duplicate id {item.id!r} (first on line {self.seen[key]})")
            return
        self.seen[key] = item.line
        try:
            token_ids, text = self.llm.encode_prompt(item.prompt)
        except RequestError as exc:  # too long, found before tokenizing all of it
            self._emit_error(item, str(exc))
            return
        except Exception as exc:  # a chat template can reject a conversation in any way
            self._emit_error(item, f"cannot build the prompt: {_first_line(exc)}")
            return
        slot = self._new_slot()
        try:
            self.engine.add_request(str(slot), token_ids, item.params, prompt=text)
        except (RequestError, ValueError) as exc:
            self._emit(slot, error_record(item, str(exc), len(token_ids)), error=True)
            return
        self.jobs[slot] = item

    def _finish(self, output: RequestOutput) -> None:
        slot = int(output.request_id)
        job = self.jobs.pop(slot)
        record = result_record(job, output, self.model_name)
        self.display.state.prompt_tokens += len(output.prompt_token_ids)
        self.display.state.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        self._emit(slot, record, error=False)

    def _emit_error(self, item: Job | BadLine, message: str) -> None:
        self._emit(self._new_slot(), error_record(item, message), error=True)

    def _new_slot(self) -> int:
        self.num_slots += 1
        return self.num_slots - 1

    def _emit(self, slot: int, record: dict, error: bool) -> None:
        self.display.state.done += 1
        if error:
            self.display.state.errors += 1
            self.failed = self.failed or self.fail_fast
        if not self.ordered:
            self._write(record)
            return
        self.pending[slot] = record
        while self.next_write in self.pending:
            self._write(self.pending.pop(self.next_write))
            self.next_write += 1

    def _write(self, record: dict) -> None:
        try:
            self.writer.write(record)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise CliError(f"cannot write output ({exc.strerror or exc})") from None

    def _write_pending(self) -> None:
        """Finished records still waiting for an earlier one: in order, around the gaps."""
        for slot in sorted(self.pending):
            self._write(self.pending.pop(slot))

    def _abort_all(self) -> None:
        for slot in list(self.jobs):
            self.engine.abort_request(str(slot))
        self.jobs.clear()

    def _refresh(self) -> None:
        if self.display.wants_stats():
            self.display.update(self.engine.stats())


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
