"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translator onto chat
completions: a Messages body becomes a chat body that `BodyParser` parses (the same sampling, tools, thinking
and grammar rules), a finished sequence a `message`, and the chat chunks `ChunkStream` writes Anthropic's
stream events. Field policy as in requests.py: each body field is honoured, harmless (with the reason) or
refused by name."""
import json

from dsv4cli.engine import Sequence
from dsv4cli.tokenizer import Tokenizer

from .requests import PASSED_SAMPLING, BadRequest, BodyParser, Request, refuse_unknown, renamed
from .responses import ChunkStream, visible_message

MESSAGES_URL = "/v1/messages"
HONOURED = {"messages", "system", "max_tokens", "stop_sequences", "stream", "thinking", "tools", "tool_choice",
            "output_config"}
COUNTED = {"messages", "system", "thinking", "tools", "tool_choice", "output_config"}    # a count_tokens body's
HARMLESS = {
    "model": "a run serves the one model given by --model",
    "metadata": "a user id for abuse monitoring: nothing to monitor offline",
    "cache_control": "prompts are cached without being asked (the prefix cache)",
    "service_tier": "one tier",
    "speed": "one speed",
    "inference_geo": "it runs on this machine",
    "diagnostics": "no cache-miss reasons are reported",
    "user_profile_id": "no accounts",
    "workspace_id": "no accounts",
}
REFUSED = {
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported; give their tools as tools",
    "context_management": "context management is not supported",
}
# the chat field an error names -> the Messages field it came from
FIELD_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
               "reasoning_effort": "output_config.effort"}
# a content block's keys, by type ("cache_control" everywhere: harmless, see HARMLESS)
BLOCK_KEYS = {"text": {"text", "citations"}, "tool_use": {"id", "name", "input"},
              "tool_result": {"tool_use_id", "content", "is_error"}, "thinking": {"thinking", "signature"}}
TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control", "strict"}
# else stop_sequence, tool_use or end_turn; a grammar's dead end ("constraint", which Anthropic has no name for)
# ends the turn
STOP_REASONS = {"length": "max_tokens", "constraint": "end_turn"}


def parse(parser: BodyParser, body, counting: bool = False) -> Request:
    """A Messages body -> the Request its chat body parses into; `counting`: a count_tokens body (no
    max_tokens, no stream)."""
    chat = chat_body(body, counting)
    if "reasoning_effort" in chat:          # Anthropic's effort shapes a reply, thinking or not: it turns none on
        chat.setdefault("thinking", parser.thinking)
    try:
        req = parser.parse(chat, chat=True, server=True)
    except BadRequest as e:
        raise renamed(e, FIELD_NAMES) from None
    if req.thinking and chat["messages"][-1].get("wo_eos"):
        raise BadRequest("invalid_messages", "messages: a last assistant turn (a prefill) only without thinking")
    return req


def chat_body(body, counting: bool = False) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("invalid_request", "the body: must be a JSON object")
    for name in body:
        if name in REFUSED:
            raise BadRequest("unsupported_parameter", f"{name}: {REFUSED[name]}")
        if name not in (COUNTED if counting else HONOURED | PASSED_SAMPLING) and name not in HARMLESS:
            raise BadRequest("unsupported_parameter", f"{name}: not a supported field of a "
                                                      f"{MESSAGES_URL}{'/count_tokens' if counting else ''} body")
    if not counting and not isinstance(body.get("max_tokens"), int):
        raise BadRequest("invalid_parameter", "max_tokens: required, an integer")
    chat = {name: body[name] for name in PASSED_SAMPLING if name in body}
    for name, key in (("max_tokens", "max_tokens"), ("stop_sequences", "stop"), ("stream", "stream")):
        if name in body:
            chat[key] = body[name]
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["thinking"] = thinking
    chat |= _output_config(body.get("output_config"))
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body["tool_choice"].get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    return chat


def _thinking(value) -> bool | None:
    """{"type": "enabled" | "adaptive"}: DSV4's thinking mode (which thinks as long as it decides: budget_tokens
    is accepted, max_tokens bounds reasoning and answer together); {"type": "disabled"}: chat mode."""
    if value is None:
        return None
    kinds = '{"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or {"type": "disabled"}'
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "adaptive", "disabled"):
        raise BadRequest("invalid_parameter", f"thinking: must be {kinds}")
    refuse_unknown(value, ("type", "budget_tokens", "display"), "thinking")
    if value.get("display") not in (None, "summarized"):
        raise BadRequest("unsupported_parameter", "thinking.display: only summarized (the reasoning is returned)")
    return value["type"] != "disabled"


def _output_config(config) -> dict:
    """effort -> DSV4's reasoning effort (low, high or max: medium and xhigh as peers map them); format -> the
    response format, enforced by a grammar."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise BadRequest("invalid_parameter", "output_config: must be an object with effort and/or format")
    refuse_unknown(config, ("effort", "format"), "output_config")
    chat = {}
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) != {"type", "schema"}:
            raise BadRequest("invalid_parameter", 'output_config.format: must be {"type": "json_schema", "schema": '
                                                  '{...}}')
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return chat


