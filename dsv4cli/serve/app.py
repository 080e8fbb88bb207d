"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}, vLLM's
/tokenize, /detokenize and /tokenizer_info, plus /health and /metrics; Anthropic's /v1/messages and OpenAI's
/v1/responses (`agent_api.py`), and the Batch API (`batch_api.py`), listed by `create_app`. Each handler is a
function `handler(server, request)` of the `ApiServer` (`server.py`) the routes share: it parses and answers; the
engine thread (`loop.py`) does the rest.

What a handler lets through (how long a request may take to arrive is bounded in `http.py`): a Host header the
server answers to (bound to a loopback address: loopback names only, so no web page reaches it by DNS
rebinding), browser origins on the CORS allow-list only (none by default), POST bodies whose Content-Type is
application/json (a page may send text/plain anywhere unasked; JSON needs a CORS preflight) and whose size is
at most max_body_bytes (refused by their Content-Length before a byte is read). JSON decoding and tokenising
run in a worker thread, never on the event loop (the JSON decoder still holds the interpreter lock, so a large
body under the limit still delays other requests a little: docs/decisions.md, Server).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body (the
batch parser's code and message, which names the field), 401 for a missing or wrong key, 403 for a Host not
answered to, 404 for an unknown route or model, 413 for a body too large, 415 for one that is not JSON, 429
when too many requests wait, 500 when the engine failed the request, 503 when the server is stopping. Only
method, path, status and time are logged, unless --log-prompts.
"""
import asyncio
import dataclasses
import json
import sys
import time

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from dsv4cli.engine import Sequence
from dsv4cli.openai import requests as body_requests
from dsv4cli.openai.responses import ChunkStream, completion

from . import agent_api, batch_api
from .errors import ERROR_TYPES, Refusal, error
from .jobs import disconnect, failure, finished, next_delta
from .loop import EngineLoop, Job
from .server import ApiServer


def usage(seqs: list[Sequence], per_prompt: int) -> dict:
    """Tokens of every sequence run for the request (best_of counts its candidates: they were generated), each
    prompt counted once (its first sequence's, as its cached tokens), `per_prompt` sequences each."""
    firsts = seqs[::per_prompt]
    prompt, completion_tokens = sum(len(s.prompt_ids) for s in firsts), sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(s.metrics.cached_tokens for s in firsts)}}


def indexed(chunks: list[dict], index: int) -> list[dict]:
    """Chunks of one choice, marked as choice `index` of the reply."""
    for chunk in chunks:
        for choice in chunk["choices"]:
            choice["index"] = index
    return chunks


