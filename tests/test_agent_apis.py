"""The APIs coding agents speak on `dsv4 serve`: Anthropic's Messages API through the real `anthropic` SDK and
OpenAI's Responses API through the real `openai` SDK, against a real server process on the bundled model; greedy
answers checked against `dsv4 generate`'s engine and prompt building, tool round trips against chat completions
on the same conversation."""
import copy
import json
import re
import threading
import time
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from pydantic import TypeAdapter
from test_serve import KEY, MAX_TOKENS, PROMPTS, Server

from dsv4cli.config import BUNDLED_MODEL_DIR, resolve
from dsv4cli.encoding import DSML, TOOL_CALLS_END, TOOL_CALLS_OPENING, parse_completion
from dsv4cli.engine import SamplingParams, Sequence
from dsv4cli.generate import prompt_ids
from dsv4cli.loading import load_engine, sampling_params
from dsv4cli.openai import anthropic as messages_api
from dsv4cli.openai import responses_api
from dsv4cli.openai.requests import BadRequest, BodyParser
from dsv4cli.tokenizer import Tokenizer

SCHEMA = {"type": "object", "required": ["city", "days"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                               "maximum": 7}}}
WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}   # Anthropic's form
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                              "parameters": SCHEMA}}
MARKUP = ("｜", "DSML", "<think>", "</think>", "tool_calls>")
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence. " * 20     # over 128 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Greedy, 16 slots, the key from the environment variable."""
    s = Server(tmp_path_factory.mktemp("agents"), "--temperature", "0", "--max-batch", "16",
               env={"DSV4_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def generate():
    """What `dsv4 generate --temperature 0` answers (its prompt building and engine) with these flags
    (system, thinking, reasoning_effort, max_tokens), each prompt run alone; as (reasoning, answer)."""
    base = {"temperature": 0.0, "max_batch": 1}
    engine = load_engine(resolve(flags=base, env={})[0], "generate")

    def answer(prompt: str, tools: list | None = None, **flags) -> tuple[str, str]:
        settings, _ = resolve(flags=base | {"max_tokens": MAX_TOKENS} | flags, env={})
        seq = engine.submit(prompt_ids(engine, settings, prompt, tools or []), sampling_params(settings))
        while engine.has_work():
            engine.step()
        parsed = parse_completion(seq.text, settings.thinking)
        return parsed["reasoning_content"], parsed["content"]

    return answer


def claude(server: Server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def codex(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def without_ids(value):
    """A reply as another request's must equal it: ids (which number each reply) left out, and what the SDK's
    stream helpers add (`parsed`: the text parsed into a format, here none)."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items()
                if k not in ("id", "call_id", "created_at", "parsed", "parsed_output", "parsed_arguments")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def anthropic_blocks(events: list) -> list[dict]:
    """The blocks a well-formed Anthropic event sequence builds, each block's deltas joined; asserts the order:
    message_start, then blocks (start, deltas of its kind, stop) numbered 0.., then message_delta, message_stop."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks, open_ = [], None
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_ is None and e.index == len(blocks)
            blocks.append({"type": e.content_block.type, "text": ""} | (
                {"name": e.content_block.name} if e.content_block.type == "tool_use" else {}))
            open_ = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_
            d = e.delta
            text = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[d.type]
            blocks[-1]["text"] += getattr(d, text)
        else:
            assert e.type == "content_block_stop" and e.index == open_, e
            open_ = None
    assert open_ is None
    for block in blocks:
        assert not any(m in block["text"] for m in MARKUP), block
    return blocks


def responses_items(events: list) -> list[dict]:
    """The output items a well-formed Responses event sequence builds (deltas joined): asserts the order,
    response.created first, every item added, its deltas, done, then response.completed or .incomplete; and
    sequence numbers 0, 1, ..."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    items, open_ = [], None
    for e in events[1:-1]:
        if e.type == "response.output_item.added":
            assert open_ is None and e.output_index == len(items)
            items.append({"type": e.item.type, "text": ""})
            open_ = e.output_index
        elif e.type == "response.output_item.done":
            assert e.output_index == open_
            open_ = None
        elif e.type.endswith(".delta"):
            assert e.output_index == open_
            items[-1]["text"] += e.delta
    assert open_ is None
    for item in items:
        assert not any(m in item["text"] for m in MARKUP), item
    return items


def wire(server: Server, path: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed reply's events as sent: (the `event:` line's name, the `data:` line's JSON)."""
    return sse(server.post(path, body | {"stream": True}).text)


def sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for event in text.split("\n\n")[:-1]:
        name, data = event.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def valid(kind, events: list[tuple[str, dict]]) -> list[dict]:
    """The events' data, each checked against the SDK's type of a stream event and named by its type."""
    adapter = TypeAdapter(kind)
    for name, data in events:
        assert name == data["type"] and (name == "ping" or adapter.validate_python(data).type == name)
    return [data for name, data in events if name != "ping"]


def test_messages_equal_dsv4_generate(server, generate):
    """A system prompt and a user turn, in chat and in thinking mode: the text (and reasoning) equal generate's;
    the SDK sends its key as x-api-key."""
    client = claude(server)
    m = client.messages.create(model="dsv4-tiny", max_tokens=MAX_TOKENS, system="Be brief.",
                               messages=[{"role": "user", "content": PROMPTS[0]}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == generate(PROMPTS[0], system="Be brief.")[1]
    assert m.usage.output_tokens > 0 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    m = client.messages.create(model="dsv4-tiny", max_tokens=40, thinking={"type": "enabled", "budget_tokens": 1024},
                               messages=[{"role": "user", "content": [{"type": "text", "text": PROMPTS[5]}]}])
    reasoning, answer = generate(PROMPTS[5], thinking=True, max_tokens=40)
    assert [b.type for b in m.content] == ["thinking", "text"], m.content
    assert (m.content[0].thinking, m.content[1].text) == (reasoning, answer)


def test_messages_stream_as_anthropic_events(server):
    """messages.stream: message_start, ping, a thinking block then a text block, message_delta with the usage,
    message_stop; the deltas join into the non-streamed message."""
    client = claude(server)
    kw = {"model": "dsv4-tiny", "max_tokens": 40, "thinking": {"type": "adaptive"},
          "messages": [{"role": "user", "content": PROMPTS[5]}]}
    whole = client.messages.create(**kw)
    raw = list(client.messages.create(stream=True, **kw))        # (the SDK drops pings)
    blocks = anthropic_blocks(raw)
    assert blocks == [{"type": "thinking", "text": whole.content[0].thinking},
                      {"type": "text", "text": whole.content[1].text}]
    assert raw[-2].delta.stop_reason == whole.stop_reason and raw[-2].usage.output_tokens == whole.usage.output_tokens
    events = wire(server, "/v1/messages", kw)
    assert [name for name, _ in events[:3]] == ["message_start", "ping", "content_block_start"]
    valid(anthropic.types.RawMessageStreamEvent, events)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[1].text
    assert without_ids(final.model_dump()) == without_ids(whole.model_dump())


def test_messages_tool_round_trip(server):
    """A forced tool call (tool_choice tool): a tool_use whose input fits the tool, streamed as input_json deltas
    that join into it; then its tool_result: the answer equals chat completions' on the same conversation."""
    client = claude(server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"model": "dsv4-tiny", "max_tokens": 200, "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    m = client.messages.create(messages=ask, **kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMA)
    blocks = anthropic_blocks(list(client.messages.create(messages=ask, stream=True, **kw)))
    assert blocks == [{"type": "tool_use", "name": "get_weather", "text": blocks[0]["text"]}]
    assert json.loads(blocks[0]["text"]) == use.input
    with client.messages.stream(messages=ask, **kw) as stream:
        assert stream.get_final_message().content[0].input == use.input

    result = "sunny, 21 C"
    turn = client.messages.create(model="dsv4-tiny", max_tokens=MAX_TOKENS, tools=[WEATHER], messages=ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}])
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    chat = codex(server).chat.completions.create(model="dsv4-tiny", max_tokens=MAX_TOKENS, tools=[CHAT_TOOL], messages=[
        *ask, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": result}])
    assert turn.content[0].text == chat.choices[0].message.content
    assert turn.usage.input_tokens + turn.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_messages_fields_honoured_or_refused_in_anthropic_shape(server, generate):
    """stop_sequences end the reply (stop_reason stop_sequence, which one); top_k 1 samples greedily whatever
    the temperature; harmless fields pass; refused ones and bad values are 400s naming the field, a wrong key a
    401, all in Anthropic's error shape; count_tokens counts the prompt a request would run."""
    client = claude(server)
    ask = [{"role": "user", "content": PROMPTS[0]}]
    answer = generate(PROMPTS[0])[1]
    word = answer.split()[2]
    m = client.messages.create(model="dsv4-tiny", max_tokens=MAX_TOKENS, messages=ask, stop_sequences=[word])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", word, answer[:answer.index(word)])
    m = client.messages.create(model="dsv4-tiny", max_tokens=MAX_TOKENS, metadata={"user_id": "u1"},
                               service_tier="auto", extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9},
                               messages=[{"role": "user", "content": [
                                   {"type": "text", "text": PROMPTS[0], "cache_control": {"type": "ephemeral"}}]}])
    assert m.content[0].text == answer
    for extra, field in (({"container": "c1"}, "container"), ({"stop_sequences": ["a"] * 5}, "stop_sequences"),
                         ({"temperature": -1}, "temperature"), ({"tools": [{"type": "web_search_20250305",
                                                                            "name": "web_search"}]}, "tools[0].type")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="dsv4-tiny", max_tokens=4, messages=ask, extra_body=extra)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith(field + ":"), e.value.body
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="dsv4-tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["error"]["message"].startswith("messages[0].content[0]: image")
    prefill = ask + [{"role": "assistant", "content": "The capital"}]     # a last assistant turn is continued
    assert client.messages.create(model="dsv4-tiny", max_tokens=4, messages=prefill).content[0].text
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="dsv4-tiny", max_tokens=4, messages=prefill, thinking={"type": "adaptive"})
    assert e.value.body["error"]["message"].startswith("messages: a last assistant turn (a prefill)")
    r = server.post("/v1/messages", {"model": "dsv4-tiny", "messages": ask})            # max_tokens is required
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens:")
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(server, "sk-wrong").messages.create(model="dsv4-tiny", max_tokens=4, messages=ask)
    assert e.value.body["error"]["type"] == "authentication_error"
    count = client.messages.count_tokens(model="dsv4-tiny", messages=ask, tools=[WEATHER])
    chat = server.post("/tokenize", {"messages": ask, "tools": [CHAT_TOOL]}).json()
    assert count.input_tokens == chat["count"] > 0


def test_responses_equal_dsv4_generate(server, generate):
    """instructions and an input text, in chat and in thinking mode (reasoning effort): the output text (and the
    reasoning item) equal generate's; reasoning tokens counted apart."""
    client = codex(server)
    r = client.responses.create(model="dsv4-tiny", instructions="Be brief.", input=PROMPTS[1],
                                max_output_tokens=MAX_TOKENS)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text == generate(PROMPTS[1], system="Be brief.")[1]
    assert r.usage.output_tokens > 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    r = client.responses.create(model="dsv4-tiny", input=[{"role": "user", "content": PROMPTS[5]}],
                                max_output_tokens=40, reasoning={"effort": "high", "summary": "auto"})
    reasoning, answer = generate(PROMPTS[5], thinking=True, reasoning_effort="high", max_tokens=40)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == (reasoning, answer)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.reasoning.effort == "high"


def test_responses_stream_as_responses_events(server):
    """responses.stream: created, in_progress, the reasoning item, the message item (content part, text deltas),
    completed with the whole response, which equals the non-streamed one."""
    client = codex(server)
    kw = {"model": "dsv4-tiny", "input": PROMPTS[5], "max_output_tokens": 40, "reasoning": {"effort": "low"}}
    whole = client.responses.create(**kw)
    raw = list(client.responses.create(stream=True, **kw))
    assert [i["type"] for i in responses_items(raw)] == ["reasoning", "message"]
    assert responses_items(raw)[1]["text"] == whole.output_text
    with client.responses.stream(**kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == whole.output_text
    assert without_ids(final.model_dump()) == without_ids(whole.model_dump())
    valid(openai.types.responses.ResponseStreamEvent, wire(server, "/v1/responses", kw))
    cut = list(client.responses.create(stream=True, **kw | {"max_output_tokens": 3}))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_responses_function_call_round_trip_continues_from_the_cache(server):
    """A forced function call (its arguments fit the tool, streamed as deltas that join into them), then its
    output given with previous_response_id: the answer equals chat completions' on the whole conversation, and
    the prompt it continues came from the prefix cache (all but the last, partial 128-token block of it)."""
    client = codex(server)
    kw = {"model": "dsv4-tiny", "instructions": INSTRUCTIONS, "tools": [FUNCTION]}
    forced = kw | {"tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 200,
                   "input": "Weather in Paris?"}
    r = client.responses.create(**forced)
    assert [i.type for i in r.output] == ["function_call"] and r.output[0].name == "get_weather"
    call = r.output[0]
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    items = responses_items(list(client.responses.create(stream=True, **forced)))
    assert items == [{"type": "function_call", "text": call.arguments}]
    with client.responses.stream(**forced) as stream:
        assert [(i.name, i.arguments) for i in stream.get_final_response().output] == [(call.name, call.arguments)]

    result = "sunny, 21 C"
    turn = client.responses.create(previous_response_id=r.id, max_output_tokens=MAX_TOKENS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": result}], **kw)
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    chat = client.chat.completions.create(model="dsv4-tiny", max_tokens=MAX_TOKENS, tools=[CHAT_TOOL], messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert turn.output_text == chat.choices[0].message.content
    assert turn.usage.input_tokens == chat.usage.prompt_tokens
    assert turn.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens // 128 * 128 > 0


def test_previous_response_id(server):
    """A continued response equals the same conversation given whole (as input items), prefilling only what
    follows the cached prefix; GET returns a stored response; store false keeps nothing; an unknown id is a 400
    naming previous_response_id."""
    client = codex(server)
    kw = {"model": "dsv4-tiny", "instructions": INSTRUCTIONS, "max_output_tokens": MAX_TOKENS}
    first = client.responses.create(input=PROMPTS[0], **kw)
    second = client.responses.create(input=PROMPTS[4], previous_response_id=first.id, **kw)
    assert second.previous_response_id == first.id
    whole = client.responses.create(input=[{"role": "user", "content": PROMPTS[0]},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": PROMPTS[4]}], store=False, **kw)
    assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // 128 * 128 > 0
    assert second.usage.input_tokens - cached < second.usage.input_tokens - first.usage.input_tokens + 128
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    for missing in (whole.id, "resp_nothing"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(input="Hi", previous_response_id=missing, **kw)
        assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_responses_text_format_and_field_policy(server):
    """text.format json_schema (the SDK's responses.parse with a Pydantic model) is enforced; harmless fields
    pass, parallel_tool_calls is echoed; refused fields and hosted tools are 400s naming the field."""
    from typing import Annotated

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Annotated[str, Field(max_length=16)]
        population: Annotated[int, Field(ge=0, le=100000)]

    client = codex(server)
    r = client.responses.parse(model="dsv4-tiny", input=PROMPTS[0], text_format=City, max_output_tokens=200,
                               metadata={"k": "v"}, user="u1", parallel_tool_calls=False, prompt_cache_key="k")
    assert r.status == "completed" and isinstance(r.output_parsed, City) and r.metadata == {"k": "v"}
    assert r.parallel_tool_calls is False
    for extra, param in (({"background": True}, "background"), ({"conversation": "c1"}, "conversation"),
                         ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                         ({"include": ["message.output_text.logprobs"]}, "include"),
                         ({"max_output_tokens": 0}, "max_output_tokens"),
                         ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
                         ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "dsv4-tiny", "input": "Hi"} | extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_16_concurrent_streams_of_each_api(server, generate):
    """16 Anthropic and 16 Responses streams at once: every one completes, its events well-formed, its text
    (no markup) what generate answers."""
    results: dict[tuple[str, int], str] = {}

    def messages(i: int) -> None:
        events = list(claude(server).messages.create(model="dsv4-tiny", max_tokens=MAX_TOKENS, stream=True,
                                                     messages=[{"role": "user", "content": PROMPTS[i]}]))
        results["messages", i] = "".join(b["text"] for b in anthropic_blocks(events))

    def responses(i: int) -> None:
        events = list(codex(server).responses.create(model="dsv4-tiny", max_output_tokens=MAX_TOKENS, stream=True,
                                                     input=PROMPTS[i]))
        results["responses", i] = "".join(item["text"] for item in responses_items(events))

    threads = [threading.Thread(target=f, args=(i,)) for i in range(16) for f in (messages, responses)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    expected = {i: generate(p)[1] for i, p in enumerate(PROMPTS)}
    assert results == {(api, i): expected[i] for api in ("messages", "responses") for i in range(16)}


def test_a_client_that_leaves_a_stream_frees_its_slot(server):
    """Either API's stream closed mid-reply cancels its request: the slot is free at the next step."""
    long = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}
    streams = [lambda: claude(server).messages.create(model="dsv4-tiny", stream=True, **long, messages=[
                   {"role": "user", "content": "Tell me a story."}]),
               lambda: codex(server).responses.create(model="dsv4-tiny", stream=True, input="Tell me a story.",
                                                      max_output_tokens=4000, extra_body={"ignore_eos": True})]
    for start in streams:
        stream = start()
        events = iter(stream)
        for _ in range(4):
            next(events)
        assert server.health()["running"] == 1
        stream.close()
        deadline = time.monotonic() + 20
        while server.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.health()["running"] == 0


def test_a_failed_request_is_an_error_in_each_api_shape(model, tok):
    """The server's routes on an engine whose every step fails: a stream ends with Anthropic's error event or
    Responses' response.failed, a reply is a 500 in the API's error shape."""
    from starlette.testclient import TestClient

    from dsv4cli.engine import Engine, EngineOptions
    from dsv4cli.serve.app import create_app
    from dsv4cli.serve.loop import EngineLoop
    from dsv4cli.serve.metrics import ServerMetrics
    from dsv4cli.serve.server import ApiServer, ServerOptions

    broken = copy.deepcopy(model)
    broken.embed.weight.data = broken.embed.weight.data[:0]       # every lookup of a token fails
    engine, metrics = Engine(broken, tok, EngineOptions(max_batch=2, max_seq_len=128, drafts=0)), ServerMetrics()
    loop = EngineLoop(engine, 4, metrics, on_fatal=lambda: None)
    loop.start()
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    try:
        parser = BodyParser(tok, SamplingParams(temperature=0), 128)
        with TestClient(create_app(ApiServer(loop, parser, ServerOptions("tiny")))) as client:
            events = sse(client.post("/v1/messages", json=ask | {"stream": True}).text)
            assert [name for name, _ in events] == ["message_start", "ping", "error"]
            assert events[-1][1]["error"]["type"] == "api_error"
            assert events[-1][1]["error"]["message"].startswith("engine step failed:")
            events = sse(client.post("/v1/responses", json={"input": "Hi", "stream": True}).text)
            assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.failed"]
            assert events[-1][1]["response"]["status"] == "failed" and events[-1][1]["response"]["error"]["message"]
            r = client.post("/v1/messages", json=ask)
            assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
            r = client.post("/v1/responses", json={"input": "Hi"})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    finally:
        loop.stop()


def test_tool_calls_stream_without_markup():
    """What the model writes when it says something and then calls a tool, fed to both translators in pieces
    as the engine would: Anthropic's text block then tool_use block, Responses' message item then function_call
    item; the arguments deltas join into the call's, and no markup shows anywhere."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    text = (f'I will look.{TOOL_CALLS_OPENING}\n<{DSML}invoke name="get_weather">\n'
            f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n</{DSML}invoke>\n{TOOL_CALLS_END}')
    parser = BodyParser(tok, SamplingParams(), 4096)
    req = messages_api.parse(parser, {"max_tokens": 50, "stream": True, "tools": [WEATHER],
                                      "messages": [{"role": "user", "content": "Weather?"}]})
    seq = Sequence("x", req.prompt_ids, req.params, 0, output_ids=[1, 2], text=text, finish_reason="stop")
    events = messages_api.MessageEvents(req, tok, "tiny", "7")
    out = events.first()
    for i in range(0, len(text), 3):
        out += events.update(text[i:i + 3], [])
    out += events.finish(seq)
    parsed = valid(anthropic.types.RawMessageStreamEvent, out)
    starts = [e["content_block"] for e in parsed if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
    deltas = [e["delta"] for e in parsed if e["type"] == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == "I will look."
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"city": "Paris"}
    assert parsed[-2]["delta"]["stop_reason"] == "tool_use"
    assert messages_api.message(req, seq, "tiny", tok, "7")["content"][1]["input"] == {"city": "Paris"}

    turn = responses_api.parse(parser, responses_api.ResponseStore(1 << 20), {"input": "Weather?", "stream": True,
                                                                       "tools": [FUNCTION]})
    events = responses_api.ResponseEvents(turn, tok, "tiny", "7")
    out = events.first()
    for i in range(0, len(text), 3):
        out += events.update(text[i:i + 3], [])
    out += events.finish(seq)
    parsed = valid(openai.types.responses.ResponseStreamEvent, out)
    added = [e["item"]["type"] for e in parsed if e["type"] == "response.output_item.added"]
    assert added == ["message", "function_call"]
    assert "".join(e["delta"] for e in parsed if e["type"] == "response.output_text.delta") == "I will look."
    arguments = "".join(e["delta"] for e in parsed if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"}
    assert parsed[-1]["type"] == "response.completed"
    assert [i["type"] for i in parsed[-1]["response"]["output"]] == ["message", "function_call"]


def test_the_response_store_is_bounded():
    """At most `size` responses and `limit` bytes of them: the least recently used go first."""
    store = responses_api.ResponseStore(limit=10_000, size=2)
    for rid in ("a", "b"):
        store.put(rid, {"id": rid}, [{"role": "user", "content": "Hi"}])
    store.get("a")
    store.put("c", {"id": "c"}, [])
    assert (store.get("a") is not None, store.get("b"), store.get("c") is not None) == (True, None, True)
    store.put("d", {"id": "d"}, [{"role": "user", "content": "x" * 10_000}])    # over the limit by itself
    assert [store.get(rid) for rid in "acd"] == [None, None, None] and store.bytes == 0


def test_stored_responses_stay_within_their_bytes(tmp_path):
    """2,000 stored Responses with the largest metadata OpenAI allows (16 pairs, 64-character keys, 512-character
    values): the store keeps within --stored-responses-bytes (its metrics say so) and the server's memory grows
    by no more than that and the allocator's slack; larger metadata is a 400 on Responses and chat completions."""
    import concurrent.futures

    bound = 1 << 20
    server = Server(tmp_path, "--temperature", "0", "--max-batch", "8", "--stored-responses-bytes", str(bound))
    try:
        metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
        body = {"model": "x", "input": "Hi", "max_output_tokens": 1, "metadata": metadata}

        def rss() -> int:
            status = Path(f"/proc/{server.proc.pid}/status").read_text()
            return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) << 10

        def send(n: int) -> None:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(lambda _: server.post("/v1/responses", body).status_code, range(n)))
            assert codes == [200] * n

        send(200)                       # the store full, the allocator's pools warm
        before = rss()
        send(1800)
        grown = rss() - before
        stored = dict(re.findall(r"^dsv4:(responses_stored(?:_bytes)?) (\d+)$", server.get("/metrics"), re.M))
        print(f"2,000 stored Responses: {stored}, RSS grew {grown / 2**20:.1f} MiB over the last 1,800")
        assert 0 < int(stored["responses_stored_bytes"]) <= bound and int(stored["responses_stored"]) < 2000
        assert grown <= bound + (8 << 20), grown
        chat = {"model": "x", "messages": ASK, "max_tokens": 1}
        for path, sent in (("/v1/responses", body), ("/v1/chat/completions", chat)):
            r = server.post(path, {**sent, "metadata": {"k": "v" * 513}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
    finally:
        server.stop()


ASK = [{"role": "user", "content": "Hi"}]
# bodies each API refuses, and the field the error names (as the API names it, not as the chat body does)
BAD_MESSAGES = [
    ({"system": [{"type": "tool_use", "id": "x", "name": "n", "input": {}}]}, "system[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]},
     "messages[0].content[0].foo"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "x": 1}}, "thinking.x"),
    ({"tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}, "tools": [WEATHER]},
     "tool_choice.disable_parallel_tool_use"),
    ({"tools": [WEATHER | {"strict": True}]}, "tools[0].strict"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"not": {"type": "string"}}}}},
     "output_config.format"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"logprobs": True}, "logprobs"),
]
BAD_RESPONSES = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": []}, "input"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high", "x": 1}}, "reasoning.x"),
    ({"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),          # OpenAI's limits: keys <= 64, values <= 512, 16 pairs
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
]


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_bad_bodies_name_the_field_as_the_api_does(api):
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    parser = BodyParser(tok, SamplingParams(), 4096)
    cases = BAD_MESSAGES if api == "messages" else BAD_RESPONSES
    for extra, field in cases:
        with pytest.raises(BadRequest) as e:
            if api == "messages":
                messages_api.parse(parser, {"max_tokens": 8, "messages": ASK} | extra)
            else:
                responses_api.parse(parser, responses_api.ResponseStore(1 << 20), {"input": "Hi"} | extra)
        assert e.value.message.startswith(field + ":"), (extra, e.value.message)
