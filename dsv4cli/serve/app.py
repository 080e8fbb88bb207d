"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}, vLLM's
/tokenize, /detokenize and /tokenizer_info, plus /health and /metrics; Anthropic's /v1/messages and OpenAI's
/v1/responses (`agent_api.py`), and the Batch API (`batch_api.py`). Handlers parse and answer; the engine thread
(`loop.py`) does the rest.

What a handler lets through (how long a request may take to arrive is bounded in `http.py`): a Host header the
server answers to (bound to a loopback address: loopback names only, so no web page reaches it by DNS
rebinding), browser origins on the CORS allow-list only (none by default), POST bodies whose Content-Type is
application/json (a page may send text/plain anywhere unasked; JSON needs a CORS preflight) and whose size is
at most max_body_bytes (refused by their Content-Length before a byte is read). JSON decoding and tokenising
run in a worker thread, never on the event loop (the JSON decoder still holds the interpreter lock: a body
under the limit can delay other requests by up to about 10 ms per MB).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body (the
batch parser's code and message, which names the field), 401 for a missing or wrong key, 403 for a Host not
answered to, 404 for an unknown route or model, 413 for a body too large, 415 for one that is not JSON, 429
when too many requests wait, 500 when the engine failed the request, 503 when the server is stopping. Only
method, path, status and time are logged, unless --log-prompts.
"""
import asyncio
import dataclasses
import hashlib
import hmac
import itertools
import json
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dsv4cli.engine import SamplingParams, Sequence
from dsv4cli.openai import requests as body_requests
from dsv4cli.openai.requests import BadRequest, BodyParser, load_json
from dsv4cli.openai.responses import ChunkStream, completion
from dsv4cli.openai.responses_api import ResponseStore
from dsv4cli.tokenizer import Tokenizer

from .agent_api import agent_routes
from .batch_api import batch_routes
from .batches import Store
from .errors import ERROR_TYPES, Refusal, error
from .jobs import disconnect, failure, finished, next_delta
from .loop import EngineLoop, Job, QueueFull, Stopping
from .metrics import ServerMetrics


def bad_request(e: BadRequest, answer: Callable = error) -> JSONResponse:
    """A parser error; the field it names (`temperature: must be in [0, 100]`) is OpenAI's `param`."""
    field = re.match(r"([\w.\[\]]+):", e.message)
    return answer(400, e.message, e.code, field[1] if field else None)


def sequence_params(params: SamplingParams, count: int, ranked: bool) -> list[SamplingParams]:
    """The params of a request's `count` sequences: the first has the request's seed (so n = 1 samples as
    before), each other one a seed derived from it, or, unseeded, a random one of its own; `ranked`
    candidates (best_of) report their tokens' logprobs, which rank them."""
    if ranked:
        params = dataclasses.replace(params, logprobs=params.logprobs or 0)

    def seed(i: int) -> int | None:
        if i == 0 or params.seed is None:
            return params.seed
        return int.from_bytes(hashlib.blake2b(f"{params.seed}:{i}".encode(), digest_size=8).digest(), "little") >> 2

    return [dataclasses.replace(params, seed=seed(i)) for i in range(count)]


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


def create_app(loop: EngineLoop, parser: BodyParser, tok: Tokenizer, model: str, metrics: ServerMetrics,
               api_key: str | None, log_prompts: bool, max_body_bytes: int = 8 << 20,
               hosts: set[str] | None = None, cors_origins: list[str] = (), store: Store | None = None,
               max_file_bytes: int = 200 << 20, stored_responses_bytes: int = 64 << 20) -> ASGIApp:
    """`hosts`: the Host names answered to (None: any); `cors_origins`: browser origins allowed; `store`: the
    Files and Batches API's directory (None: off); `stored_responses_bytes`: what the Responses kept for
    previous_response_id may take."""
    numbers = itertools.count(1)
    created = int(time.time())
    card = {"id": model, "object": "model", "created": created, "owned_by": "dsv4cli",
            "max_model_len": parser.max_seq_len}

    def authorized(request: Request) -> bool:
        """The key as a bearer token or, as Anthropic's clients send it, in x-api-key."""
        if api_key is None:
            return True
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":      # the scheme is case-insensitive (RFC 7235)
                return False
        # compare_digest: no timing tells how much of a key is right
        return hmac.compare_digest(given.strip().encode(), api_key.encode())

    def endpoint(handler: Callable[[Request], Awaitable[Response]], keyed: bool = True,
                 answer: Callable = error) -> Callable:
        """A route: the key checked, refusals answered in `answer`'s shape (OpenAI's unless said)."""
        async def route(request: Request) -> Response:
            try:
                if keyed and not authorized(request):
                    raise Refusal(401, "Incorrect or missing API key: send `Authorization: Bearer KEY` (or "
                                       "`x-api-key: KEY`)", "invalid_api_key")
                return await handler(request)
            except Refusal as e:
                response = answer(e.status, e.message, e.code, e.param)
                if e.status == 429:         # a full queue drains within seconds: when to try again
                    response.headers["retry-after"] = "1"
                return response
            except BadRequest as e:
                return bad_request(e, answer)
            except ClientDisconnect:            # gone while sending its body: nobody reads an answer
                return Response(status_code=499)
        return route

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")      # h11 checked that it is a number
        if length is not None and int(length) > max_body_bytes:
            raise Refusal(413, f"the body is {length} bytes; at most {max_body_bytes} (max_body_bytes)",
                          "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise Refusal(413, f"the body is over {max_body_bytes} bytes (max_body_bytes)", "body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parsed(request: Request, parse: Callable):
        """`parse(the JSON body)`, run with the decoding in a worker thread."""
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise Refusal(415, f"Content-Type must be application/json, got {media or 'none'}",
                          "unsupported_media_type")
        raw = await read_body(request)
        if log_prompts:
            print(f"{request.url.path} body: {raw.decode(errors='replace')}", file=sys.stderr, flush=True)
        return await run_in_threadpool(lambda: parse(load_json(raw)))

    def submit(req: body_requests.Request) -> Job:
        """The request's sequences, best_of for each of its prompts in turn."""
        if req.best_of * len(req.prompts) > loop.capacity:
            name = "best_of" if req.best_of > req.n else "n" if len(req.prompts) == 1 else "prompt"
            raise Refusal(400, f"{name}: {req.best_of * len(req.prompts)} sequences; at most {loop.capacity} fit "
                               f"(max_batch + max_waiting)", "invalid_parameter", name)
        params = sequence_params(req.params, req.best_of, req.best_of > req.n)
        try:
            return loop.submit([p for p in req.prompts for _ in params], params * len(req.prompts))
        except QueueFull:
            raise Refusal(429, f"too many requests waiting (--max-waiting {loop.max_waiting}); retry later",
                          "queue_full") from None
        except Stopping as e:
            raise Refusal(503, str(e), "server_shutting_down") from None
        except RuntimeError as e:           # the engine thread failed earlier
            raise Refusal(500, str(e)) from None

    def reply(req: body_requests.Request, seqs: list[Sequence], number: str) -> dict:
        """The reply body: n choices per prompt, in order (of best_of candidates, the n with the highest
        cumulative logprob)."""
        bodies = []
        for p in range(len(req.prompts)):
            candidates = seqs[p * req.best_of:(p + 1) * req.best_of]
            if req.best_of > req.n:
                candidates = sorted(candidates, key=lambda s: -sum(e.logprob for e in s.logprobs))
            bodies += [completion(req, seq, model, tok, number, p) for seq in candidates[:req.n]]
        return bodies[0] | {"choices": [b["choices"][0] | {"index": i} for i, b in enumerate(bodies)],
                            "usage": usage(seqs, req.best_of)}

    async def completions(request: Request, chat: bool) -> Response | EventStream:
        req = await parsed(request, lambda body: parser.parse(body, chat, server=True))
        job = submit(req)
        number = str(next(numbers))
        gone = asyncio.ensure_future(disconnect(request.receive))
        if req.stream:
            alone = dataclasses.replace(req, include_usage=False)     # one usage chunk for all choices, at the end
            return EventStream(loop, job, req, [ChunkStream(alone, tok, model, number) for _ in job.params], gone)
        seqs = await finished(loop, job, gone, len(job.params))
        return Response(status_code=499) if seqs is None else JSONResponse(reply(req, seqs, number))

    async def chat_completions(request: Request) -> Response | EventStream:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response | EventStream:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model_info(request: Request) -> Response:
        if request.path_params["model"] != model:
            raise Refusal(404, f"{request.path_params['model']}: no such model; this server serves {model}",
                          "model_not_found", "model")
        return JSONResponse(card)

    def tokenized(ids: list[int], strings: bool) -> dict:
        return {"count": len(ids), "max_model_len": parser.max_seq_len, "tokens": ids,
                "token_strs": [tok.decode([i]) for i in ids] if strings else None}

    async def tokenize(request: Request) -> Response:
        return JSONResponse(await parsed(request, lambda body: tokenized(*parser.tokenize(body))))

    pad = tok.special_ids.get("<｜▁pad▁｜>")
    # what harnesses read to tokenize through the server (lm-evaluation-harness's remote tokenizer)
    info = {"tokenizer_class": "DeepseekV4Tokenizer", "bos_token": tok.decode([tok.bos_id]),
            "eos_token": tok.decode([tok.eos_id]), "pad_token": None if pad is None else tok.decode([pad]),
            "chat_template": None, "model_max_length": parser.max_seq_len,
            "chat_template_note": f"the chat encoding ({tok.encoding}) is rendered in code, not by a template: "
                                  f"send messages to /v1/chat/completions, or to /tokenize for their tokens"}

    async def tokenizer_info(request: Request) -> Response:
        return JSONResponse(info)

    async def detokenize(request: Request) -> Response:
        return JSONResponse(await parsed(request, lambda body: {"prompt": tok.decode(parser.detokenize(body))}))

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

    routes = [Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
              Route("/v1/completions", endpoint(text_completions), methods=["POST"]),
              Route("/v1/models", endpoint(models), methods=["GET"]),
              Route("/v1/models/{model:path}", endpoint(model_info), methods=["GET"]),
              Route("/tokenize", endpoint(tokenize), methods=["POST"]),
              Route("/detokenize", endpoint(detokenize), methods=["POST"]),
              Route("/tokenizer_info", endpoint(tokenizer_info), methods=["GET"]),
              Route("/health", endpoint(health, keyed=False), methods=["GET"]),
              Route("/metrics", endpoint(prometheus, keyed=False), methods=["GET"])]
    # the agent APIs' ids carry a token of this run: a restarted server does not continue another's response
    run = secrets.token_hex(3)
    metrics.responses = ResponseStore(stored_responses_bytes)
    routes += agent_routes(loop, parser, tok, model, endpoint, parsed, submit, lambda: f"{run}{next(numbers)}",
                           metrics.responses)
    if store is not None:
        routes += batch_routes(store, loop, parser, model, endpoint, parsed, max_file_bytes, list(cors_origins))
    app = Starlette(routes=routes, exception_handlers={404: http_error, 405: http_error})
    if cors_origins:
        app = CORSMiddleware(app, allow_origins=cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    return access_log(host_check(app, hosts))


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
