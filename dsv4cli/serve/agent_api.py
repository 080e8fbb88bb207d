"""The routes of the APIs coding agents speak, next to chat completions: Anthropic's Messages API (POST
/v1/messages, /v1/messages/count_tokens; errors in Anthropic's shape) and OpenAI's Responses API (POST
/v1/responses, GET /v1/responses/{id}). Both are translators (`openai/anthropic.py`, `openai/responses_api.py`)
onto the chat request parser and ChunkStream: they run as chat completions do, one sequence a request, and
stream as named server-sent events (`event: NAME`)."""
import asyncio
import json
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from dsv4cli.engine import Sequence
from dsv4cli.openai import anthropic, responses_api

from .errors import Refusal, anthropic_error
from .jobs import disconnect, failure, finished, next_delta
from .loop import EngineLoop, Job
from .server import ApiServer


class NamedEventStream:
    """One reply as server-sent events with names (`event: NAME` then `data: {...}`), an ASGI app as a route
    may return: `events` (MessageEvents, ResponseEvents) translates the engine's deltas; `after(seq)` runs
    when the reply ended. It cancels its request when the client goes away."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, loop: EngineLoop, job: Job, events, gone: asyncio.Task,
                 after: Callable[[Sequence], None] | None = None):
        self.loop, self.job, self.events, self.gone, self.after = loop, job, events, gone, after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        done = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await self._send(send, self.events.first())
            while not done and (item := await next_delta(self.job, self.gone)) is not None:
                delta = item[1]
                if delta.error is not None:     # the engine failed it, or the server is stopping: say so and end
                    await self._send(send, self.events.failed(failure(delta).message))
                    break
                events = self.events.update(delta.text, delta.logprobs)
                if delta.done is not None:
                    events += self.events.finish(delta.done)
                    done = True
                    if self.after is not None:
                        self.after(delta.done)
                await self._send(send, events)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:                         # the client went away while we wrote
            pass
        finally:
            self.gone.cancel()
            if not done:
                self.loop.cancel(self.job)

    @staticmethod
    async def _send(send: Send, events: list[tuple[str, dict]]) -> None:
        if events:
            data = "".join(f"event: {name}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for name, e in events)
            await send({"type": "http.response.body", "body": data.encode(), "more_body": True})


def routes(server: ApiServer) -> list[Route]:
    """The agent APIs' routes; Anthropic's answer refusals in its own error shape."""
    return [server.route(anthropic.MESSAGES_URL, "POST", messages, answer=anthropic_error),
            server.route(anthropic.MESSAGES_URL + "/count_tokens", "POST", count_tokens, answer=anthropic_error),
            server.route(responses_api.RESPONSES_URL, "POST", responses),
            server.route(responses_api.RESPONSES_URL + "/{id}", "GET", stored_response)]


async def reply(server: ApiServer, request: Request, req, events, body: Callable[[Sequence], dict],
                after: Callable[[Sequence], None] | None = None) -> Response | NamedEventStream:
    """`req` run as one sequence: streamed as `events`, or answered with `body(seq)`; `after(seq)` once it ended."""
    job = server.submit(req)
    gone = asyncio.ensure_future(disconnect(request.receive))
    if req.stream:
        return NamedEventStream(server.loop, job, events, gone, after)
    seqs = await finished(server.loop, job, gone, 1)
    if seqs is None:
        return Response(status_code=499)
    if after is not None:
        after(seqs[0])
    return JSONResponse(body(seqs[0]))


async def messages(server: ApiServer, request: Request) -> Response | NamedEventStream:
    req = await server.parsed(request, lambda body: anthropic.parse(server.parser, body))
    n = server.run + server.number()
    return await reply(server, request, req, anthropic.MessageEvents(req, server.tok, server.model, n),
                       lambda seq: anthropic.message(req, seq, server.model, server.tok, n))


async def count_tokens(server: ApiServer, request: Request) -> Response:
    req = await server.parsed(request, lambda body: anthropic.parse(server.parser, body, counting=True))
    return JSONResponse({"input_tokens": len(req.prompt_ids)})


async def responses(server: ApiServer, request: Request) -> Response | NamedEventStream:
    store, tok, model = server.responses, server.tok, server.model
    turn = await server.parsed(request, lambda body: responses_api.parse(server.parser, store, body))
    n = server.run + server.number()
    events = responses_api.ResponseEvents(turn, tok, model, n)

    def body(seq: Sequence) -> dict:
        return events.body or responses_api.response(turn, seq, model, tok, n, events.created)

    def keep(seq: Sequence) -> None:
        events.body = body(seq)
        if turn.store:
            store.put(events.body["id"], events.body, responses_api.conversation(turn, seq, tok, n))

    return await reply(server, request, turn.req, events, body, keep)


async def stored_response(server: ApiServer, request: Request) -> Response:
    stored = server.responses.get(request.path_params["id"])
    if stored is None:
        raise Refusal(404, f"{request.path_params['id']}: no such response stored (not with store false; a "
                           f"restart forgets, and the least recently used go when the store is full)",
                      "not_found", "id")
    return JSONResponse(stored[0])
