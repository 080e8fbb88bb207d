"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and
/metrics. Handlers parse and answer; the engine thread (`loop.py`) does the rest.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body (the
batch parser's code and message, which names the field), 401 for a missing or wrong key, 404 for an
unknown route, 429 when too many requests wait. Only method, path, status and time are logged, unless
--log-prompts.
"""
import asyncio
import hmac
import itertools
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dsv4cli.openai.requests import BadRequest, BodyParser, load_json
from dsv4cli.openai.responses import ChunkStream, completion
from dsv4cli.tokenizer import Tokenizer

from .loop import Delta, EngineLoop, Job, QueueFull
from .metrics import ServerMetrics

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    body = {"message": message, "type": ERROR_TYPES[status], "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)


def bad_request(e: BadRequest) -> JSONResponse:
    """A parser error; the field it names (`temperature: must be in [0, 100]`) is OpenAI's `param`."""
    field = re.match(r"([\w.\[\]]+):", e.message)
    return error(400, e.message, e.code, field[1] if field else None)


async def disconnect(receive: Receive) -> None:
    """Returns when the client goes away (the body is already read, so only http.disconnect is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def next_delta(job: Job, gone: asyncio.Task) -> Delta | None:
    """The request's next delta, or None when its client went away first."""
    get = asyncio.ensure_future(job.queue.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


class EventStream:
    """A streamed reply as server-sent events (`data: {chunk}`, ending with `data: [DONE]`), an ASGI app
    as a route may return. It cancels its request when the client goes away: the engine frees the slot
    before its next step."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, loop: EngineLoop, job: Job, chunks: ChunkStream, gone: asyncio.Task):
        self.loop, self.job, self.chunks, self.gone = loop, job, chunks, gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await self._send(send, self.chunks.first())
            while (delta := await next_delta(self.job, self.gone)) is not None:
                if delta.error is not None:     # the engine failed mid-reply: say so in the stream and end
                    finished = True
                    await self._send(send, [{"error": {"message": delta.error, "type": "server_error",
                                                       "param": None, "code": None}}])
                    break
                chunks = self.chunks.update(delta.text, delta.logprobs)
                finished = delta.done is not None
                await self._send(send, chunks + (self.chunks.finish(delta.done) if finished else []))
                if finished:
                    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
                    break
        except OSError:                         # the client went away while we wrote
            pass
        finally:
            self.gone.cancel()
            if not finished:
                self.loop.cancel(self.job)

    @staticmethod
    async def _send(send: Send, chunks: list[dict]) -> None:
        if chunks:
            data = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks)
            await send({"type": "http.response.body", "body": data.encode(), "more_body": True})


def create_app(loop: EngineLoop, parser: BodyParser, tok: Tokenizer, model: str, metrics: ServerMetrics,
               api_key: str | None, log_prompts: bool) -> ASGIApp:
    numbers = itertools.count(1)
    created = int(time.time())

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 7235); compare_digest: no timing tells how much of a key is right
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            if not authorized(request):
                return error(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                             "invalid_api_key")
            return await handler(request)
        return route

    async def completions(request: Request, chat: bool) -> Response | EventStream:
        raw = await request.body()
        if log_prompts:
            print(f"{request.url.path} body: {raw.decode(errors='replace')}", file=sys.stderr, flush=True)
        try:
            req = parser.parse(load_json(raw), chat, streaming=True)
        except BadRequest as e:
            return bad_request(e)
        try:
            job = loop.submit(req)
        except QueueFull:
            return error(429, f"too many requests waiting (--max-waiting {loop.max_waiting}); retry later",
                         "queue_full")
        except RuntimeError as e:           # the engine thread failed earlier
            return error(500, str(e))
        number = str(next(numbers))
        gone = asyncio.ensure_future(disconnect(request.receive))
        if req.stream:
            return EventStream(loop, job, ChunkStream(req, tok, model, number), gone)
        try:
            while (delta := await next_delta(job, gone)) is not None:
                if delta.error is not None:
                    return error(500, delta.error)
                if delta.done is not None:
                    return JSONResponse(completion(req, delta.done, model, tok, number))
        finally:
            gone.cancel()
        loop.cancel(job)                    # the client went away: nobody reads the answer
        return Response(status_code=499)

    async def chat_completions(request: Request) -> Response | EventStream:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response | EventStream:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                                          "owned_by": "dsv4cli"}]})

    async def health(request: Request) -> Response:
        if loop.error is not None:
            return JSONResponse({"status": "error", "error": loop.error}, status_code=503)
        return JSONResponse({"status": "ok", "running": metrics.running, "waiting": metrics.waiting})

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            return error(405, f"{request.method} {request.url.path}: method not allowed", "method_not_allowed")
        return error(404, f"{request.method} {request.url.path}: no such route", "not_found")

    routes = [Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
              Route("/v1/completions", guarded(text_completions), methods=["POST"]),
              Route("/v1/models", guarded(models), methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={404: http_error, 405: http_error})
    return access_log(app)


def access_log(app: ASGIApp) -> ASGIApp:
    """Log each request as `METHOD PATH STATUS TIME` once its response is sent (a stream's whole time)."""
    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, sending)
        finally:
            ms = (time.perf_counter() - t0) * 1000
            print(f"{scope['method']} {scope['path']} {status[0] or '-'} {ms:.0f} ms", file=sys.stderr, flush=True)

    return logged