class EventStream:
    """A streamed reply as server-sent events (`data: {chunk}`, ending with `data: [DONE]`), an ASGI app
    as a route may return; with n choices their chunks interleave, each marked with its index. It cancels
    its request when the client goes away: the engine frees the slots before its next step."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, loop: EngineLoop, job: Job, req: body_requests.Request, streams: list[ChunkStream],
                 gone: asyncio.Task):
        self.loop, self.job, self.req, self.streams, self.gone = loop, job, req, streams, gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished: dict[int, Sequence] = {}        # by index
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await self._send(send, [c for i, stream in enumerate(self.streams) for c in indexed(stream.first(), i)])
            while len(finished) < len(self.streams) and (item := await next_delta(self.job, self.gone)) is not None:
                i, delta = item
                if delta.error is not None:     # the engine failed it, or the server is stopping: say so and end
                    e = failure(delta)
                    await self._send(send, [{"error": {"message": e.message, "type": ERROR_TYPES[e.status],
                                                       "param": None, "code": e.code}}])
                    break
                chunks = []
                if delta.first and self.req.echo is not None:       # the prompt, scored once it is prefilled
                    chunks = self.streams[i].echo(self.req.echo[i // self.req.n], delta.prompt_logprobs)
                chunks += self.streams[i].update(delta.text, delta.logprobs)
                if delta.done is not None:
                    chunks += self.streams[i].finish(delta.done)
                    finished[i] = delta.done
                await self._send(send, indexed(chunks, i))
            complete = len(finished) == len(self.streams)
            if complete and self.req.include_usage:
                done = [finished[i] for i in range(len(finished))]
                await self._send(send, [self.streams[0].base | {"choices": [], "usage": usage(done, self.req.n)}])
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n" if complete else b"",
                        "more_body": False})
        except OSError:                         # the client went away while we wrote
            pass
        finally:
            self.gone.cancel()
            if len(finished) < len(self.streams):
                self.loop.cancel(self.job)

    @staticmethod
    async def _send(send: Send, chunks: list[dict]) -> None:
        if chunks:
            data = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks)
            await send({"type": "http.response.body", "body": data.encode(), "more_body": True})


def create_app(server: ApiServer) -> ASGIApp:
    """The ASGI app of `server`'s routes (with a batch directory the Batch API's too, and its unfinished batches
    resumed), behind CORS for the allowed origins, the Host check and the access log."""
    route = server.route
    routes = [route("/v1/chat/completions", "POST", chat_completions),
              route("/v1/completions", "POST", text_completions),
              route("/v1/models", "GET", models),
              route("/v1/models/{model:path}", "GET", model_info),
              route("/tokenize", "POST", tokenize),
              route("/detokenize", "POST", detokenize),
              route("/tokenizer_info", "GET", tokenizer_info),
              route("/health", "GET", health, keyed=False),
              route("/metrics", "GET", prometheus, keyed=False),
              *agent_api.routes(server)]
    if server.store is not None:
        routes += batch_api.routes(server)
        batch_api.resume(server)
    app = Starlette(routes=routes, exception_handlers={404: http_error, 405: http_error})
    if server.options.cors_origins:
        app = CORSMiddleware(app, allow_origins=server.options.cors_origins, allow_methods=["GET", "POST"],
                             allow_headers=["*"])
    return access_log(host_check(app, server.options.hosts))


def reply(server: ApiServer, req: body_requests.Request, seqs: list[Sequence], number: str) -> dict:
    """The reply body: n choices per prompt, in order (of best_of candidates, the n with the highest
    cumulative logprob)."""
    bodies = []
    for p in range(len(req.prompts)):
        candidates = seqs[p * req.best_of:(p + 1) * req.best_of]
        if req.best_of > req.n:
            candidates = sorted(candidates, key=lambda s: -sum(e.logprob for e in s.logprobs))
        bodies += [completion(req, seq, server.model, server.tok, number, p) for seq in candidates[:req.n]]
    return bodies[0] | {"choices": [b["choices"][0] | {"index": i} for i, b in enumerate(bodies)],
                        "usage": usage(seqs, req.best_of)}


async def completions(server: ApiServer, request: Request, chat: bool) -> Response | EventStream:
    req = await server.parsed(request, lambda body: server.parser.parse(body, chat, server=True))
    job = server.submit(req)
    number = server.number()
    gone = asyncio.ensure_future(disconnect(request.receive))
    if req.stream:
        alone = dataclasses.replace(req, include_usage=False)     # one usage chunk for all choices, at the end
        streams = [ChunkStream(alone, server.tok, server.model, number) for _ in job.params]
        return EventStream(server.loop, job, req, streams, gone)
    seqs = await finished(server.loop, job, gone, len(job.params))
    return Response(status_code=499) if seqs is None else JSONResponse(reply(server, req, seqs, number))


async def chat_completions(server: ApiServer, request: Request) -> Response | EventStream:
    return await completions(server, request, chat=True)


async def text_completions(server: ApiServer, request: Request) -> Response | EventStream:
    return await completions(server, request, chat=False)


async def models(server: ApiServer, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [server.card]})


async def model_info(server: ApiServer, request: Request) -> Response:
    if request.path_params["model"] != server.model:
        raise Refusal(404, f"{request.path_params['model']}: no such model; this server serves {server.model}",
                      "model_not_found", "model")
    return JSONResponse(server.card)


def tokenized(server: ApiServer, ids: list[int], strings: bool) -> dict:
    return {"count": len(ids), "max_model_len": server.parser.max_seq_len, "tokens": ids,
            "token_strs": [server.tok.decode([i]) for i in ids] if strings else None}


async def tokenize(server: ApiServer, request: Request) -> Response:
    return JSONResponse(await server.parsed(request, lambda body: tokenized(server, *server.parser.tokenize(body))))


async def detokenize(server: ApiServer, request: Request) -> Response:
    prompt = await server.parsed(request, lambda body: server.tok.decode(server.parser.detokenize(body)))
    return JSONResponse({"prompt": prompt})


async def tokenizer_info(server: ApiServer, request: Request) -> Response:
    """What harnesses read to tokenize through the server (lm-evaluation-harness's remote tokenizer)."""
    tok = server.tok
    pad = tok.special_ids.get("<｜▁pad▁｜>")
    return JSONResponse({
        "tokenizer_class": "DeepseekV4Tokenizer", "bos_token": tok.decode([tok.bos_id]),
        "eos_token": tok.decode([tok.eos_id]), "pad_token": None if pad is None else tok.decode([pad]),
        "chat_template": None, "model_max_length": server.parser.max_seq_len,
        "chat_template_note": f"the chat encoding ({tok.encoding}) is rendered in code, not by a template: "
                              f"send messages to /v1/chat/completions, or to /tokenize for their tokens"})


async def health(server: ApiServer, request: Request) -> Response:
    if server.loop.error is not None:
        return JSONResponse({"status": "error", "error": server.loop.error}, status_code=503)
    return JSONResponse({"status": "ok", "running": server.metrics.running, "waiting": server.metrics.waiting})


async def prometheus(server: ApiServer, request: Request) -> Response:
    return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")


async def http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 405:
        return error(405, f"{request.method} {request.url.path}: method not allowed", "method_not_allowed")
    return error(404, f"{request.method} {request.url.path}: no such route", "not_found")


def host_check(app: ASGIApp, hosts: set[str] | None) -> ASGIApp:
    """Refuse (403) a request whose Host header names none of `hosts` (None: any), with or without a port:
    a page of another site reaching a loopback server by DNS rebinding sends its own name."""
    if hosts is None:
        return app

    async def checked(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "").lower()
            name = host[:host.find("]") + 1] if host.startswith("[") else host.rpartition(":")[0] or host
            if name not in hosts:
                answer = error(403, f"Host {host!r} is not answered to (only {', '.join(sorted(hosts))}; add names "
                                    f"with --allowed-host)", "host_not_allowed")
                return await answer(scope, receive, send)
        await app(scope, receive, send)

    return checked


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
