"""The loop of `pagecli generate`, on any Backend (the local engine or an endpoint).

A reader thread parses input lines onto an asyncio queue; the event loop starts one task per
record as soon as it arrives, at most `max_concurrency` at a time, so a producer that waits for
each answer before writing the next line is served. Records are written whole, in input order
unless `ordered` is off. Ctrl-C and SIGTERM cancel the loop: what finished is written, what ran
is aborted, and the exit code says which signal it was.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

from pagecli.backends.base import Backend, Request
from pagecli.batch.files import DEFAULT_MAX_LINE_BYTES, LongLine, read_lines
from pagecli.batch.jsonl import (
    BadLine,
    Job,
    encode_record,
    error_record,
    id_key,
    long_line,
    parse_line,
    result_record,
)
from pagecli.batch.progress import GenerateProgress
from pagecli.cli.options import CliError
from pagecli.errors import BackendError, RequestRejected
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import StructuredOutputs

SIGNAL_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
BROKEN_PIPE_EXIT_CODE = 141  # what a tool killed by SIGPIPE reports
QUEUE_SIZE = 1024  # parsed lines read ahead of the requests
REFRESH_S = 0.1


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


class _Stop(Exception):
    """Ends the loop early: a signal, --fail-fast, a closed pipe, or a dead backend."""


class StartFailed(Exception):
    """The backend did not start (a bad model, URL, key or server): `error` says why."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class GenerateRun:
    """One pass over the input on one backend: start it, read, run, write; `run` returns the
    exit code. A backend that does not start raises StartFailed, before any line is read."""

    def __init__(
        self,
        backend: Backend,
        writer: RecordWriter,
        display: GenerateProgress,
        defaults: dict[str, Any],
        *,
        system: str | None,
        ordered: bool,
        fail_fast: bool,
        done_before: set[str],
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_concurrency: int | None = None,
        loading_name: str = "the model",
        terminal_note: bool = False,
    ) -> None:
        self.backend, self.writer, self.display = backend, writer, display
        self.defaults, self.system = defaults, system
        self.ordered, self.fail_fast, self.done_before = ordered, fail_fast, done_before
        self.max_line_bytes = max_line_bytes
        self.max_concurrency = max_concurrency
        self.loading_name, self.terminal_note = loading_name, terminal_note
        self.tasks: dict[int, asyncio.Task] = {}  # slot (output position) -> its request
        self.seen: dict[str, int] = {}  # id key -> line of its first record
        self.pending: dict[int, dict] = {}  # finished records waiting for their turn
        self.num_slots = 0
        self.next_write = 0
        self.failed = False
        self.stop_signal: int | None = None
        self.broken_pipe = False
        self.fatal: BaseException | None = None  # a write error or a dead engine
        self._main: asyncio.Task | None = None
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._reader_done = threading.Event()

    # ---- the loop ------------------------------------------------------------------------

    def run(self, source: BinaryIO) -> int:
        return asyncio.run(self._run(source))

    @property
    def reading(self) -> bool:
        """Whether the reader thread is still waiting for input."""
        return self._reader is not None and self._reader.is_alive()

    async def _run(self, source: BinaryIO) -> int:
        with self.display.loading(self.loading_name):
            try:
                await self.backend.start()
            except Exception as exc:
                await self.backend.aclose()
                raise StartFailed(exc) from exc
        try:
            self._check_default_constraint()
            if self.terminal_note:
                print("pagecli: reading JSONL from the terminal (Ctrl-D to end)", file=sys.stderr)
            return await self._serve(source)
        finally:
            await self.backend.aclose()

    def _check_default_constraint(self) -> None:
        """A --json-schema the local engine cannot compile ends the run before any line is
        read (exit 2), rather than failing every record; a server judges each request."""
        structured = self.defaults.get("structured")
        engine = self.backend.engine
        if structured is None or engine is None:
            return
        try:
            engine.compile_grammar(StructuredOutputs.coerce(structured))
        except ValueError as exc:  # GrammarRejected
            raise CliError(
                f"--json-schema: the engine refuses this constraint: {exc}", exit_code=2
            ) from None

    async def _serve(self, source: BinaryIO) -> int:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._main = asyncio.current_task()
        for s in SIGNAL_EXIT_CODES:
            loop.add_signal_handler(s, self._on_signal, s)
        self._reader = threading.Thread(target=self._read, args=(source, queue, loop), daemon=True)
        self._reader.start()
        limit = self.max_concurrency or self._default_concurrency()
        self.slots = asyncio.Semaphore(limit)
        self.display.start()
        refresher = asyncio.create_task(self._refresh_loop())
        try:
            await self._take_input(queue)
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()))
            self._raise_if_stopped()
            self._write_pending()  # nothing is left unless a slot was never answered
        except (_Stop, asyncio.CancelledError):
            self._stopping = True  # from here on a signal only sets its flag
            await self._cancel_all()
            if not self.broken_pipe and self.fatal is None:
                try:
                    self._write_pending()
                except BrokenPipeError:
                    self.broken_pipe = True
                except CliError as exc:
                    self.fatal = exc
        except BrokenPipeError:
            self.broken_pipe = True
        finally:
            refresher.cancel()
            for s in SIGNAL_EXIT_CODES:
                loop.remove_signal_handler(s)
        if self.broken_pipe:
            self.display.stop(summary=False)
            _silence_stdout()
            return BROKEN_PIPE_EXIT_CODE
        if self.fatal is not None:
            self.display.stop(summary=False)
            with contextlib.suppress(CliError, OSError):  # OSError: BrokenPipeError too
                self._write_pending()  # keep what finished, for --resume
            if isinstance(self.fatal, CliError):
                raise self.fatal
            raise CliError(str(self.fatal)) from None
        await self._refresh(force=True)
        self.display.stop()
        if self.stop_signal is not None:
            return SIGNAL_EXIT_CODES[self.stop_signal]
        return 1 if self.failed else 0

    def _default_concurrency(self) -> int:
        """Twice the engine's batch for the local engine (so its waiting queue never runs
        dry), 64 for a server."""
        engine = self.backend.engine
        return 2 * engine.config.max_num_seqs if engine is not None else 64

    async def _take_input(self, queue: asyncio.Queue) -> None:
        """Start a task for each record as it arrives, within the concurrency limit."""
        while True:
            item = await queue.get()
            if isinstance(item, _EndOfInput):
                self.display.state.total = self.num_slots
                if item.error:
                    print(f"pagecli: {item.error}", file=sys.stderr)
                return
            await self._handle(item)
            self._raise_if_stopped()

    def _read(self, source: BinaryIO, queue: asyncio.Queue, loop) -> None:
        """The reader thread: parse every line onto the queue, then the end marker. A line
        over max_line_bytes is dropped as it is read and answered by an error record."""

        def put(item) -> None:
            asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

        try:
            try:
                for line, raw in enumerate(read_lines(source, self.max_line_bytes), start=1):
                    if isinstance(raw, LongLine):
                        item = long_line(line, raw.num_bytes, self.max_line_bytes)
                    else:
                        item = parse_line(raw, line, self.defaults, self.system)
                    if item is not None:
                        put(item)
            except OSError as exc:
                put(_EndOfInput(f"cannot read input ({exc.strerror or exc})"))
                return
            put(_EndOfInput())
        except (RuntimeError, asyncio.CancelledError, concurrent.futures.CancelledError):
            # the loop has ended: nobody reads any more
            return
        finally:
            self._reader_done.set()

    def _on_signal(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        self._stop()

    def _stop(self) -> None:
        """Cancel the loop, once: its handler then aborts the running requests. The loop
        itself checks the flags after each record instead (a pending cancel of the current
        task would hit its own clean-up)."""
        if asyncio.current_task() is self._main:
            return
        if self._main is not None and not self._main.done() and not self._stopping:
            self._stopping = True
            self._main.cancel()

    def _raise_if_stopped(self) -> None:
        if self.stop_signal is not None or self.failed or self.fatal or self.broken_pipe:
            raise _Stop

    # ---- records -------------------------------------------------------------------------

    async def _handle(self, item: Job | BadLine) -> None:
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
        await self.slots.acquire()
        slot = self._new_slot()
        self.tasks[slot] = asyncio.create_task(self._run_job(slot, item))

    async def _run_job(self, slot: int, job: Job) -> None:
        try:
            output = await self.backend.complete(Request(str(slot), job.prompt, job.params))
        except RequestRejected as exc:
            record = error_record(job, str(exc), exc.num_prompt_tokens, status=exc.status)
            self._emit(slot, record, error=True)
        except BackendError as exc:  # the engine is gone: nothing else will run either
            self.fatal = self.fatal or exc
            self._stop()
        except Exception as exc:  # a bug or an answer nobody foresaw: this record, not the run
            message = f"internal error: {type(exc).__name__}: {exc}"
            self._emit(slot, error_record(job, message), error=True)
        else:
            self._finish(slot, job, output)
        finally:
            self.tasks.pop(slot, None)
            self.slots.release()

    def _finish(self, slot: int, job: Job, output: RequestOutput) -> None:
        record = result_record(job, output, self.backend.model_name)
        usage = record.get("usage") or record["response"]["body"]["usage"]
        self.display.state.prompt_tokens += usage["prompt_tokens"]
        self.display.state.completion_tokens += usage["completion_tokens"]
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
            if self.fail_fast:
                self.failed = True
                self._stop()
        try:
            if not self.ordered:
                self._write(record)
                return
            self.pending[slot] = record
            while self.next_write in self.pending:
                self._write(self.pending.pop(self.next_write))
                self.next_write += 1
        except BrokenPipeError:
            self.broken_pipe = True
            self._stop()
        except CliError as exc:
            self.fatal = self.fatal or exc
            self._stop()

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

    async def _cancel_all(self) -> None:
        """Abort every running request (each task's own clean-up tells the backend)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self._refresh()

    async def _refresh(self, force: bool = False) -> None:
        if not (force or self.display.wants_stats()):
            return
        stats = None
        if self.backend.is_local:
            with contextlib.suppress(Exception):
                stats = await self.backend.stats()
        else:  # a server: what this client sees
            state = self.display.state
            state.running = len(self.tasks)
            state.decode_tokens_per_s = (
                state.completion_tokens / state.elapsed_s if state.elapsed_s else 0.0
            )
        self.display.update(stats, force=force)


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
