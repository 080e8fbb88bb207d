"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) as a translator onto chat
completions: a Responses body (with the conversation of its `previous_response_id`, kept in a bounded
in-memory store) becomes a chat body that `BodyParser` parses, a finished sequence a `response` of output
items, and the chat chunks `ChunkStream` writes Responses stream events. Field policy as in requests.py."""
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from dsv4cli.encoding import THINK_END
from dsv4cli.engine import Sequence
from dsv4cli.tokenizer import Tokenizer

from .requests import PASSED_SAMPLING, BadRequest, BodyParser, Request, check_metadata, refuse_unknown, renamed
from .responses import ChunkStream, visible_message

RESPONSES_URL = "/v1/responses"
# responses kept for previous_response_id and GET, the least recently used dropped first when there are more, or
# when their JSON's bytes (body and conversation: a chain of n turns holds its start n times) pass the setting
# `stored_responses_bytes`
STORED_RESPONSES = 1024
HONOURED = {"input", "instructions", "max_output_tokens", "stream", "tools", "tool_choice", "reasoning", "text",
            "previous_response_id", "store", "include", "truncation", "parallel_tool_calls"}
HARMLESS = {
    "model": "a run serves the one model given by --model",
    "metadata": "tags, echoed in the response",
    "user": "an end-user id for abuse monitoring: nothing to monitor offline",
    "safety_identifier": "an end-user id for abuse monitoring: nothing to monitor offline",
    "prompt_cache_key": "prompts are cached without a key (the prefix cache)",
    "prompt_cache_retention": "the prefix cache keeps what its memory holds",
    "service_tier": "one tier",
    "stream_options": "its one option pads events against observers of the network: none offline",
}
REFUSED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not stored; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "not supported",
    "top_logprobs": "not returned by /v1/responses; use /v1/chat/completions",
}
# include's values: reasoning items carry their text in `content`, which input takes back (no encrypted form)
INCLUDED = {"reasoning.encrypted_content"}
FIELD_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort", "thinking": "reasoning", "messages": "input"}
ITEM_KEYS = {"message": {"role", "content"}, "function_call": {"call_id", "name", "arguments"},
             "function_call_output": {"call_id", "output"}, "reasoning": {"summary", "content", "encrypted_content"}}
TEXT_PARTS = ("input_text", "output_text")
# how deep a field a response echoes (tools, text) may nest: far deeper than any schema, far shallower than the
# recursion limit at which the response's JSON is written
ECHO_DEPTH = 100


@dataclass
class Turn:
    """A parsed Responses body: the request to run, the conversation it continues (chat messages, without the
    instructions, which a continuation does not carry over) and the body fields a response echoes."""
    req: Request
    messages: list[dict]
    fields: dict
    store: bool


class ResponseStore:
    """Finished responses by id: each one's body (GET) and conversation (previous_response_id), at most
    `size` of them and `limit` bytes of their JSON (0: none kept), in memory: a restart forgets them."""

    def __init__(self, limit: int, size: int = STORED_RESPONSES):
        self.size, self.limit, self.bytes = size, limit, 0
        self.items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()

    def put(self, rid: str, body: dict, messages: list[dict]) -> None:
        size = len(json.dumps([body, messages]))        # ASCII: a character per byte
        self.items[rid] = (body, messages, size)
        self.bytes += size
        while len(self.items) > self.size or self.bytes > self.limit:
            self.bytes -= self.items.popitem(last=False)[1][2]

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        if rid not in self.items:
            return None
        self.items.move_to_end(rid)
        return self.items[rid][:2]


def parse(parser: BodyParser, store: ResponseStore, body) -> Turn:
    """A Responses body -> the Turn its chat body (after the stored conversation it continues) parses into."""
    if not isinstance(body, dict):
        raise BadRequest("invalid_request", "the body: must be a JSON object")
    for name in body:
        if name in REFUSED:
            raise BadRequest("unsupported_parameter", f"{name}: {REFUSED[name]}")
        if name not in HONOURED and name not in HARMLESS and name not in PASSED_SAMPLING:
            raise BadRequest("unsupported_parameter", f"{name}: not a supported field of a {RESPONSES_URL} body")
    check_metadata(body.get("metadata"))
    history = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise BadRequest("invalid_parameter", "previous_response_id: must be a string")
        stored = store.get(previous)
        if stored is None:
            raise BadRequest("previous_response_not_found", f"previous_response_id: {previous!r} is not stored here "
                                                            f"(not with store false; a restart forgets, and the least "
                                                            f"recently used go when the store is full)")
        history = stored[1]
    chat = chat_body(body, history)
    try:
        req = parser.parse(chat, chat=True, server=True)
    except BadRequest as e:
        raise renamed(e, FIELD_NAMES) from None
    effort = (body.get("reasoning") or {}).get("effort")
    fields = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
              "previous_response_id": previous, "tools": body.get("tools", []),
              "tool_choice": body.get("tool_choice", "auto"), "temperature": req.params.temperature,
              "top_p": req.params.top_p, "parallel_tool_calls": req.parallel_tool_calls, "truncation": "disabled",
              "reasoning": {"effort": effort if req.thinking else None, "summary": None},
              "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
              "store": body.get("store", True)}
    for name, value in fields.items():
        _echoable(value, name)
    return Turn(req, chat["messages"][1:] if body.get("instructions") else chat["messages"], fields, fields["store"])


def chat_body(body: dict, history: list[dict]) -> dict:
    """The chat body: the instructions as its system message, then the conversation and the input."""
    _checked_options(body)
    chat = {name: body[name] for name in PASSED_SAMPLING if name in body} | _reasoning(body.get("reasoning"))
    for name, key in (("max_output_tokens", "max_tokens"), ("stream", "stream"), ("parallel_tool_calls",) * 2):
        if name in body:
            chat[key] = body[name]
    chat |= _format(body.get("text"))
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("invalid_parameter", "instructions: must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    return chat | {"messages": system + history + _input(body.get("input"))}


def _checked_options(body: dict) -> None:
    if not isinstance(body.get("store", True), bool):
        raise BadRequest("invalid_parameter", "store: must be true or false")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(v, str) for v in include)):
        raise BadRequest("invalid_parameter", "include: must be a list of strings")
    if (bad := next((v for v in include or [] if v not in INCLUDED), None)) is not None:
        raise BadRequest("unsupported_parameter", f"include: {bad!r} is not supported (only "
                                                  f"{', '.join(sorted(INCLUDED))})")
    if body.get("truncation", "disabled") != "disabled":
        raise BadRequest("unsupported_parameter", "truncation: only disabled (a prompt that does not fit is refused)")


def _reasoning(reasoning) -> dict:
    """effort none: chat mode; another effort: thinking mode at that effort (DSV4's low, high and max; minimal,
    medium and xhigh as peers map them). No summaries are written: the reasoning item holds the reasoning."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise BadRequest("invalid_parameter", "reasoning: must be an object with effort")
    refuse_unknown(reasoning, ("effort", "summary", "generate_summary"), "reasoning")
    effort = reasoning.get("effort")
    if effort == "none":
        return {"thinking": False}
    return {"thinking": True} | ({"reasoning_effort": effort} if effort is not None else {})


