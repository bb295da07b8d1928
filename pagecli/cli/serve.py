"""`pagecli serve`: the OpenAI-compatible HTTP server on one shared engine.

The socket is bound first (a taken port is one line, exit 2), the engine loads on its own
thread while /health answers 503, and SIGINT or SIGTERM drains: no new requests, the running
ones get `--shutdown-timeout` seconds, the rest are aborted, exit 0.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import socket
import sys
import time
from typing import Annotated, Optional

import typer

from pagecli.cli.options import (
    CliError,
    VerboseOption,
    engine_options,
    is_verbose,
    load_error,
    set_verbose,
)
from pagecli.config import EngineConfig

SERVER_PANEL = "Server"
DISPLAY_INTERVAL_S = 0.25


# the formats of server/tool_calls.py (not imported here: it is the server's, loaded late)
ToolCallFormat = enum.Enum(
    "ToolCallFormat", {n: n for n in ("hermes", "llama3_json", "mistral", "qwen3_coder")}, type=str
)


def _opt(help: str, *decls: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=SERVER_PANEL, **kw)


@engine_options
def serve(
    *,
    host: Annotated[str, _opt("Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, _opt("Port to listen on.")] = 8000,
    api_key: Annotated[
        Optional[str],
        _opt(
            "Require this key (Authorization: Bearer KEY); /health and /metrics stay open.",
            envvar="PAGECLI_API_KEY",
            show_default=False,
            show_envvar=True,
        ),
    ] = None,
    served_model_name: Annotated[
        Optional[list[str]],
        _opt(
            "The model name(s) clients use (repeatable; default: --model, or the model's "
            "own name).",
            show_default=False,
        ),
    ] = None,
    max_request_bytes: Annotated[int, _opt("Largest request body (413 above it).")] = 8 * 2**20,
    max_queued_requests: Annotated[
        int, _opt("Most requests waiting for the engine (503 with Retry-After above it).")
    ] = 1024,
    shutdown_timeout: Annotated[
        float, _opt("Seconds in-flight requests get to finish after SIGINT/SIGTERM.")
    ] = 30.0,
    allowed_origins: Annotated[
        Optional[list[str]],
        _opt(
            "Allow cross-origin requests from this origin (repeatable; default: none).",
            show_default=False,
        ),
    ] = None,
    tool_call_parser: Annotated[
        Optional[ToolCallFormat],
        _opt(
            "How the model writes tool calls (default: found from its chat template).",
            show_default=False,
        ),
    ] = None,
    display: Annotated[
        Optional[bool],
        _opt(
            "The live block display on stderr (default: when stderr is a terminal; "
            "otherwise one access line per request).",
            "--display/--no-display",
            show_default=False,
        ),
    ] = None,
    verbose: VerboseOption = False,
    engine_config: EngineConfig,
) -> None:
    """Serve the OpenAI API (chat and completions, streaming) on one shared engine."""
    set_verbose(verbose)
    if not 0 <= port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {port}", exit_code=2)
    for name, value in (
        ("--max-request-bytes", max_request_bytes),
        ("--max-queued-requests", max_queued_requests),
    ):
        if value < 1:
            raise CliError(f"{name} must be >= 1, got {value}", exit_code=2)
    if shutdown_timeout < 0:
        raise CliError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}", exit_code=2)
    if host in ("0.0.0.0", "::") and not api_key:
        print(
            f"pagecli: warning: listening on {host} without --api-key: anyone who can reach "
            "this machine can use the server",
            file=sys.stderr,
        )
    sock = _bind(host, port)
    show_display = sys.stderr.isatty() if display is None else display
    code = _Serve(
        engine_config,
        sock,
        api_key,
        served_model_name or [],
        max_request_bytes,
        max_queued_requests,
        shutdown_timeout,
        allowed_origins or [],
        show_display,
        tool_call_parser.value if tool_call_parser is not None else None,
    ).run()
    if code:
        raise typer.Exit(code)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port} ({exc.strerror})", exit_code=2) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Serve:
    """One run of the server: engine thread, uvicorn, the display or the access log."""

    def __init__(
        self,
        config: EngineConfig,
        sock: socket.socket,
        api_key: str | None,
        names: list[str],
        max_request_bytes: int,
        max_queued: int,
        shutdown_timeout: float,
        origins: list[str],
        show_display: bool,
        tool_call_parser: str | None = None,
    ) -> None:
        from pagecli.engine.async_engine import AsyncEngine

        self.config, self.sock = config, sock
        self.api_key, self.names, self.max_request_bytes = api_key, names, max_request_bytes
        self.shutdown_timeout, self.origins = shutdown_timeout, origins
        self.show_display = show_display
        self.tool_call_parser = tool_call_parser
        self.engine = AsyncEngine(config, max_queued_requests=max_queued)
        self.exit_code = 0
        self.num_requests = 0

    def run(self) -> int:
        import uvicorn

        from pagecli.server.app import ServerSettings, create_app

        _setup_logging()
        self.engine.start()
        names = self.names or [self.config.model or _default_name()]
        settings = ServerSettings(
            model_names=names,
            api_key=self.api_key,
            max_request_bytes=self.max_request_bytes,
            allowed_origins=self.origins,
            access_log=None if self.show_display else _stderr_line,
            tool_call_parser=self.tool_call_parser,
        )
        app = create_app(self.engine, settings)
        self.names = names
        config = uvicorn.Config(
            app,
            log_level="debug" if is_verbose() else "warning",
            access_log=False,
            timeout_graceful_shutdown=self.shutdown_timeout,
            lifespan="off",
            timeout_keep_alive=5,
            log_config=None,
        )
        server = _draining_server(config, self.engine)
        # uvicorn raises a caught signal again once it has shut down; a no-op handler then
        # lets the process end with its own exit code (0 after a graceful stop).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore)
        try:
            asyncio.run(self._main(server))
        finally:
            self.engine.stop(timeout=10)
            self.sock.close()
        return self.exit_code

    async def _main(self, server) -> None:
        watchers = [asyncio.ensure_future(self._watch_loading(server))]
        if self.config.tensor_parallel_size > 1:
            watchers.append(asyncio.ensure_future(self._watch_workers(server)))
        try:
            await server.serve(sockets=[self.sock])
        finally:
            for watcher in watchers:
                watcher.cancel()

    async def _watch_workers(self, server) -> None:
        """End the server (exit 1) once a tensor-parallel worker is gone: the engine cannot
        answer again, and until the process ends /health says 503 with the reason."""
        from pagecli.engine.parallel import WorkerFailed

        while not isinstance(self.engine.step_exception, WorkerFailed):
            await asyncio.sleep(0.2)
        print(f"pagecli: the engine stopped: {self.engine.step_exception}", file=sys.stderr)
        self.exit_code = 1
        server.should_exit = True

    async def _watch_loading(self, server) -> None:
        """Announce the server once the model is loaded; end it if loading failed."""
        from pagecli.engine.async_engine import EngineState

        await asyncio.get_running_loop().run_in_executor(None, self.engine.ready.wait)
        if self.engine.state is EngineState.DEAD and self.engine.load_exception is not None:
            print(
                f"pagecli: {load_error(self.config, self.engine.load_exception)}", file=sys.stderr
            )
            self.exit_code = 2
            server.should_exit = True
            return
        core = self.engine.engine
        host, port = self.sock.getsockname()[:2]
        served = "" if self.names == [core.source.name] else f" as {', '.join(self.names)}"
        dtype = str(core.dtype).removeprefix("torch.")
        print(
            f"pagecli serve · {core.source.name}{served} · {dtype} on {core.device.type} · "
            f"http://{host}:{port}/v1 · Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        if self.show_display:
            await self._display()

    async def _display(self) -> None:
        from pagecli.cli.display import LiveDisplay

        with LiveDisplay(enabled=True) as live:
            while True:
                started = time.perf_counter()
                try:
                    stats = await self.engine.stats()
                except Exception:
                    return
                live.header = (
                    f"serve · {self.engine.num_unfinished} requests in flight · "
                    f"{stats.num_running} running · {stats.num_waiting} waiting"
                )
                live.show(stats)
                live.schedule(started)
                await asyncio.sleep(DISPLAY_INTERVAL_S)


def _draining_server(config, engine):
    """uvicorn's Server, which on SIGINT/SIGTERM first tells the engine to take no new
    requests (they get 503) while the running ones finish."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.drain()
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def _ignore(signum, frame) -> None:
    pass


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _default_name() -> str:
    from pagecli.loader.resolve import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pagecli: %(levelname)s: %(message)s"))
    for name in ("pagecli", "uvicorn", "uvicorn.error"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.setLevel(logging.DEBUG if is_verbose() else logging.WARNING)
        log.propagate = False
