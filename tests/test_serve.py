"""`dsv4 serve` end to end: real server processes on the bundled model, the real `openai` client, real
sockets. Each server starts once per module and is killed at the end, also when a test fails."""
import contextlib
import copy
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import httpx2 as httpx  # the openai client's HTTP library, for requests it does not make
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from dsv4cli.cli import main
from dsv4cli.config import BUNDLED_MODEL_DIR, resolve
from dsv4cli.encoding import DSML, TOOL_CALLS_END, TOOL_CALLS_OPENING
from dsv4cli.engine import SamplingParams, Sequence
from dsv4cli.generate import prompt_ids
from dsv4cli.loading import load_engine, sampling_params
from dsv4cli.openai.requests import BadRequest, BodyParser
from dsv4cli.openai.responses import ChunkStream
from dsv4cli.tokenizer import Tokenizer

KEY = "sk-test-0123456789"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
# the bundled model's kinds of questions (README), 16 of them for 16 concurrent streams
PROMPTS = [f"What is the capital of {c}?" for c in ("France", "Spain", "Italy", "Japan")] + \
          [f"What is {a} plus {b}?" for a, b in ((3, 4), (7, 12), (9, 9), (5, 11))] + \
          [f"What colour is {x}?" for x in ("the sky", "grass", "snow", "a banana")] + \
          ["What is the opposite of hot?", "What sound does a cat make?", "Hello!", "Tell me a story."]
MAX_TOKENS = 12


