"""Every failure of the server as the OpenAI error envelope:
`{"error": {"message", "type", "param", "code"}}`, with the right HTTP status.

Validation errors are 400 (not FastAPI's 422) and name the field; a 500 carries no traceback
(it goes to the log).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagecli.openai.protocol import first_error

logger = logging.getLogger("pagecli.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered with the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def envelope(status: int, message: str, param: str | None = None, code: str | None = None):
    """The JSON body of an error."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        envelope(exc.status, exc.message, exc.param, exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming its field."""
    message, field = first_error(list(exc.errors()))
    return APIError(400, message, param=field)


def install(app: FastAPI) -> None:
    """Route every exception the app can meet to the envelope."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        return JSONResponse(
            envelope(exc.status_code, message), status_code=exc.status_code, headers=exc.headers
        )

    app.add_middleware(CatchAll)


class CatchAll:
    """The innermost guard: an unexpected exception is logged with its traceback and answered
    with a 500 envelope that names only its type (if the response has not started yet)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error(
                "internal error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc
            )
            if started:
                return
            body = JSONResponse(
                envelope(500, f"internal error: {type(exc).__name__}"), status_code=500
            )
            await body(scope, receive, send)