def _tools(tools) -> list[dict]:
    """Anthropic's client tools ({"name", "description", "input_schema"}) as chat tools; server tools refused."""
    if not isinstance(tools, list):
        raise BadRequest("invalid_parameter", "tools: must be a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest("invalid_parameter", f'tools[{i}]: must be {{"name": ..., "input_schema": {{...}}}}')
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str):
                raise BadRequest("invalid_parameter", f"tools[{i}].type: must be custom (or left out)")
            raise BadRequest("unsupported_parameter", f"tools[{i}].type: {kind}: server tools are not supported; "
                                                      f"give client tools (name, input_schema)")
        refuse_unknown(tool, TOOL_KEYS, f"tools[{i}]")
        if tool.get("strict"):
            raise BadRequest("unsupported_parameter", f"tools[{i}].strict: a call is held to its schema only when "
                                                      f'forced: give tool_choice {{"type": "any"}} or "tool"')
        if not isinstance(tool.get("input_schema"), dict):
            raise BadRequest("invalid_parameter", f"tools[{i}].input_schema: must be a JSON schema (an object)")
        described = {"description": tool["description"]} if "description" in tool else {}
        function = {"name": tool["name"], **described, "parameters": tool["input_schema"]}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> str | dict:
    """auto, any (some call: chat's required), tool (a call of the named one), none."""
    kinds = {"auto": "auto", "any": "required", "none": "none", "tool": None}
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str) or choice["type"] not in kinds:
        raise BadRequest("invalid_parameter", 'tool_choice: must be {"type": "auto" | "any" | "tool" | "none"}')
    refuse_unknown(choice, ("type", "name", "disable_parallel_tool_use"), "tool_choice")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise BadRequest("invalid_parameter", "tool_choice.disable_parallel_tool_use: must be true or false")
    if choice["type"] != "tool":
        return kinds[choice["type"]]
    if not isinstance(choice.get("name"), str):
        raise BadRequest("invalid_parameter", 'tool_choice.name: {"type": "tool"} needs the name of a tool')
    return {"type": "function", "function": {"name": choice["name"]}}


def _system(system) -> list[dict]:
    if system is None:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _text(content, place: str) -> str:
    """A string, or text blocks joined as paragraphs."""
    if isinstance(content, str):
        return content
    blocks = _blocks(content, place)
    if (bad := next((i for i, b in enumerate(blocks) if b["type"] != "text"), None)) is not None:
        raise BadRequest("invalid_messages", f"{place}[{bad}].type: {blocks[bad]['type']}: only text blocks here")
    return "\n\n".join(b["text"] for b in blocks)


def _blocks(content, place: str) -> list[dict]:
    """Content blocks checked: known types (images and documents refused: DSV4 reads text), known keys."""
    if not isinstance(content, list):
        raise BadRequest("invalid_messages", f"{place}: must be a string or a list of content blocks")
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise BadRequest("invalid_messages", f"{place}[{i}]: must be a content block (an object with a type)")
        if kind not in BLOCK_KEYS:
            raise BadRequest("invalid_messages", f"{place}[{i}]: {kind} is not supported: DSV4 reads text")
        refuse_unknown(block, BLOCK_KEYS[kind] | {"type", "cache_control"}, f"{place}[{i}]")
        if kind in ("text", "thinking") and not isinstance(block.get(kind), str):
            raise BadRequest("invalid_messages", f"{place}[{i}].{kind}: must be a string")
    return content


