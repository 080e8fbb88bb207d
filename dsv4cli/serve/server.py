"""The HTTP API as an object: `ApiServer` holds what every route shares (the engine loop, the body parser, the
options, the batch directory) and takes the steps each one takes: the key checked, refusals answered in the
API's error shape, a JSON body read within its limits and parsed in a worker thread, a request submitted to the
engine. The handlers are module-level functions `handler(server, request)`, in `app.py` (OpenAI's and vLLM's
routes), `agent_api.py` and `batch_api.py`; `app.create_app` lists the routes."""
import dataclasses
import functools
import hashlib
import hmac
import itertools
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsv4cli.engine import SamplingParams
from dsv4cli.openai import requests as body_requests
from dsv4cli.openai.requests import BadRequest, BodyParser, load_json
from dsv4cli.openai.responses_api import ResponseStore

from .batches import ApiBatch, Store
from .errors import Refusal, error
from .loop import EngineLoop, Job, QueueFull, Stopping

Handler = Callable[["ApiServer", Request], Awaitable[Response]]


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What `dsv4 serve`'s options set for the routes."""
    model: str                              # the name the model is served by
    api_key: str | None = None              # None: no key asked for
    log_prompts: bool = False               # log request bodies too
    max_body_bytes: int = 8 << 20
    hosts: frozenset[str] | None = None     # the Host names answered to (None: any)
    cors_origins: tuple[str, ...] = ()      # the browser origins allowed
    max_file_bytes: int = 200 << 20         # the Batch API's uploads
    stored_responses_bytes: int = 64 << 20  # what the Responses kept for previous_response_id may take


def bad_request(e: BadRequest, answer: Callable) -> JSONResponse:
    """A parser error in `answer`'s shape; the field it names (`temperature: must be in [0, 100]`) is the `param`."""
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


class ApiServer:
    """The routes' shared state: `store` is the Files and Batches API's directory (None: that API is off)."""

    def __init__(self, loop: EngineLoop, parser: BodyParser, options: ServerOptions, store: Store | None = None):
        self.loop, self.parser, self.options, self.store = loop, parser, options, store
        self.tok, self.metrics, self.model = parser.tok, loop.metrics, options.model
        self.card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "dsv4cli",
                     "max_model_len": parser.max_seq_len}
        self.numbers = itertools.count(1)       # of replies, for their ids
        # the agent APIs' ids carry a token of this run: a restarted server does not continue another's response
        self.run = secrets.token_hex(3)
        self.responses = self.metrics.responses = ResponseStore(options.stored_responses_bytes)
        self.batches: dict[str, ApiBatch] = {}      # by batch id: the API batches this server runs or ran

    def number(self) -> str:
        """The next reply's number."""
        return str(next(self.numbers))

    def route(self, path: str, method: str, handler: Handler, keyed: bool = True, answer: Callable = error) -> Route:
        """`handler` at `path`: with the key checked unless not `keyed`, refusals in `answer`'s shape."""
        # a partial of a method: Starlette calls it with the request, as it would a function
        endpoint = functools.partial(self.respond, handler, keyed=keyed, answer=answer)
        return Route(path, endpoint, methods=[method], name=handler.__name__)

    async def respond(self, handler: Handler, request: Request, keyed: bool, answer: Callable) -> Response:
        """`handler`'s response to `request`, or the refusal it raised in `answer`'s shape."""
        try:
            if keyed and not self.authorized(request):
                raise Refusal(401, "Incorrect or missing API key: send `Authorization: Bearer KEY` (or "
                                   "`x-api-key: KEY`)", "invalid_api_key")
            return await handler(self, request)
        except Refusal as e:
            response = answer(e.status, e.message, e.code, e.param)
            if e.status == 429:         # a full queue drains within seconds: when to try again
                response.headers["retry-after"] = "1"
            return response
        except BadRequest as e:
            return bad_request(e, answer)
        except ClientDisconnect:            # gone while sending its body: nobody reads an answer
            return Response(status_code=499)

    def authorized(self, request: Request) -> bool:
        """The key as a bearer token or, as Anthropic's clients send it, in x-api-key."""
        if self.options.api_key is None:
            return True
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":      # the scheme is case-insensitive (RFC 7235)
                return False
        # compare_digest: no timing tells how much of a key is right
        return hmac.compare_digest(given.strip().encode(), self.options.api_key.encode())

    async def read_body(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        length = request.headers.get("content-length")      # h11 checked that it is a number
        if length is not None and int(length) > limit:
            raise Refusal(413, f"the body is {length} bytes; at most {limit} (max_body_bytes)", "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refusal(413, f"the body is over {limit} bytes (max_body_bytes)", "body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parsed(self, request: Request, parse: Callable):
        """`parse(the JSON body)`, run with the decoding in a worker thread."""
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise Refusal(415, f"Content-Type must be application/json, got {media or 'none'}",
                          "unsupported_media_type")
        raw = await self.read_body(request)
        if self.options.log_prompts:
            print(f"{request.url.path} body: {raw.decode(errors='replace')}", file=sys.stderr, flush=True)
        return await run_in_threadpool(lambda: parse(load_json(raw)))

    def submit(self, req: body_requests.Request) -> Job:
        """The request's sequences, best_of for each of its prompts in turn."""
        capacity = self.loop.capacity
        if req.best_of * len(req.prompts) > capacity:
            name = "best_of" if req.best_of > req.n else "n" if len(req.prompts) == 1 else "prompt"
            raise Refusal(400, f"{name}: {req.best_of * len(req.prompts)} sequences; at most {capacity} fit "
                               f"(max_batch + max_waiting)", "invalid_parameter", name)
        params = sequence_params(req.params, req.best_of, req.best_of > req.n)
        try:
            return self.loop.submit([p for p in req.prompts for _ in params], params * len(req.prompts))
        except QueueFull:
            raise Refusal(429, f"too many requests waiting (--max-waiting {self.loop.max_waiting}); retry later",
                          "queue_full") from None
        except Stopping as e:
            raise Refusal(503, str(e), "server_shutting_down") from None
        except RuntimeError as e:           # the engine thread failed earlier
            raise Refusal(500, str(e)) from None
