"""A bad body on the agent APIs is a 400 in the API's own shape, never a crash: every field (and nested field) of
valid Anthropic Messages and OpenAI Responses bodies replaced by each hostile value (or left out), parsed
in-process, must parse or raise BadRequest; a handful of the bodies that crashed the handlers get a 400 from a
real server."""
import copy
import json

import pytest
from test_serve import Server

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.engine import SamplingParams
from dsv4cli.openai import anthropic as messages_api
from dsv4cli.openai import responses_api
from dsv4cli.openai.requests import BadRequest, BodyParser
from dsv4cli.tokenizer import Tokenizer

SCHEMA = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12}}}


def deep(depth: int):
    value = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


# each a function, so that no body shares (and a parser could change) another's value; NaN and inf are how Python
# reads JSON's NaN and 1e999
HOSTILE = [lambda: None, lambda: True, lambda: 0, lambda: -1, lambda: 1e308, lambda: "", lambda: "x", lambda: [],
           lambda: [1], lambda: {}, lambda: {"type": 1}, lambda: {"type": []}, lambda: [{"type": []}],
           lambda: deep(500), lambda: float("nan"), lambda: float("inf")]
ABSENT = object()       # the field left out

TEXT = {"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral"}}
# valid Messages bodies that between them hold every field: tools, a forced call, a tool round trip, thinking,
# output_config, a prefill
MESSAGES = [
    {"model": "x", "max_tokens": 16, "system": [{"type": "text", "text": "Be brief."}],
     "messages": [
         {"role": "user", "content": [TEXT]},
         {"role": "assistant", "content": [
             {"type": "thinking", "thinking": "A call.", "signature": ""}, {"type": "text", "text": "Looking."},
             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}],
              "is_error": False},
             {"type": "text", "text": "And tomorrow?"}]}],
     "tools": [{"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA,
                "type": "custom", "cache_control": {"type": "ephemeral"}}],
     "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     "thinking": {"type": "disabled"}, "stop_sequences": ["\n\n"], "stream": False, "temperature": 0.5,
     "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"}},
    {"max_tokens": 16, "system": "Be brief.",
     "messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny",
                                                "is_error": True}]}],
     "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "summarized"}, "stream": True,
     "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}},
     "tools": [{"name": "get_weather", "input_schema": SCHEMA}], "tool_choice": {"type": "auto"}},
    {"max_tokens": 16, "messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": [{"type": "text", "text": "Hel"}]}],
     "thinking": {"type": "disabled"}, "output_config": {"effort": "low"}, "tool_choice": {"type": "none"}},
]
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA,
            "strict": True}
STORED = "resp_0"
# valid Responses bodies: input items of each type, tools, a forced call, reasoning, include, text.format, a
# continuation
RESPONSES = [
    {"model": "x", "instructions": "Be brief.", "max_output_tokens": 16,
     "input": [
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
         {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "A call."}]},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}],
          "id": "msg_1", "status": "completed"},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
         {"role": "developer", "content": "And tomorrow?"}],
     "tools": [FUNCTION], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
     "reasoning": {"effort": "none"}, "store": False, "include": ["reasoning.encrypted_content"],
     "truncation": "disabled", "temperature": 0.5, "top_p": 0.9, "metadata": {"k": "v"}, "user": "u",
     "stream_options": {"include_obfuscation": False}},
    {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "Think."}]},
               {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_2",
                "output": [{"type": "input_text", "text": "Rain"}]}],
     "previous_response_id": STORED, "stream": True, "tools": [FUNCTION], "tool_choice": "auto",
     "reasoning": {"effort": "high", "summary": "auto"},
     "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True},
              "verbosity": "medium"}},
    {"input": "Hi", "text": {"format": {"type": "json_object"}}, "reasoning": {"effort": "low"},
     "tool_choice": "none"},
]


