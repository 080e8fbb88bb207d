"""The routes of the APIs coding agents speak, next to chat completions: Anthropic's Messages API (POST
/v1/messages, /v1/messages/count_tokens; errors in Anthropic's shape) and OpenAI's Responses API (POST
/v1/responses, GET /v1/responses/{id}). Both are translators (`openai/anthropic.py`, `openai/responses_api.py`)
onto the chat request parser and ChunkStream: they run as chat completions do, one sequence a request, and
stream as named server-sent events (`event: NAME`)."""
import asyncio
import json
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from dsv4cli.engine import Sequence
from dsv4cli.openai import anthropic, responses_api
from dsv4cli.openai.requests import BodyParser
from dsv4cli.tokenizer import Tokenizer

from .errors import Refusal, anthropic_error
from .jobs import disconnect, failure, finished, next_delta
from .loop import EngineLoop, Job


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


def agent_routes(loop: EngineLoop, parser: BodyParser, tok: Tokenizer, model: str, endpoint: Callable,
                 parsed: Callable, submit: Callable, number: Callable[[], str],
                 store: responses_api.ResponseStore) -> list[Route]:
    """`endpoint` wraps a handler (key, errors), `parsed(request, parse)` reads a JSON body, `submit(req)` runs
    a request, `number()` numbers a reply: the app's own; `store` keeps the Responses stored."""

    async def reply(request: Request, req, events, body: Callable[[Sequence], dict],
                    after: Callable[[Sequence], None] | None = None) -> Response | NamedEventStream:
        job = submit(req)
        gone = asyncio.ensure_future(disconnect(request.receive))
        if req.stream:
            return NamedEventStream(loop, job, events, gone, after)
        seqs = await finished(loop, job, gone, 1)
        if seqs is None:
            return Response(status_code=499)
        if after is not None:
            after(seqs[0])
        return JSONResponse(body(seqs[0]))

    async def messages(request: Request) -> Response | NamedEventStream:
        req = await parsed(request, lambda body: anthropic.parse(parser, body))
        n = number()
        return await reply(request, req, anthropic.MessageEvents(req, tok, model, n),
                           lambda seq: anthropic.message(req, seq, model, tok, n))

    async def count_tokens(request: Request) -> Response:
        req = await parsed(request, lambda body: anthropic.parse(parser, body, counting=True))
        return JSONResponse({"input_tokens": len(req.prompt_ids)})

    async def responses(request: Request) -> Response | NamedEventStream:
        turn = await parsed(request, lambda body: responses_api.parse(parser, store, body))
        n = number()
        events = responses_api.ResponseEvents(turn, tok, model, n)

        def body(seq: Sequence) -> dict:
            return events.body or responses_api.response(turn, seq, model, tok, n, events.created)

        def keep(seq: Sequence) -> None:
            events.body = body(seq)
            if turn.store:
                store.put(events.body["id"], events.body, responses_api.conversation(turn, seq, tok, n))

        return await reply(request, turn.req, events, body, keep)

    async def stored_response(request: Request) -> Response:
        stored = store.get(request.path_params["id"])
        if stored is None:
            raise Refusal(404, f"{request.path_params['id']}: no such response stored (not with store false; a "
                               f"restart forgets, and the least recently used go when the store is full)",
                          "not_found", "id")
        return JSONResponse(stored[0])

    def in_anthropic_shape(handler: Callable[[Request], Awaitable[Response]]) -> Callable:
        return endpoint(handler, answer=anthropic_error)

    return [Route(anthropic.MESSAGES_URL, in_anthropic_shape(messages), methods=["POST"]),
            Route(anthropic.MESSAGES_URL + "/count_tokens", in_anthropic_shape(count_tokens), methods=["POST"]),
            Route(responses_api.RESPONSES_URL, endpoint(responses), methods=["POST"]),
            Route(responses_api.RESPONSES_URL + "/{id}", endpoint(stored_response), methods=["GET"])]
