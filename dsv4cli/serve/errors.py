"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, Anthropic's (`anthropic_error`), and
the exception a route raises to answer with one."""
from starlette.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
               507: "server_error"}


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    body = {"message": message, "type": ERROR_TYPES[status], "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    """Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` (it has no code or param: the
    message names the field)."""
    return JSONResponse({"type": "error", "error": {"type": ANTHROPIC_TYPES[status], "message": message}},
                        status_code=status)


class Refusal(Exception):
    """A request answered with an error (`error`'s arguments) before or instead of its reply."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
