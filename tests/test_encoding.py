import json

import pytest

from dsv4cli.encoding import EOS, encode_messages, parse_completion

BOS = "<｜begin▁of▁sentence｜>"

# The 2-turn conversation of docs §5, with its exact renderings.
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "greet"},
    {"role": "user", "content": "What is 2+2?"},
]
HISTORY = (
    "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi<｜Assistant｜></think>"
    "Hello! How can I help?<｜end▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def call(call_id, name, args):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_chat_mode_matches_spec():
    assert encode_messages(CONVERSATION) == HISTORY + "</think>"


def test_thinking_mode_drops_earlier_reasoning():
    prompt = encode_messages(CONVERSATION, thinking=True)
    assert prompt == HISTORY + "<think>"
    assert "greet" not in prompt


def test_thinking_mode_with_final_answer():
    answered = CONVERSATION + [{"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}]
    expected = HISTORY + "<think>2+2=4</think>4<｜end▁of▁sentence｜>"
    assert encode_messages(answered, thinking=True) == expected
    # Chat mode never renders reasoning.
    assert encode_messages(answered) == HISTORY + "</think>4<｜end▁of▁sentence｜>"


def test_multi_turn_thinking_keeps_only_reasoning_after_last_user():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "r1"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B", "reasoning_content": "r2"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "C", "reasoning_content": "r3"},
    ]
    assert encode_messages(messages, thinking=True) == (
        BOS
        + "<｜User｜>a<｜Assistant｜></think>A"
        + EOS
        + "<｜User｜>b<｜Assistant｜></think>B"
        + EOS
        + "<｜User｜>c<｜Assistant｜><think>r3</think>C"
        + EOS
    )


def test_merged_user_turns():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_messages(messages) == BOS + "<｜User｜>a\n\nb<｜Assistant｜></think>"


def test_latest_reminder_and_developer():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "latest_reminder", "content": "2026-01-01"},
        {"role": "developer", "content": "D"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U"},
    ]
    tail = "<｜User｜>U<｜Assistant｜>"
    assert encode_messages(messages) == (
        BOS + "S<｜latest_reminder｜>2026-01-01<｜User｜>D<｜Assistant｜></think>A" + EOS + tail + "</think>"
    )
    # Thinking mode drops developer turns before the last user turn.
    assert encode_messages(messages, thinking=True) == (
        BOS + "S<｜latest_reminder｜>2026-01-01A" + EOS + tail + "<think>"
    )


def test_tool_turns():
    messages = [
        {"role": "system", "content": "S", "tools": [WEATHER_TOOL]},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need tools",
            "tool_calls": [
                call("a", "get_weather", {"city": "Paris"}),
                call("b", "get_weather", {"city": "Rome", "days": 2}),
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "tool", "tool_call_id": "a", "content": "sun"},
        {"role": "assistant", "content": "Paris: sun. Rome: rain.", "reasoning_content": "summarise"},
    ]
    calls = (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    # With tools present, thinking mode keeps every turn's reasoning; results follow call order.
    conversation = (
        "<｜User｜>Weather in Paris and Rome?<｜Assistant｜><think>need tools</think>"
        + calls
        + EOS
        + "<｜User｜><tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>"
        + "<｜Assistant｜><think>summarise</think>Paris: sun. Rome: rain."
        + EOS
    )
    prompt = encode_messages(messages, thinking=True)
    system, rest = prompt.split("<｜User｜>", 1)
    assert "<｜User｜>" + rest == conversation
    assert system.startswith(BOS + "S\n\n## Tools\n\nYou have access to a set of tools")
    schema = json.dumps(WEATHER_TOOL["function"], ensure_ascii=False)
    assert system.endswith(
        f"### Available Tool Schemas\n\n{schema}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )

    # The assistant turn parses back into the same calls.
    completion = calls + EOS
    parsed = parse_completion("need tools</think>" + completion, thinking=True)
    assert parsed["reasoning_content"] == "need tools" and parsed["content"] == ""
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]
    ] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome", "days": 2}),
    ]


def test_reasoning_effort_max():
    prompt = encode_messages(CONVERSATION, thinking=True, reasoning_effort="max")
    assert prompt.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert prompt.endswith("unchecked.\n\n" + HISTORY[len(BOS) :] + "<think>")
    # Only thinking mode gets the prefix.
    assert encode_messages(CONVERSATION, reasoning_effort="max") == HISTORY + "</think>"


def test_parse_chat_and_thinking():
    assert parse_completion("Hello!" + EOS, thinking=False) == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "",
        "tool_calls": [],
    }
    parsed = parse_completion("2+2=4</think>4" + EOS, thinking=True)
    assert (parsed["reasoning_content"], parsed["content"]) == ("2+2=4", "4")
    # Cut off while thinking: everything so far is reasoning.
    parsed = parse_completion("still thinking", thinking=True)
    assert (parsed["reasoning_content"], parsed["content"]) == ("still thinking", "")


@pytest.mark.parametrize("thinking", [False, True])
def test_parse_round_trip(thinking):
    prompt = encode_messages(CONVERSATION, thinking=thinking)
    completion = ("2+2=4</think>" if thinking else "") + "It is 4." + EOS
    reply = parse_completion(completion, thinking=thinking)
    assert reply["content"] == "It is 4."
    assert encode_messages(CONVERSATION + [reply], thinking=thinking) == prompt + completion


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"content": "x"}], "unknown role None"),
        ([{"role": "user"}], "needs a string 'content'"),
        ([{"role": "assistant"}], "needs 'content' or 'tool_calls'"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "without a function name",
        ),
        ([{"role": "user", "content": "x", "reasoning_content": 3}], "non-string 'reasoning_content'"),
        (["hello"], "must be a dict"),
        ([], "empty conversation"),
    ],
)
def test_malformed_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages)


def test_bad_reasoning_effort():
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages(CONVERSATION, thinking=True, reasoning_effort="extreme")