class Server:
    """`dsv4 serve --port 0 ARGS` in a subprocess (the env, hence 1 thread and no compile, inherited);
    its first stdout line gives the URL. stderr (the access log) goes to a file the tests read."""

    def __init__(self, tmp_path, *args: str, env: dict | None = None, open_files: int | None = None):
        """`open_files`: the server's open-file limit, soft and hard."""
        self.log = tmp_path / "server.log"
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))) if open_files else None
        with open(self.log, "w") as log:      # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "dsv4cli", "serve", "--port", "0", *args],
                                         stdout=subprocess.PIPE, stderr=log, text=True,
                                         env={**os.environ, **(env or {})}, preexec_fn=limit)
        line = self.proc.stdout.readline()
        match = re.search(r"(http://\S+)/v1", line)
        if match is None:
            self.stop()
            raise AssertionError(f"no URL from dsv4 serve: {line!r}\n{self.log.read_text()}")
        self.url = match[1]
        self.banner = line
        self.address = self.url.removeprefix("http://").rsplit(":", 1)
        self.address = (self.address[0], int(self.address[1]))

    def post(self, path: str, body: bytes | dict, key: str | None = KEY, **headers) -> httpx.Response:
        """A POST of a raw or JSON body (JSON content type unless given), with the key."""
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}),
                   **{k.replace("_", "-"): v for k, v in headers.items()}}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60)

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=60)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def health(self) -> dict:
        return json.loads(self.get("/health"))

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Greedy, 16 slots, the key from the environment variable."""
    s = Server(tmp_path_factory.mktemp("serve"), "--temperature", "0", "--max-batch", "16",
               env={"DSV4_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_queue(tmp_path_factory):
    """One slot and one waiting place: a third request is refused."""
    s = Server(tmp_path_factory.mktemp("serve1"), "--max-batch", "1", "--max-waiting", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    """No key; a served name, a CORS origin, another Host name, small limits and a short read timeout."""
    s = Server(tmp_path_factory.mktemp("serve2"), "--served-model-name", "tiny-chat", "--cors-origin",
               "http://app.example", "--allowed-host", "myhost.lan", "--allowed-host", "127.0.0.1",
               "--max-messages", "3", "--read-timeout", "2", "--max-connections", "64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    """What `dsv4 generate --temperature 0 -n 12` answers (its own prompt building and engine), each prompt
    run alone."""
    settings, _ = resolve(flags={"temperature": 0.0, "max_tokens": MAX_TOKENS, "max_batch": 1}, env={})
    engine = load_engine(settings, "generate")

    def answer(prompt: str, tools: list | None = None) -> str:
        seq = engine.submit(prompt_ids(engine, settings, prompt, tools or []), sampling_params(settings))
        while engine.has_work():
            engine.step()
        return seq.text

    return answer


def ask(client: openai.OpenAI, prompt: str, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="dsv4-tiny", messages=[{"role": "user", "content": prompt}], **kw)


def test_chat_equals_dsv4_generate(server, reference):
    r = ask(server.client(), PROMPTS[0])
    assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content == reference(PROMPTS[0])
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the CLI itself, once: the in-process reference is what it prints
    out = subprocess.run([sys.executable, "-m", "dsv4cli", "generate", "-p", PROMPTS[0], "--temperature", "0",
                          "-n", str(MAX_TOKENS), "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout)["text"] == r.choices[0].message.content


def test_stream_with_usage_and_reasoning(server, reference):
    chunks = list(ask(server.client(), PROMPTS[1], stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(PROMPTS[1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # thinking: the reasoning streams apart from the answer, as the non-streamed message has it (and past
    # an ignored EOS, the message ends there in both)
    kw = {"extra_body": {"thinking": True, "ignore_eos": True}, "max_tokens": 40}
    whole = ask(server.client(), PROMPTS[5], **kw).choices[0].message
    parts = list(ask(server.client(), PROMPTS[5], stream=True, **kw))
    deltas = [c.choices[0].delta for c in parts]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.content
    assert "think>" not in whole.content + whole.reasoning_content


def test_completions_plain_and_streamed(server):
    client = server.client()
    r = client.completions.create(model="dsv4-tiny", prompt="Once upon a time", max_tokens=10, logprobs=2)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 10
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    streamed = client.completions.create(model="dsv4-tiny", prompt="Once upon a time", max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_models_health_and_unknown_route(server):
    assert [m.id for m in server.client().models.list()] == ["dsv4-tiny"]
    assert server.health()["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as e:
        server.get("/v1/nothing")
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["code"] == "not_found"


def test_tools_are_offered_like_dsv4_generate_tools(server, reference):
    """The tiny model answers without calling; its answer with the tools in the prompt equals generate
    --tools, and a tool result turn is accepted."""
    client = server.client()
    r = ask(client, PROMPTS[2], tools=[WEATHER])
    assert r.choices[0].message.content == reference(PROMPTS[2], [WEATHER])
    call = {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    r = client.chat.completions.create(model="dsv4-tiny", max_tokens=4, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "sunny, 21 C"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_calls_stream_as_openai_chunks(server):
    """What the model writes when it calls a tool, fed to the stream in pieces as the engine would: the
    client sees the text before the calls, then the call, never the DSML markup."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "stream": True}
    req = BodyParser(tok, SamplingParams(), 4096).parse(body, chat=True, server=True)
    text = (f'I will look.{TOOL_CALLS_OPENING}\n<{DSML}invoke name="get_weather">\n'
            f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n</{DSML}invoke>\n{TOOL_CALLS_END}')
    stream = ChunkStream(req, tok, "tiny", "7")
    chunks = stream.first()
    for i in range(0, len(text), 3):
        chunks += stream.update(text[i:i + 3], [])
    chunks += stream.finish(Sequence("x", [0], req.params, 0, output_ids=[1, 2], text=text, finish_reason="stop"))
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert "".join(c.choices[0].delta.content or "" for c in parsed) == "I will look."
    first, *more = [t for c in parsed for t in c.choices[0].delta.tool_calls or []]      # the call as it is written
    assert first.id == "call_7_0" and first.function.name == "get_weather" and more
    assert json.loads("".join(t.function.arguments for t in [first, *more])) == {"city": "Paris"}
    assert parsed[-1].choices[0].finish_reason == "tool_calls"


def test_structured_output_through_the_openai_sdk(server):
    """The SDK's `parse(response_format=PydanticModel)` (current and beta spellings): the reply parsed into the
    model; completions take a response format too; a forced tool call streamed through the SDK: the id and name
    once, the arguments in deltas that join into arguments valid for the tool, no markup anywhere; a schema that
    cannot constrain is a 400 naming response_format."""
    from typing import Annotated, Literal

    import jsonschema
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Annotated[str, Field(max_length=16)]
        population: Annotated[int, Field(ge=0, le=100000)]
        tags: Annotated[list[Literal["big", "old", "sunny"]], Field(max_length=3)]

    client = server.client()
    messages = [{"role": "user", "content": PROMPTS[0]}]
    for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
        r = parse(model="dsv4-tiny", messages=messages, response_format=City, max_tokens=200)
        assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, City)
    schema = City.model_json_schema() | {"additionalProperties": False}    # (else it may add keys of its own)
    r = client.completions.create(model="dsv4-tiny", prompt="A city:", max_tokens=200, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}}}}}
    chunks = list(client.chat.completions.create(
        model="dsv4-tiny", messages=messages, tools=[tool, WEATHER], max_tokens=200, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    arguments = "".join(d.function.arguments for d in deltas)
    assert "DSML" not in arguments and "｜" not in arguments
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="dsv4-tiny", messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"not": {"type": "string"}}}}}})
    assert e.value.body["param"] == "response_format" and "Unimplemented keys" in e.value.body["message"]
    endless = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}   # no finite value
    for extra, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": endless}}},
                          "response_format"),
                         ({"tools": [{"type": "function", "function": {"name": "f", "parameters": endless}}],
                           "tool_choice": "required"}, "tools")):
        r = server.post("/v1/chat/completions", {"model": "x", "messages": messages, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and "finite" in r.text, r.text


def test_16_concurrent_streams_equal_dsv4_generate(server, reference):
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        chunks = ask(server.client(), PROMPTS[i], stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: reference(p) for i, p in enumerate(PROMPTS)}


def test_a_client_that_disconnects_frees_its_slot(server):
    client = server.client()
    stream = ask(client, "Tell me a story.", stream=True, max_tokens=4000, extra_body={"ignore_eos": True})
    next(iter(stream))
    next(iter(stream))
    assert server.health()["running"] == 1
    stream.close()                                  # the client goes away mid-reply
    deadline = time.monotonic() + 20
    while server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["running"] == 0
    assert re.search(r'^dsv4:requests_total\{finish_reason="cancelled"\} [1-9]', server.get("/metrics"), re.M)
    assert ask(client, PROMPTS[3]).choices[0].message.content


def test_metrics_are_prometheus_text(server):
    ask(server.client(), PROMPTS[4])
    text = server.get("/metrics")
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["dsv4:generation_tokens_total"] > 0 and values["dsv4:prompt_tokens_total"] > 0
    assert values["dsv4:time_to_first_token_seconds_count"] >= 1
    assert values["dsv4:spec_decode_num_draft_tokens_total"] >= values["dsv4:spec_decode_num_accepted_tokens_total"] > 0
    # the bundled model drafts with DSpark, auto: a counter for every block position, the mean length
    assert values['dsv4:spec_decode_info{drafter="dspark",drafts="auto",verify="block"}'] == 1
    for kind in ("accepted", "verified"):
        assert [f'dsv4:spec_decode_num_{kind}_tokens_per_pos_total{{position="{i}"}}' in values
                for i in range(6)] == [True] * 5 + [False]
    accepted, drafts = values["dsv4:spec_decode_num_accepted_tokens_total"], values["dsv4:spec_decode_num_drafts_total"]
    assert values["dsv4:spec_decode_mean_acceptance_length"] == 1 + accepted / drafts
    assert "# TYPE dsv4:time_per_output_token_seconds histogram" in text


def test_wrong_or_missing_key_is_401_and_the_key_is_not_logged(server):
    with pytest.raises(openai.AuthenticationError) as e:
        ask(server.client("sk-wrong"), "Hi")
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    no_header = urllib.request.Request(server.url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(no_header, timeout=10)
    assert e.value.code == 401
    log = server.log.read_text()
    assert "POST /v1/chat/completions 401" in log
    assert KEY not in log and "capital of" not in log        # neither the key nor prompts


def test_bad_field_is_400_naming_it(server):
    client = server.client()
    for extra, field in (({"temprature": 0.5}, "temprature"), ({"temperature": -1}, "temperature"),
                         ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, "Hi", extra_body=extra)
        error = e.value.body
        assert e.value.status_code == 400 and error["param"] == field and error["message"].startswith(field + ":")
    with pytest.raises(openai.BadRequestError) as e:        # a typo gets the closest field named
        ask(client, "Hi", extra_body={"temprature": 0.5})
    assert e.value.body["message"] == "temprature: not a supported request field; did you mean temperature?"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "Hi", max_tokens=4, extra_body={"min_tokens": 9})
    assert e.value.body["message"] == "min_tokens: at most max_tokens (4), got 9"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dsv4-tiny", prompt="Hi", stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def test_values_the_device_cannot_hold_fail_only_their_request(server, reference):
    """Numbers that once passed the parser and then failed the engine step, poisoning the server for everyone:
    each is a 400 naming its field, and after each one a normal request still answers correctly."""
    client = server.client()
    for field, value in (("temperature", 1e300), ("repetition_penalty", 1e308), ("repetition_penalty", 1e-300),
                         ("top_k", 99999999999999999999), ("seed", 1 << 63),
                         ("frequency_penalty", 1e300), ("max_tokens", 1 << 64)):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                ask(client, "Hi", stream=stream, extra_body={field: value})
            assert e.value.body["param"] == field, (field, value)
        assert ask(client, "What is the capital of France?").choices[0].message.content == \
            reference("What is the capital of France?")
    assert server.health()["status"] == "ok"


def test_a_full_queue_is_429(tiny_queue):
    """One request runs, one waits, the third is refused; closing them frees the server."""
    client = tiny_queue.client()
    long = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}
    running = ask(client, "Tell me a story.", stream=True, **long)
    waiting = ask(client, "Tell me a story.", stream=True, **long)
    with pytest.raises(openai.RateLimitError) as e:
        ask(client, "Hi")
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    assert e.value.response.headers["retry-after"] == "1"          # when to try again, as clients read it
    running.close()
    waiting.close()
    deadline = time.monotonic() + 20
    while tiny_queue.health() != {"status": "ok", "running": 0, "waiting": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ask(client, "Hi").choices[0].message.content is not None


def test_the_key_is_redacted_in_config_show(monkeypatch, capsys):
    monkeypatch.setenv("DSV4_API_KEY", KEY)
    assert main(["config", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["api_key"]
    assert shown == {"value": "<redacted>", "source": "env DSV4_API_KEY"}
    assert main(["config", "show"]) == 0
    assert KEY not in capsys.readouterr().out


def test_a_taken_port_is_one_error_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "dsv4cli", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there")
    assert len(r.stderr.splitlines()) == 1


def test_an_engine_that_cannot_go_on_stops_the_server(model, tok):
    """The server's own engine thread and routes on an engine whose every step fails: each request gets a 500
    naming the failure while /health says ok between them (the engine went on); the third failure in a row
    makes the engine give up, the server is told to stop (so a supervisor restarts it) and /health says 503."""
    from starlette.testclient import TestClient

    from dsv4cli.engine import Engine, EngineOptions
    from dsv4cli.serve.app import create_app
    from dsv4cli.serve.loop import EngineLoop
    from dsv4cli.serve.metrics import ServerMetrics
    from dsv4cli.serve.server import ApiServer, ServerOptions

    broken = copy.deepcopy(model)
    broken.embed.weight.data = broken.embed.weight.data[:0]       # every lookup of a token fails
    engine, metrics, stopped = Engine(broken, tok,
                                      EngineOptions(max_batch=2, max_seq_len=128, drafts=0)), ServerMetrics(), \
        threading.Event()
    loop = EngineLoop(engine, 4, metrics, on_fatal=stopped.set)
    parser = BodyParser(tok, SamplingParams(temperature=0, max_tokens=4), 128)
    loop.start()
    try:
        with TestClient(create_app(ApiServer(loop, parser, ServerOptions("tiny")))) as client:
            for _ in range(2):
                r = client.post("/v1/completions", json={"prompt": "Hi"})
                assert r.status_code == 500 and r.json()["error"]["message"].startswith("engine step failed:")
                assert client.get("/health").json()["status"] == "ok" and not stopped.is_set()
            r = client.post("/v1/completions", json={"prompt": "Hi"})
            assert r.status_code == 500 and "3 engine steps in a row failed" in r.json()["error"]["message"]
            assert stopped.wait(10)
            assert client.get("/health").status_code == 503
    finally:
        loop.stop()


def user(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


# bodies that once gave a bare 500 and a traceback (issue 35), as raw JSON text: (body, the param named)
BAD_BODIES = [
    (json.dumps(user("Hi") | {"logit_bias": {"\u00b2": 5}}), "logit_bias"),           # "²".isdigit(), int() fails
    (json.dumps({"messages": [{"role": "user", "content": "Hi", "tools": 5}]}), "messages"),
    ('{"messages": [{"role": "user", "content": "Hi \\ud800"}]}', "messages[0].content"),   # a lone surrogate
    ("[" * 100_000 + "]" * 100_000, None),                                                   # 100k deep
    (json.dumps(user("Hi") | {"stop": [""]}), "stop"),             # would end every reply after one token
]


def test_bad_inputs_are_400_naming_the_field_and_fail_only_themselves(server, reference):
    for body, param in BAD_BODIES:
        for stream in (False, True):
            raw = body if not stream or body.startswith("[") else body[:-1] + ', "stream": true}'
            r = server.post("/v1/chat/completions", raw.encode())
            assert r.status_code == 400, (body[:80], r.text)
            e = r.json()["error"]
            assert e["param"] == param and e["type"] == "invalid_request_error" and e["message"], e
    assert "Traceback" not in server.log.read_text()
    assert ask(server.client(), PROMPTS[0]).choices[0].message.content == reference(PROMPTS[0])
    with pytest.raises(openai.BadRequestError) as e:            # a stop string given alone, too
        ask(server.client(), "Hi", stop="")
    assert e.value.body["param"] == "stop"


def test_batch_writes_those_inputs_as_error_records(tmp_path):
    """`dsv4 batch` parses lines with the same parser: each bad line is an error record, the run goes on."""
    lines = [json.dumps({"custom_id": f"bad-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": json.loads(body)}) if not body.startswith("[") else body
             for i, (body, _) in enumerate(BAD_BODIES) if "ud800" not in body]
    lines.append('{"custom_id": "surrogate", "method": "POST", "url": "/v1/chat/completions", "body": '
                 '{"messages": [{"role": "user", "content": "\\ud800"}]}}')
    lines.append('{"custom_id": "\\ud800", "messages": [{"role": "user", "content": "Hi"}]}')
    lines.append(json.dumps({"custom_id": "ok", **user("Hi")}))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "dsv4cli", "batch", str(src), "-o", str(out), "--temperature", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(lines)
    assert [rec["custom_id"] for rec in records if rec["response"]] == ["ok"]
    errors = {rec["error"]["line"]: rec["error"]["code"] for rec in records if rec["error"]}
    assert errors == {1: "invalid_parameter", 2: "invalid_messages", 3: "invalid_json", 4: "invalid_parameter",
                      5: "invalid_json", 6: "invalid_json"}


def test_the_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(server.url + "/v1/models", headers={"authorization": f"{scheme} {KEY}"}, timeout=10)
        assert r.status_code == 200, scheme
    assert httpx.get(server.url + "/v1/models", headers={"authorization": f"Basic {KEY}"}).status_code == 401


def test_messages_with_fields_of_the_wrong_type_are_bad_requests():
    """Each of these once raised a TypeError in the prompt's rendering (found by giving every message field
    every JSON type): the parser's BadRequest now, a 400 or an error record."""
    parser = BodyParser(Tokenizer.from_dir(BUNDLED_MODEL_DIR), SamplingParams(), 4096)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    hi = {"role": "user", "content": "Hi"}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "r"}
    for messages in ([hi | {"tools": 5}], [hi | {"task": []}], [hi, {"role": "assistant", "tool_calls": 5}],
                     [hi, {"role": "assistant", "tool_calls": [call | {"id": [1]}]}],
                     [hi, {"role": "assistant", "tool_calls": [call]}, tool | {"tool_call_id": []}]):
        with pytest.raises(BadRequest) as e:
            parser.parse({"messages": messages}, chat=True)
        assert e.value.code == "invalid_messages" and e.value.message.startswith("messages: message "), messages


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    """50 MB: refused by its Content-Length (the client still reads the answer), or, sent in chunks, once
    8 MiB have come; a client that sends only the head gets the 413 at once. /health answers meanwhile."""
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (50 << 20) + b'"}]}'
    t0 = time.perf_counter()
    r = server.post("/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert time.perf_counter() - t0 < 10            # generous: about 0.2 s here, and 165 s once
    chunks = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    r = httpx.post(server.url + "/v1/completions", content=chunks, timeout=60,
                   headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    assert r.status_code == 413
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Length: {len(big)}\r\n\r\n".encode())
        assert sock.recv(100).startswith(b"HTTP/1.1 413 ")
        assert server.health()["status"] == "ok"


def test_many_messages_or_a_long_prompt_are_refused_before_tokenising(server, configured):
    r = configured.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}] * 4}, key=None)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
    assert r.json()["error"]["param"] == "messages"
    # 4 MB: too long by its length alone, so no tokens are counted ("at least"); once this took seconds
    r = server.post("/v1/completions", {"prompt": "What is the capital of France? " * 130_000})
    e = r.json()["error"]
    assert r.status_code == 400 and e["code"] == "prompt_too_long" and "at least" in e["message"], e
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_post_bodies_must_be_json(server):
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        r = server.post("/v1/completions", b'{"prompt": "Hi"}', **headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", headers
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "Hi"}',
                   headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 415
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                       content_type="application/json; charset=utf-8").status_code == 200


def test_only_loopback_hosts_are_answered_on_loopback(server, configured):
    """A page of another site that rebinds its name to 127.0.0.1 sends its own Host: refused."""
    port = server.address[1]
    for host, status in ((f"evil.example:{port}", 403), ("evil.example", 403), (f"localhost:{port}", 200),
                         (f"127.0.0.1:{port}", 200), (f"[::1]:{port}", 200), ("LOCALHOST", 200)):
        r = httpx.get(server.url + "/health", headers={"host": host})
        assert r.status_code == status, host
        if status == 403:
            assert r.json()["error"]["code"] == "host_not_allowed"
    port = configured.address[1]
    for host, status in ((f"myhost.lan:{port}", 200), (f"localhost:{port}", 403)):
        assert httpx.get(configured.url + "/health", headers={"host": host}).status_code == status, host


def test_cors_is_off_unless_an_origin_is_allowed(server, configured):
    preflight = {"origin": "http://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type, authorization"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/health", headers={"origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(configured.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(configured.url + "/v1/chat/completions", headers=preflight | {"origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = configured.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=None, origin="http://app.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"


def test_n_choices_have_derived_seeds(server):
    client = server.client()
    kw = {"model": "x", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 1.5, "seed": 7}
    r = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts[0] == client.completions.create(**kw).choices[0].text      # the first has the request's seed
    assert r.usage.completion_tokens == 3 * 20 and r.usage.prompt_tokens == 5
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [60] and not chunks[-1].choices
    chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Tell me a story."}], n=2,
                                          max_tokens=8)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)


def test_best_of_returns_the_most_likely_candidates(server):
    client = server.client()
    kw = {"model": "x", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.5, "seed": 3}
    every = client.completions.create(n=4, best_of=4, logprobs=0, **kw).choices
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 40     # every candidate ran
    for extra, param in (({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
                         ({"n": 200}, "n")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x", prompt="Hi", **extra)
        assert e.value.body["param"] == param, extra
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "Hi", extra_body={"best_of": 2})
    assert e.value.body["param"] == "best_of"


def test_a_completion_prompt_of_token_ids_is_used_as_it_is(server):
    """OpenAI's other prompt form: token ids, no BOS added (the text form adds it); ids that are no token ids
    are a 400 naming the prompt (or, in a list of prompts, which one)."""
    client = server.client()
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    text = client.completions.create(model="x", prompt="Once upon a time", max_tokens=12, temperature=0)
    ids = client.completions.create(model="x", prompt=[tok.bos_id, *tok.encode("Once upon a time")], max_tokens=12,
                                    temperature=0, echo=True)
    assert ids.choices[0].text == tok.decode([tok.bos_id, *tok.encode("Once upon a time")]) + text.choices[0].text
    assert ids.usage.prompt_tokens == text.usage.prompt_tokens
    for bad, param in (([tok.bos_id, tok.vocab_size], "prompt"), ([], "prompt"), ([True], "prompt"),
                       ([["Once"], 3], "prompt"), ([[1, tok.vocab_size]], "prompt[0]"), (["Once", []], "prompt[1]")):
        r = server.post("/v1/completions", {"model": "x", "prompt": bad, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_echo_repeats_the_prompt(server):
    client = server.client()
    r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=5, echo=True, temperature=0)
    plain = client.completions.create(model="x", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.choices[0].text == "Once upon a time" + plain.choices[0].text
    chunks = list(client.completions.create(model="x", prompt="Once upon a time", max_tokens=5, echo=True,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text == "Once upon a time" and "".join(c.choices[0].text for c in chunks) == \
        r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "Hi", extra_body={"echo": True})
    assert e.value.body["param"] == "echo"


def test_models_by_id_tokenize_and_detokenize(server):
    client = server.client()
    assert client.models.retrieve("dsv4-tiny").id == "dsv4-tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    r = server.post("/tokenize", {"prompt": "Once upon a time", "return_token_strs": True}).json()
    assert r["tokens"] == [tok.bos_id, *tok.encode("Once upon a time")] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 4096 and "".join(r["token_strs"]) == tok.decode(r["tokens"])
    assert server.post("/tokenize", {"prompt": "Hi", "add_special_tokens": False}).json()["tokens"] == tok.encode("Hi")
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": PROMPTS[0]}]}).json()
    assert chat["count"] == ask(client, PROMPTS[0], max_tokens=1).usage.prompt_tokens and chat["token_strs"] is None
    assert server.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    for path, body, param in (("/detokenize", {"tokens": [10**9]}, "tokens[0]"), ("/tokenize", {"text": "x"}, None),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, "add_special_tokens")):
        r = server.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body)
    assert server.post("/tokenize", {"prompt": "x"}, key=None).status_code == 401


def test_the_served_model_name(configured):
    assert "dsv4 serve: tiny-chat on" in configured.banner
    client = configured.client(None)
    assert [m.id for m in client.models.list()] == ["tiny-chat"]
    assert ask(client, "Hi").model == "tiny-chat"


def test_a_hub_model_is_named_by_its_id(tmp_path, tiny_model_dir):
    """A model id found in the Hugging Face cache: named by the id, not by its snapshot's hash."""
    import shutil

    snapshot = tmp_path / "hf" / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (tmp_path / "hf" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hf" / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    s = Server(tmp_path, "--model", "acme/tiny", env={"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    try:
        assert "dsv4 serve: acme/tiny on" in s.banner
        assert [m.id for m in s.client().models.list()] == ["acme/tiny"]
    finally:
        s.stop()


def closed(sock: socket.socket) -> bool:
    """Whether the server closed this connection (the read sees the end, or a reset)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_and_slow_connections_are_closed(configured):
    """--read-timeout 2: connections that send nothing, or a request head a byte at a time, are closed; a
    client's connections beyond --max-connections 64 close the oldest idle ones, not its requests."""
    idle = [socket.create_connection(configured.address) for _ in range(20)]
    slow = [socket.create_connection(configured.address) for _ in range(20)]
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    t0 = time.monotonic()
    for i in range(6):                                     # a byte a half second: over 3 s
        for sock in slow:
            with contextlib.suppress(OSError):
                sock.send(head[i:i + 1])
        time.sleep(0.5)
    for sock in idle + slow:
        sock.setblocking(False)
    assert all(closed(sock) for sock in idle + slow) and time.monotonic() - t0 < 10
    crowd = [socket.create_connection(configured.address) for _ in range(100)]
    assert httpx.get(configured.url + "/health").status_code == 200
    time.sleep(0.2)
    for sock in crowd:
        sock.setblocking(False)
    assert sum(closed(sock) for sock in crowd) >= 100 - 64
    for sock in idle + slow + crowd:
        sock.close()


def test_2000_idle_connections_leave_the_server_reachable(tmp_path):
    """A server allowed only 1024 open files, and 2000 connections that never send a request: /health still
    answers, and the log does not fill with failed accepts (it once grew by 4 MB a second)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2200:
        pytest.skip(f"this test opens 2000 connections; the open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    s = Server(tmp_path, open_files=1024)
    socks = []
    try:
        for i in range(2000):
            socks.append(socket.create_connection(s.address))
            if i % 2:
                socks[-1].send(b"GET /health HTTP/1.1\r\nHo")          # half of them a head begun
        for _ in range(20):
            t0 = time.perf_counter()
            assert s.health()["status"] == "ok"
            assert time.perf_counter() - t0 < 2
        assert s.log.stat().st_size < 10_000 and "out of system resource" not in s.log.read_text()
    finally:
        for sock in socks:
            sock.close()
        s.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_streams(url: str, sizes: list[int]) -> tuple[list[threading.Thread], dict[int, list[str]]]:
    """Streamed completions of max_tokens `sizes`, each read in a thread; returns the threads and each
    stream's data lines (once each has one)."""
    lines: dict[int, list[str]] = {i: [] for i in range(len(sizes))}

    def read(i: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": sizes[i], "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines[i] += (line for line in r.iter_lines() if line.startswith("data: "))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(lines.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads, lines


def ended_with(lines: list[str]) -> str:
    """How a stream ended: "done" ([DONE] after the last chunk) or the error code of its last event."""
    if lines[-1] == "data: [DONE]":
        return "done"
    return json.loads(lines[-1].removeprefix("data: "))["error"]["code"]


def test_sigterm_lets_running_streams_finish(tmp_path):
    """SIGTERM with 8 streams open: those that can finish within --shutdown-timeout do (they go on after the
    signal), the others end with an error event; no traceback, exit code 0."""
    # the short streams need ~60 steps of 8 rows (~4 s here alone): the timeout leaves room for a loaded machine,
    # and the long ones still cannot finish within it
    s = Server(tmp_path, "--shutdown-timeout", "20")
    try:
        threads, lines = open_streams(s.url, [60] * 4 + [4000] * 4)
        s.proc.send_signal(signal.SIGTERM)
        signalled = {i: len(chunks) for i, chunks in lines.items()}
        assert s.proc.wait(90) == 0
        for t in threads:
            t.join(10)
        assert [ended_with(lines[i]) for i in range(8)] == ["done"] * 4 + ["server_shutting_down"] * 4
        assert all(len(lines[i]) > signalled[i] for i in range(4))      # they were answered after the signal
        log = s.log.read_text()
        assert "Traceback" not in log and "dsv4 serve: stopped" in log
    finally:
        s.stop()


def test_ctrl_c_with_a_stream_open_is_clean(tmp_path):
    """Ctrl-C once printed 4 tracebacks and cut the stream without a word; now the stream gets an error event
    once --shutdown-timeout is over (a second Ctrl-C: at once)."""
    s = Server(tmp_path, "--shutdown-timeout", "30")
    try:
        threads, lines = open_streams(s.url, [4000])
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(20) == 130
        threads[0].join(10)
        assert ended_with(lines[0]) == "server_shutting_down"
        log = s.log.read_text()
        assert "Traceback" not in log and "Ctrl-C again" in log
    finally:
        s.stop()


@pytest.fixture(scope="module")
def bundled():
    """The served model loaded here, for the logprobs a full forward pass gives."""
    import torch

    from dsv4cli.model import load_model

    return load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32)


def full_forward_logprobs(model, ids: list[int]) -> list[float]:
    """Each token's logprob after the ones before it (the first: None), from one plain forward pass."""
    import torch

    lp = model.forward(torch.tensor([ids])).log_softmax(-1)[0]
    return [None] + lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def close(got: list, want: list, tol: float = 1e-3) -> bool:
    return len(got) == len(want) and all((g is None) == (w is None) and (g is None or abs(g - w) <= tol)
                                         for g, w in zip(got, want))


def test_echo_with_logprobs_scores_the_prompt(server, bundled):
    """echo + logprobs (what lm-evaluation-harness sends, token ids, max_tokens 1; or max_tokens 0 to score
    only): the prompt's tokens and logprobs (the first null), then the reply's, each prompt of a list a choice
    of its own in order; streamed, the first chunk carries the prompt's. Logprobs are a full forward pass's."""
    client, tok = server.client(), Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    texts = ["Once upon a time there was a cat.", "What is the capital of France?"]
    ids = [tok.encode(t) for t in texts]
    r = client.completions.create(model="x", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, ids):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.top_logprobs[0] is None
        assert close(lp.token_logprobs[:-1], full_forward_logprobs(bundled, prompt)), lp.token_logprobs
        assert lp.tokens[:len(prompt)] == [tok.decode([t]) for t in prompt]
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert choice.text.startswith(tok.decode(prompt))
    assert r.usage.prompt_tokens == sum(map(len, ids))
    only = client.completions.create(model="x", prompt=texts[0], max_tokens=0, echo=True, logprobs=3)
    lp = only.choices[0].logprobs
    assert only.choices[0].text == texts[0] and only.usage.completion_tokens == 0
    assert close(lp.token_logprobs, full_forward_logprobs(bundled, [tok.bos_id, *ids[0]]))
    chunks = list(client.completions.create(model="x", prompt=texts[0], max_tokens=3, echo=True, logprobs=2,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text == texts[0] and chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs
    for body, param in (({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs")):
        r = server.post("/v1/completions", {"model": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_vllm_prompt_logprobs(server, bundled):
    """vLLM's prompt_logprobs: per prompt token (the first null) its id's logprob and the N most likely with their
    ranks, on each completion choice and on a chat reply's body."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    body = server.post("/v1/completions", {"model": "x", "prompt": "Hello there", "max_tokens": 1,
                                           "prompt_logprobs": 2}).json()
    ids = [tok.bos_id, *tok.encode("Hello there")]
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    assert close([None] + [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], scored[1:])],
                 full_forward_logprobs(bundled, ids))
    for entry in scored[1:]:
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None)
        assert [r for r, _ in ranked][:2] == [1, 2] and ranked[0][1] >= ranked[1][1]
    chat = server.post("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_tokenizer_info(server):
    """What lm-evaluation-harness's remote tokenizer reads: the special tokens, a note for the template, the
    context; under the key; its eos_token tokenizes to the EOS id."""
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    r = server.post("/tokenize", {"prompt": "x"}, key=None)
    assert r.status_code == 401
    info = httpx.get(server.url + "/tokenizer_info", headers={"authorization": f"Bearer {KEY}"}).json()
    assert info["bos_token"] == "<｜begin▁of▁sentence｜>" and info["eos_token"] == "<｜end▁of▁sentence｜>"
    assert info["model_max_length"] == 4096 and info["chat_template"] is None
    assert "in code" in info["chat_template_note"]
    eos = server.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tok.eos_id]
    assert httpx.get(server.url + "/tokenizer_info").status_code == 401


def test_an_open_unkeyed_server_warns_once(tmp_path):
    """Listening beyond loopback with no key: one warning line at start-up (it answers any Host there); with a
    key, or on loopback (every other server here), none."""
    for args, env, warned in ((("--host", "0.0.0.0"), {}, True), (("--host", "0.0.0.0"), {"DSV4_API_KEY": KEY}, False)):
        s = Server(tmp_path, *args, env=env)
        s.stop()
        lines = [line for line in s.log.read_text().splitlines() if line.startswith("warning:")]
        assert len(lines) == warned and (not warned or "--api-key" in lines[0]), lines


def test_vllm_guided_fields_constrain_the_reply(server):
    """vLLM's guided_choice / guided_regex / guided_json / guided_grammar and structured_outputs hold the reply to
    what they give, streamed as not, chat and completions; two ways of constraining is a 400 naming the second."""
    client = server.client()
    choices = ["yes", "no", "maybe later"]
    cases = [({"guided_choice": choices}, lambda text: text in choices),
             ({"structured_outputs": {"choice": choices}}, lambda text: text in choices),
             ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
             ({"guided_grammar": 'start: colour " " colour\ncolour: "red" | "blue"'},
              lambda text: re.fullmatch("(red|blue) (red|blue)", text)),
             ({"guided_json": json.dumps({"type": "object", "properties": {"n": {"type": "boolean"}},
                                          "required": ["n"], "additionalProperties": False})},
              lambda text: isinstance(json.loads(text)["n"], bool))]
    for extra, holds in cases:
        r = ask(client, PROMPTS[0], max_tokens=60, extra_body=extra)
        content = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and holds(content), (extra, content)
        streamed = ask(client, PROMPTS[0], max_tokens=60, stream=True, extra_body=extra)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content
    r = client.completions.create(model="dsv4-tiny", prompt="Once upon a time", max_tokens=60,
                                  extra_body={"guided_choice": choices})
    assert r.choices[0].text in choices
    json_twice = {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}
    for extra, param in ((json_twice, "guided_json"),
                         ({"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}, "structured_outputs.regex"),
                         ({"tools": [WEATHER], "tool_choice": "required", "guided_choice": choices}, "guided_choice"),
                         ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                         ({"guided_choice": []}, "guided_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, PROMPTS[0], extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_vllm_chat_template_kwargs_switch_thinking(server):
    """`chat_template_kwargs: {"thinking": true}` (vLLM's DeepSeek switch) is `thinking: true`, its
    reasoning_effort the body's; a top-level field wins; another key is a 400 naming it."""
    client = server.client()
    kw = {"max_tokens": 30, "extra_body": {"ignore_eos": True}}
    want = ask(client, PROMPTS[2], **kw | {"extra_body": {"ignore_eos": True, "thinking": True}}).choices[0].message
    switched = {"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}
    got = ask(client, PROMPTS[2], **kw | {"extra_body": switched}).choices[0].message
    assert got.reasoning_content == want.reasoning_content and got.content == want.content
    assert want.reasoning_content is not None
    overridden = ask(client, PROMPTS[2], **kw | {"extra_body": {
        "ignore_eos": True, "thinking": False, "chat_template_kwargs": {"thinking": True}}}).choices[0].message
    assert getattr(overridden, "reasoning_content", None) is None
    effort = {"ignore_eos": True, "thinking": True, "reasoning_effort": "max"}
    want = ask(client, PROMPTS[2], **kw | {"extra_body": effort}).usage.prompt_tokens
    got = ask(client, PROMPTS[2], **kw | {"extra_body": {"ignore_eos": True, "chat_template_kwargs": {
        "thinking": True, "reasoning_effort": "max"}}}).usage.prompt_tokens
    assert got == want != ask(client, PROMPTS[2], **kw | {"extra_body": {"ignore_eos": True, "thinking": True}}
                              ).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "Hi", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert e.value.body["param"] == "chat_template_kwargs.enable_thinking"


def test_vllm_skip_special_tokens_false_keeps_them(server):
    """A reply forced (logit_bias) to write `</think>`: the default hides it, `skip_special_tokens: false` shows
    it, streamed as not, chat and completions."""
    client = server.client()
    think_end = Tokenizer.from_dir(BUNDLED_MODEL_DIR).special_ids["</think>"]
    body = {"logit_bias": {str(think_end): 100}, "max_tokens": 3}
    assert ask(client, "Hi", **body).choices[0].message.content == ""
    kept = {"extra_body": {"skip_special_tokens": False}}
    assert ask(client, "Hi", **body, **kept).choices[0].message.content == "</think>" * 3
    streamed = ask(client, "Hi", **body, **kept, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "</think>" * 3
    r = client.completions.create(model="dsv4-tiny", prompt="Hi", **body, **kept, logprobs=1)
    assert r.choices[0].text == "</think>" * 3 and r.choices[0].logprobs.text_offset == [0, 8, 16]
    assert client.completions.create(model="dsv4-tiny", prompt="Hi", **body).choices[0].text == ""


def test_vllm_include_stop_str_in_output(server):
    """A reply a stop string ended keeps it at its end with include_stop_str_in_output, streamed as not."""
    client = server.client()
    full = ask(client, PROMPTS[0], max_tokens=MAX_TOKENS).choices[0].message.content
    stop = full[3:6]
    kept = full[:full.index(stop) + len(stop)]
    assert ask(client, PROMPTS[0], stop=stop).choices[0].message.content == kept.removesuffix(stop)
    extra = {"extra_body": {"include_stop_str_in_output": True}}
    r = ask(client, PROMPTS[0], stop=stop, **extra)
    assert r.choices[0].message.content == kept and r.choices[0].finish_reason == "stop"
    streamed = ask(client, PROMPTS[0], stop=stop, stream=True, **extra)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == kept
    text = client.completions.create(model="dsv4-tiny", prompt="Once upon a time", max_tokens=10).choices[0].text
    stop = text[2:5]
    r = client.completions.create(model="dsv4-tiny", prompt="Once upon a time", max_tokens=10, stop=stop, **extra)
    assert r.choices[0].text == text[:text.index(stop) + len(stop)]


def test_vllm_continue_final_message(server):
    """`continue_final_message: true` with `add_generation_prompt: false` continues the last assistant message:
    the reply is what a completion of the conversation's prompt followed by that message's text gives; other
    combinations, or no assistant message last, are 400s naming the field."""
    client = server.client()
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    opened = server.post("/tokenize", {"messages": [{"role": "user", "content": PROMPTS[0]}]}).json()["tokens"]
    ids = opened + tok.encode("The capital")
    want = client.completions.create(model="dsv4-tiny", prompt=ids, max_tokens=MAX_TOKENS).choices[0].text
    messages = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": "The capital"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model="dsv4-tiny", messages=messages, max_tokens=MAX_TOKENS, extra_body=flags)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    assert server.post("/tokenize", {"messages": messages, **flags}).json()["tokens"] == ids
    for extra, msgs, param in (({"continue_final_message": True}, messages, "continue_final_message"),
                               ({"add_generation_prompt": False}, messages, "add_generation_prompt"),
                               (flags, messages[:1], "continue_final_message"),
                               (flags | {"thinking": True}, messages, "continue_final_message")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="dsv4-tiny", messages=msgs, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
