"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the HTTP status a client expects
(the official client turns each status into its own exception class)."""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_field(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
    return error.response()


async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own 404 (no such route) and 405 (wrong method), in the same shape."""
    return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").response()


HANDLERS = {ApiError: on_api_error, HTTPException: on_http_error}
