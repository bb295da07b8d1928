"""`--endpoint URL` and its options, shared by generate, chat and bench: which Backend a
command runs on (the in-process engine unless an endpoint is given), and the one line a
backend that cannot start ends in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from pagecli.backends.base import Backend
from pagecli.cli.options import CliError, _inject, _keyword, is_verbose, load_error
from pagecli.config import EngineConfig
from pagecli.errors import BackendError

ENDPOINT_PANEL = "Endpoint (an OpenAI-compatible server instead of the local engine)"
LOCAL = "local"  # `--endpoint local` (bench): the in-process engine as one of the rows


@dataclasses.dataclass(frozen=True)
class EndpointSettings:
    """The endpoint options of one command; `urls` is empty for the local engine."""

    urls: tuple[str, ...]
    api_key: str | None
    served_model: str | None
    max_retries: int
    request_timeout: float

    @property
    def remote(self) -> bool:
        return bool(self.urls)

    def backends(self, engine_config: EngineConfig) -> list[Backend]:
        """One backend per --endpoint (NAME=URL names a row; `local` is this process's
        engine), or the local engine alone. The local engine's module (torch) is imported
        only where a row runs on it: a client of a remote server starts in a fraction of a
        second."""
        from pagecli.backends.remote import RemoteBackend

        if not self.urls:
            from pagecli.backends.local import LocalBackend

            return [LocalBackend(engine_config)]
        backends: list[Backend] = []
        for spec in self.urls:
            name, url = _split(spec)
            if url == LOCAL:
                from pagecli.backends.local import LocalBackend

                backends.append(LocalBackend(engine_config, name=name or "pagecli"))
                continue
            try:
                backends.append(
                    RemoteBackend(
                        url,
                        api_key=self.api_key,
                        served_model=self.served_model,
                        max_retries=self.max_retries,
                        request_timeout=self.request_timeout,
                        name=name,
                        seed=engine_config.seed,
                    )
                )
            except BackendError as exc:
                raise CliError(str(exc), exit_code=2) from None
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise CliError("two --endpoint rows have the same name; use NAME=URL", exit_code=2)
        return backends

    def backend(self, engine_config: EngineConfig) -> Backend:
        return self.backends(engine_config)[0]


def _split(spec: str) -> tuple[str | None, str]:
    """`NAME=URL` -> (NAME, URL); a bare URL (or `local`) has no name."""
    head, sep, tail = spec.partition("=")
    if sep and "://" not in head and head.strip():
        return head.strip(), tail.strip()
    return None, spec.strip()


def start_error(backend: Backend, engine_config: EngineConfig, exc: BaseException) -> CliError:
    """The one line (exit 2) for a backend that did not start."""
    if isinstance(exc, BackendError):
        return CliError(str(exc), exit_code=2)
    from pagecli.errors import ModelLoadError

    if is_verbose() and not isinstance(exc, (ModelLoadError, ValueError)):
        raise exc
    return load_error(engine_config, exc)


def _parameters(multiple: bool) -> list:
    url_help = (
        "Run on this OpenAI-compatible server (e.g. http://host:8000/v1) instead of the local "
        "engine."
    )
    if multiple:
        url_help += " Repeat for one row per server; NAME=URL names a row, `local` is this process."
        url_type: Any = Optional[list[str]]
    else:
        url_type = Optional[str]

    def opt(help: str, *decls: str, **kw: Any):
        return typer.Option(*decls, help=help, rich_help_panel=ENDPOINT_PANEL, **kw)

    return [
        _keyword(
            "endpoint_url",
            Annotated[url_type, opt(url_help, "--endpoint", show_default=False)],
            None,
        ),
        _keyword(
            "api_key",
            Annotated[
                Optional[str],
                opt(
                    "The server's API key (Authorization: Bearer KEY).",
                    envvar=["PAGECLI_API_KEY", "OPENAI_API_KEY"],
                    show_default=False,
                    show_envvar=True,
                ),
            ],
            None,
        ),
        _keyword(
            "served_model",
            Annotated[
                Optional[str],
                opt("The model name to ask for (default: the server's first).", show_default=False),
            ],
            None,
        ),
        _keyword(
            "max_retries",
            Annotated[int, opt("Retries per request on connection errors, 408, 429 and 5xx.")],
            3,
        ),
        _keyword(
            "request_timeout",
            Annotated[float, opt("Seconds one attempt of a request may take.")],
            600.0,
        ),
    ]


def _collect(values: dict[str, Any]) -> EndpointSettings:
    urls = values["endpoint_url"]
    if urls is None:
        urls = ()
    elif isinstance(urls, str):
        urls = (urls,)
    if values["max_retries"] < 0:
        raise CliError(f"--max-retries must be >= 0, got {values['max_retries']}", exit_code=2)
    if not values["request_timeout"] > 0:
        raise CliError(
            f"--request-timeout must be > 0, got {values['request_timeout']}", exit_code=2
        )
    return EndpointSettings(
        tuple(urls),
        values["api_key"],
        values["served_model"],
        values["max_retries"],
        values["request_timeout"],
    )


def endpoint_options(multiple: bool = False) -> Callable[[Callable], Callable]:
    """Give a command the endpoint options; it receives them as `endpoint: EndpointSettings`
    (`multiple`: --endpoint may be repeated)."""

    def collect(values: dict[str, Any]) -> EndpointSettings:
        return _collect(values)

    collect.__name__ = "endpoint"

    def decorate(func: Callable) -> Callable:
        return _inject(func, _parameters(multiple), collect)

    return decorate