def _format(text) -> dict:
    """text.format -> chat's response_format (json_schema's name, schema, strict and description one level
    up). text.verbosity: medium, the default, only (nothing sets a reply's length but max_output_tokens)."""
    if text is None:
        return {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise BadRequest("unsupported_parameter", "text: only format and verbosity are supported")
    if text.get("verbosity", "medium") != "medium":
        raise BadRequest("unsupported_parameter", "text.verbosity: only medium (the length is the model's; "
                                                  "max_output_tokens bounds it)")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise BadRequest("invalid_parameter", "text.format: must be an object")
    if fmt.get("type") != "json_schema":
        return {"response_format": fmt}
    return {"response_format": {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}}


def _tools(tools) -> list[dict]:
    """Function tools ({"type": "function", "name", "description", "parameters", "strict"}) as chat tools;
    hosted tools refused."""
    if not isinstance(tools, list):
        raise BadRequest("invalid_parameter", "tools: must be a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            named = f"{kind}: " if isinstance(kind, str) else ""
            raise BadRequest("unsupported_parameter", f"tools[{i}].type: {named}only function tools are supported")
        refuse_unknown(tool, ("type", "name", "description", "parameters", "strict"), f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("auto", "none", "required"):
        return choice
    got = f", got {json.dumps(choice)}" if isinstance(choice, str) else ""
    raise BadRequest("invalid_parameter", f'tool_choice: must be auto, none, required or {{"type": "function", '
                                          f'"name": ...}}{got}')


def _input(value) -> list[dict]:
    """`input` as chat messages: a text is a user message; items: messages, function calls (on the assistant
    message they follow, or one of their own), function call outputs (tool messages) and reasoning (the
    reasoning of the assistant message after it)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("invalid_messages", "input: must be a text or a non-empty list of items")
    out, reasoning = [], None
    for i, item in enumerate(value):
        place = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest("invalid_messages", f"{place}: must be an item (an object)")
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str) or kind not in ITEM_KEYS:
            named = f"{kind}: " if isinstance(kind, str) else ""
            raise BadRequest("invalid_messages", f"{place}.type: {named}not supported (message, function_call, "
                                                 f"function_call_output and reasoning are)")
        refuse_unknown(item, ITEM_KEYS[kind] | {"type", "id", "status"}, place)
        if kind == "reasoning":
            reasoning = _reasoning_text(item, place)
            continue
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise BadRequest("invalid_messages", f"{place}.role: must be user, assistant, system or developer")
            out.append({"role": item["role"], "content": _text(item.get("content"), f"{place}.content")})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", place),
                        "content": _text(item.get("output"), f"{place}.output")})
        else:
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            arguments = _string(item, "arguments", place)
            out[-1].setdefault("tool_calls", []).append(
                {"id": _string(item, "call_id", place), "type": "function",
                 "function": {"name": _string(item, "name", place), "arguments": arguments}})
        if out[-1]["role"] == "assistant" and reasoning is not None:
            out[-1]["reasoning_content"], reasoning = reasoning, None
    return out


def _reasoning_text(item: dict, place: str) -> str:
    """A reasoning item's text: its content's parts (reasoning_text), else its summary's (summary_text)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise BadRequest("invalid_messages", f"{place}.{key}: must be a list of parts")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise BadRequest("invalid_messages", f"{place}.{key}[{j}].text: must be a string")
    return "".join(p["text"] for p in item.get("content") or item.get("summary") or [])


def _string(item: dict, key: str, place: str) -> str:
    if not isinstance(item.get(key), str):
        raise BadRequest("invalid_messages", f"{place}.{key}: must be a string")
    return item[key]


def _text(content, place: str) -> str:
    """A text, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest("invalid_messages", f"{place}: must be a text or a list of text parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            named = f"{kind}: " if isinstance(kind, str) else ""
            raise BadRequest("invalid_messages", f"{place}[{j}]: {named}only text parts ({', '.join(TEXT_PARTS)}) "
                                                 f"are supported: DSV4 reads text")
    return "".join(p["text"] for p in content)


def _echoable(value, place: str) -> None:
    """A field a response echoes must encode as JSON again, deeper in the server's stack than it was decoded:
    finite numbers (Python's JSON reader takes NaN, Infinity and 1e999, which no JSON writer writes), nested at
    most ECHO_DEPTH levels."""
    todo = [(value, place, 0)]
    while todo:
        value, place, depth = todo.pop()
        if depth > ECHO_DEPTH:
            raise BadRequest("invalid_parameter", f"{place}: nested deeper than {ECHO_DEPTH} levels")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest("invalid_parameter", f"{place}: must be a finite number")
        if isinstance(value, dict):
            todo += [(v, f"{place}.{k}", depth + 1) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(v, f"{place}[{i}]", depth + 1) for i, v in enumerate(value)]


def reasoning_tokens(seq: Sequence, tok: Tokenizer, thinking: bool) -> int:
    """Output tokens up to `</think>` (all of them when the reply ended inside its reasoning)."""
    if not thinking:
        return 0
    end = tok.special_ids[THINK_END]
    return seq.output_ids.index(end) if end in seq.output_ids else len(seq.output_ids)


def usage(seq: Sequence, tok: Tokenizer, thinking: bool) -> dict:
    prompt, output, reasoning = len(seq.prompt_ids), len(seq.output_ids), reasoning_tokens(seq, tok, thinking)
    # the prefix store's writes are not counted per request: cache_write_tokens 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": seq.metrics.cached_tokens,
                                                             "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


def output_items(parsed: dict, thinking: bool, number: str, status: str) -> list[dict]:
    """A reply's output: its reasoning, its message (when it has text or makes no calls), its function calls."""
    items = []
    if thinking and parsed["reasoning_content"]:
        items.append({"type": "reasoning", "id": f"rs_{number}", "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": parsed["reasoning_content"]}]})
    if parsed["content"] or not parsed["tool_calls"]:
        items.append({"type": "message", "id": f"msg_{number}", "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": parsed["content"], "annotations": [],
                                   "logprobs": []}]})
    for i, call in enumerate(parsed["tool_calls"]):
        items.append({"type": "function_call", "id": f"fc_{number}_{i}", "call_id": f"call_{number}_{i}",
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def envelope(turn: Turn, model: str, number: str, created: int, status: str) -> dict:
    return {"id": f"resp_{number}", "object": "response", "created_at": created, "status": status, "model": model,
            "output": [], "error": None, "incomplete_details": None, "usage": None} | turn.fields


def response(turn: Turn, seq: Sequence, model: str, tok: Tokenizer, number: str, created: int) -> dict:
    """The finished `response`: completed, or incomplete when max_output_tokens cut it."""
    status = "incomplete" if seq.finish_reason == "length" else "completed"
    parsed = visible_message(tok, seq.text, turn.req.thinking, turn.req.params.ignore_eos)
    body = envelope(turn, model, number, created, status) | {
        "output": output_items(parsed, turn.req.thinking, number, status),
        "usage": usage(seq, tok, turn.req.thinking)}
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def conversation(turn: Turn, seq: Sequence, tok: Tokenizer, number: str) -> list[dict]:
    """The conversation a later response continues: this one's, then its reply as an assistant message."""
    parsed = visible_message(tok, seq.text, turn.req.thinking, turn.req.params.ignore_eos)
    reply = {"role": "assistant", "content": parsed["content"]}
    if turn.req.thinking:
        reply["reasoning_content"] = parsed["reasoning_content"]
    if parsed["tool_calls"]:
        reply["tool_calls"] = [{"id": f"call_{number}_{i}", **call} for i, call in enumerate(parsed["tool_calls"])]
    return turn.messages + [reply]


class ResponseEvents:
    """One reply as Responses stream events, (name, data) pairs numbered by sequence_number: response.created
    and .in_progress; per output item output_item.added, its deltas (reasoning_text.delta, content_part.added
    and output_text.delta, function_call_arguments.delta) and their .done events, output_item.done; then
    response.completed (or .incomplete) with the whole response. Translated from the chat chunks of a
    ChunkStream: no markup ever streams, and the items are those of the non-streamed response."""

    def __init__(self, turn: Turn, tok: Tokenizer, model: str, number: str):
        self.turn, self.tok, self.model, self.number = turn, tok, model, number
        self.created = int(time.time())
        self.chunks = ChunkStream(turn.req, tok, model, number)
        self.items: list[dict] = []         # the output items started, as they are so far
        self.open = False                   # whether the last of them is still open
        self.count = 0                      # events sent
        self.body: dict | None = None       # the finished response

    def first(self) -> list[tuple[str, dict]]:
        body = envelope(self.turn, self.model, self.number, self.created, "in_progress")
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def update(self, text: str, logprobs: list) -> list[tuple[str, dict]]:
        return self._translate(self.chunks.update(text, logprobs))

    def finish(self, seq: Sequence) -> list[tuple[str, dict]]:
        """The last events, ending with the response (kept as `body`)."""
        events = self._translate(self.chunks.finish(seq)) + self._close()
        body = response(self.turn, seq, self.model, self.tok, self.number, self.created)
        for item in body["output"][len(self.items):]:       # an empty message: no delta started it
            self.items.append(item)
            events += [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item),
                       self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)]
        self.body = body
        return events + [self._event(f"response.{body['status']}", response=body)]

    def failed(self, message: str) -> list[tuple[str, dict]]:
        body = envelope(self.turn, self.model, self.number, self.created, "failed")
        return [self._event("response.failed", response=body | {"error": {"code": "server_error", "message": message}})]

    def _translate(self, chunks: list[dict]) -> list[tuple[str, dict]]:
        events = []
        for chunk in chunks:
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("reasoning_content"):
                events += self._start({"type": "reasoning", "id": f"rs_{self.number}", "summary": [],
                                       "content": [{"type": "reasoning_text", "text": ""}]})
                events.append(self._text("response.reasoning_text.delta", delta["reasoning_content"]))
            if delta.get("content"):
                events += self._start({"type": "message", "id": f"msg_{self.number}", "role": "assistant",
                                       "content": [{"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []}]})
                events.append(self._text("response.output_text.delta", delta["content"]))
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    events += self._start({"type": "function_call", "id": f"fc_{self.number}_{call['index']}",
                                           "call_id": call["id"], "name": call["function"]["name"], "arguments": ""})
                if call["function"]["arguments"]:
                    self.items[-1]["arguments"] += call["function"]["arguments"]
                    events.append(self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                              output_index=len(self.items) - 1, delta=call["function"]["arguments"]))
        return events

    def _start(self, item: dict) -> list[tuple[str, dict]]:
        """Start an item of this type unless one is open (a function call always starts one)."""
        if self.open and self.items[-1]["type"] == item["type"] != "function_call":
            return []
        events = self._close()
        self.items.append(item)
        self.open = True
        shown = item | ({"content": []} if "content" in item else {}) | {"status": "in_progress"}
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=shown))
        if "content" in item:
            events.append(self._part("response.content_part.added"))
        return events

    def _text(self, name: str, delta: str) -> tuple[str, dict]:
        part = self.items[-1]["content"][0]
        part["text"] += delta
        extra = {"logprobs": []} if part["type"] == "output_text" else {}
        return self._event(name, item_id=self.items[-1]["id"], output_index=len(self.items) - 1, content_index=0,
                           delta=delta, **extra)

    def _part(self, name: str) -> tuple[str, dict]:
        return self._event(name, item_id=self.items[-1]["id"], output_index=len(self.items) - 1, content_index=0,
                           part=self.items[-1]["content"][0])

    def _close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open, item, events = False, self.items[-1], []
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "output_text" if part["type"] == "output_text" else "reasoning_text"
            extra = {"logprobs": []} if kind == "output_text" else {}
            events += [self._event(f"response.{kind}.done", **where, content_index=0, text=part["text"], **extra),
                       self._part("response.content_part.done")]
        return events + [self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def _event(self, kind: str, **data) -> tuple[str, dict]:
        self.count += 1
        return kind, {"type": kind, "sequence_number": self.count - 1, **data}