def places(value, path=()):
    """The path of every field and list item in a body, outermost first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield path + (key,)
        yield from places(item, path + (key,))


def hostile_bodies(bases: list[dict]):
    """(path, body) for each base body, each path in it and each hostile value there (or the field absent)."""
    for base in bases:
        for path in places(base):
            for make in HOSTILE + [ABSENT]:
                body = copy.deepcopy(base)
                parent = body
                for key in path[:-1]:
                    parent = parent[key]
                if make is ABSENT:
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = make()
                yield path, body


@pytest.fixture(scope="module")
def parser():
    return BodyParser(Tokenizer.from_dir(BUNDLED_MODEL_DIR), SamplingParams(), 4096)


def store() -> responses_api.ResponseStore:
    """A store that holds the response the continuations continue."""
    s = responses_api.ResponseStore(1 << 20)
    s.put(STORED, {"id": STORED}, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    return s


def responded(parser: BodyParser, body) -> None:
    """Parse a Responses body, and write the response that echoes its fields as the server writes JSON."""
    turn = responses_api.parse(parser, store(), body)
    json.dumps(responses_api.envelope(turn, "x", "0", 0, "completed"), allow_nan=False)


def counted(body: dict) -> dict:
    """A Messages body as a count_tokens body: without what only a reply has."""
    return {k: v for k, v in body.items() if k not in REPLY_ONLY}


REPLY_ONLY = ("max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k")
# each API's parse (parser, body) and its valid bodies
APIS = {"messages": (lambda parser, body: messages_api.parse(parser, body), MESSAGES),
        "count_tokens": (lambda parser, body: messages_api.parse(parser, body, counting=True),
                         [counted(body) for body in MESSAGES]),
        "responses": (responded, RESPONSES)}


def test_the_valid_bodies_parse(parser):
    """Each hostile body is one bad field away from a valid one."""
    for parse, bases in APIS.values():
        for body in bases:
            parse(parser, body)


@pytest.mark.parametrize("api", APIS)
def test_every_hostile_field_parses_or_is_a_bad_request(parser, api):
    parse, bases = APIS[api]
    sent, crashed = 0, []
    for path, body in hostile_bodies(bases):
        sent += 1
        try:
            parse(parser, body)
        except BadRequest:
            pass
        except Exception as e:      # noqa: BLE001  (anything else is the crash looked for)
            crashed.append(f"{'.'.join(map(str, path))}: {type(e).__name__}: {e}"[:200])
    print(f"{api}: {sent} bodies, {len(crashed)} crashed")
    assert not crashed, f"{len(crashed)} of {sent} bodies crashed:\n" + "\n".join(crashed)


# bodies that crashed the handlers (a bare 500), Responses' as JSON text (with NaN, which Python's reader takes),
# and the field each error names
HI = [{"role": "user", "content": "Hi"}]
ANTHROPIC_CRASHES = [
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": []}]}]},
     "messages[0].content[0]"),
    ("/v1/messages", {"max_tokens": 4, "messages": HI, "tool_choice": {"type": {}}}, "tool_choice"),
    ("/v1/messages/count_tokens", {"messages": HI, "system": [{"type": []}]}, "system[0]"),
    ("/v1/messages", {"max_tokens": 4, "messages": HI, "tool_choice": {"type": "any"},
                      "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": 1}}}]}, "tools"),
]
OPENAI_CRASHES = [
    ('{"input": [{"type": ["message"], "role": "user", "content": "Hi"}]}', "input[0].type"),
    ('{"input": "Hi", "include": [{}]}', "include"),
    ('{"input": [{"type": "reasoning", "content": 1}, {"role": "user", "content": "Hi"}]}', "input[0].content"),
    ('{"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": '
     '{"x": {"type": "number", "maximum": NaN}}}}]}', "tools[0].parameters.properties.x.maximum"),
]
# bodies with a value (@) nested as deep as the server's JSON reader goes, or about: an error message that writes
# the value, or a response that echoes it, recursed past Python's limit (a 500)
NESTED = [
    ("/v1/responses", '{"input": "Hi", "tool_choice": @}'),
    ("/v1/responses", '{"input": "Hi", "previous_response_id": @}'),
    ("/v1/responses", '{"input": "Hi", "tools": [{"type": @}]}'),
    ("/v1/responses", '{"input": [{"role": "user", "content": [{"type": @}]}]}'),
    ("/v1/responses", '{"input": "Hi", "max_output_tokens": 1, "tools": [{"type": "function", "name": "f", '
                      '"parameters": {"type": "object", "properties": {"x": @}}}]}'),
    ("/v1/messages", '{"max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"name": "f", '
                     '"type": @}]}'),
    ("/v1/messages", '{"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": @}]}]}'),
]


def refusal(server: Server, path: str, body: dict | str) -> dict:
    """POST a body that must be refused: a 400 in its API's error shape (Anthropic's on /v1/messages, OpenAI's
    on /v1/responses); its `error` object."""
    r = server.post(path, body if isinstance(body, dict) else body.encode(), key=None)
    assert r.status_code == 400, (path, str(body)[:200], r.status_code, r.text[:200])
    answer = r.json()
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, answer
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["type"] == "invalid_request_error", answer
    return answer["error"]


def test_bodies_that_crashed_the_handlers_are_400s_in_each_apis_shape(tmp_path):
    """Through a real server: each a 400 naming the field (Responses' `param`); a valid body still gets its
    reply."""
    server = Server(tmp_path, "--temperature", "0", "--max-batch", "2")
    try:
        for path, body, field in ANTHROPIC_CRASHES:
            assert refusal(server, path, body)["message"].startswith(field + ":")
        for body, field in OPENAI_CRASHES:
            assert refusal(server, "/v1/responses", body)["param"] == field
        for depth in range(960, 1000):
            for path, body in NESTED:
                refusal(server, path, body.replace("@", "[" * depth + "]" * depth))
        r = server.post("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, key=None)
        assert r.status_code == 200 and r.json()["status"] == "incomplete", r.text
    finally:
        server.stop()