def _messages(messages) -> list[dict]:
    """Anthropic turns as chat messages: a user turn's tool_result blocks become tool messages (before its
    text, as DSV4 renders results in the user turn), an assistant turn's thinking, text and tool_use blocks
    one assistant message. A last assistant turn is a prefill the reply continues."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("invalid_messages", "messages: must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        place = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
            raise BadRequest("invalid_messages", f'{place}: must be {{"role": "user" | "assistant", "content": ...}}')
        content = m.get("content")
        if m["role"] == "user":
            out += _user(content, f"{place}.content")
        else:
            out.append(_assistant(content, f"{place}.content"))
    if out[-1]["role"] == "assistant":
        if out[-1].get("tool_calls"):
            raise BadRequest("invalid_messages", "messages: a last assistant turn (a prefill) cannot hold tool_use")
        out[-1]["wo_eos"] = True
    return out


def _user(content, place: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, texts = [], []
    for i, block in enumerate(_blocks(content, place)):
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise BadRequest("invalid_messages", f"{place}[{i}].tool_use_id: must be a string")
            text = _text(block.get("content", ""), f"{place}[{i}].content")
            # DSV4 has no error flag on a result: the text says so
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": f"Error: {text}" if block.get("is_error") else text})
        else:
            raise BadRequest("invalid_messages", f"{place}[{i}]: a {block['type']} block is the assistant's")
    return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts or not results else [])


def _assistant(content, place: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message, texts = {"role": "assistant", "content": ""}, []
    for i, block in enumerate(_blocks(content, place)):
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "thinking":
            message["reasoning_content"] = block["thinking"]
        elif block["type"] == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
                    not isinstance(block.get("input"), dict):
                raise BadRequest("invalid_messages", f"{place}[{i}]: a tool_use needs an id, a name and an input "
                                                     f"object")
            call = {"id": block["id"], "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}
            message.setdefault("tool_calls", []).append(call)
        else:
            raise BadRequest("invalid_messages", f"{place}[{i}]: a tool_result block is the user's")
    message["content"] = "\n\n".join(texts)
    return message


def tool_input(arguments: str) -> dict:
    """A call's arguments as the input object (text that is not a JSON object: its one parameter `arguments`,
    as encoding.py reads such a call back)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def usage(seq: Sequence) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from input_tokens."""
    cached = seq.metrics.cached_tokens
    return {"input_tokens": len(seq.prompt_ids) - cached, "output_tokens": len(seq.output_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop(seq: Sequence, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if seq.stopped_by is not None:
        return "stop_sequence", seq.stopped_by
    return STOP_REASONS.get(seq.finish_reason, "tool_use" if called else "end_turn"), None


def message(req: Request, seq: Sequence, model: str, tok: Tokenizer, number: str) -> dict:
    """The reply as a `message`: thinking, text and tool_use blocks (each only when it has something)."""
    parsed = visible_message(tok, seq.text, req.thinking, req.params.ignore_eos)
    content = [{"type": "thinking", "thinking": parsed["reasoning_content"], "signature": ""}] \
        if req.thinking and parsed["reasoning_content"] else []
    if parsed["content"]:
        content.append({"type": "text", "text": parsed["content"]})
    for i, call in enumerate(parsed["tool_calls"]):
        content.append({"type": "tool_use", "id": tool_use_id(f"call_{number}_{i}"), "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    reason, sequence = stop(seq, bool(parsed["tool_calls"]))
    return {"id": f"msg_{number}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(seq)}


class MessageEvents:
    """One reply as Anthropic's stream events, (name, data) pairs: message_start and a ping, then per block
    content_block_start, its deltas (thinking_delta, text_delta, input_json_delta) and content_block_stop,
    then message_delta (stop reason, usage) and message_stop. Translated from the chat chunks of a
    ChunkStream, so no markup ever streams and the deltas join into the non-streamed message."""

    def __init__(self, req: Request, tok: Tokenizer, model: str, number: str):
        self.req, self.tok, self.model, self.number = req, tok, model, number
        self.chunks = ChunkStream(req, tok, model, number)
        self.blocks = 0                 # blocks started
        self.open: str | None = None    # the type of the block open now

    def first(self) -> list[tuple[str, dict]]:
        start = {"id": f"msg_{self.number}", "type": "message", "role": "assistant", "model": self.model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(self.req.prompt_ids), "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": start}), ("ping", {"type": "ping"})]

    def update(self, text: str, logprobs: list) -> list[tuple[str, dict]]:
        return self._translate(self.chunks.update(text, logprobs))

    def finish(self, seq: Sequence) -> list[tuple[str, dict]]:
        events = self._translate(self.chunks.finish(seq)) + self._close()
        called = visible_message(self.tok, seq.text, self.req.thinking, self.req.params.ignore_eos)["tool_calls"]
        reason, sequence = stop(seq, bool(called))
        return events + [("message_delta", {"type": "message_delta", "usage": usage(seq),
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence}}),
                         ("message_stop", {"type": "message_stop"})]

    def failed(self, message: str) -> list[tuple[str, dict]]:
        return [("error", {"type": "error", "error": {"type": "api_error", "message": message}})]

    def _translate(self, chunks: list[dict]) -> list[tuple[str, dict]]:
        events = []
        for chunk in chunks:
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("reasoning_content"):
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                events += self._start({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls", []):
                if "id" in call:            # a new call: a block of its own
                    events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                                           "name": call["function"]["name"], "input": {}}, new=True)
                if call["function"]["arguments"]:
                    events.append(self._delta({"type": "input_json_delta",
                                               "partial_json": call["function"]["arguments"]}))
        return events

    def _start(self, block: dict, new: bool = False) -> list[tuple[str, dict]]:
        """Start a block of this type unless one is open (a tool call always starts one)."""
        if self.open == block["type"] and not new:
            return []
        events = self._close()
        self.open = block["type"]
        self.blocks += 1
        return events + [("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                                  "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]
