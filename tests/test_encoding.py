"""The chat format, branch by branch. Expected strings are what DeepSeek's official
`encoding/encoding_dsv4.py` renders for the same messages (checked against it)."""
import json

import pytest

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.encoding import EOS, encode_messages, parse_completion
from dsv4cli.engine import SamplingParams, Sequence
from dsv4cli.openai.requests import BodyParser
from dsv4cli.openai.responses import ChunkStream, completion
from dsv4cli.tokenizer import Tokenizer

BOS = "<｜begin▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

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


def assert_round_trip(messages, thinking, **options):
    """The final assistant turn renders as the prompt of the turns before it plus a completion, and
    that completion parses back into a message that renders the same (arguments in canonical JSON)."""
    prompt = encode_messages(messages[:-1], thinking=thinking, **options)
    full = encode_messages(messages, thinking=thinking, **options)
    assert full.startswith(prompt)
    reply = parse_completion(full[len(prompt):], thinking)
    last = messages[-1]
    assert reply["content"] == (last.get("content") or "")
    if thinking:
        assert reply["reasoning_content"] == (last.get("reasoning_content") or "")
    assert [c["function"]["name"] for c in reply["tool_calls"]] == [
        c["function"]["name"] for c in last.get("tool_calls") or []
    ]
    assert encode_messages(messages[:-1] + [reply], thinking=thinking, **options) == full
    return reply


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
        ([{"role": "developer", "content": ""}], "needs non-empty 'content'"),
        ([{"role": "user", "content": "x", "task": "summary"}], "unknown task 'summary'"),
        ([{"role": "tool", "content": ["text"]}], "content block that is not a dict"),
        ([{"role": "system", "content": "S", "tools": [{"name": "f"}]}], "has a tool that is not"),
    ],
)
def test_malformed_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages)


def test_bad_reasoning_effort():
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages(CONVERSATION, thinking=True, reasoning_effort="extreme")


# --- thinking mode and reasoning ---------------------------------------------------------------------


def test_keeping_thinking_renders_every_reasoning():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "r1"},
        {"role": "user", "content": "b"},
    ]
    assert encode_messages(messages, thinking=True, drop_thinking=False) == (
        BOS + "<｜User｜>a<｜Assistant｜><think>r1</think>A" + EOS + "<｜User｜>b<｜Assistant｜><think>"
    )
    # Chat mode renders no reasoning either way.
    assert encode_messages(messages, drop_thinking=False) == (
        BOS + "<｜User｜>a<｜Assistant｜></think>A" + EOS + "<｜User｜>b<｜Assistant｜></think>"
    )


def test_tools_on_any_message_keep_reasoning():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "r1", "tools": [WEATHER_TOOL]},
        {"role": "user", "content": "b"},
    ]
    # The assistant's tools are not rendered, but they keep its reasoning, as a system's tools would.
    assert encode_messages(messages, thinking=True) == (
        BOS + "<｜User｜>a<｜Assistant｜><think>r1</think>A" + EOS + "<｜User｜>b<｜Assistant｜><think>"
    )


def test_reasoning_effort_text_and_levels():
    prompt = encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="max")
    assert prompt == (
        BOS
        + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
        "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
        "adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
        "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
        "<｜User｜>x<｜Assistant｜><think>"
    )
    # "high" is the default effort and adds nothing.
    assert encode_messages(CONVERSATION, thinking=True, reasoning_effort="high") == HISTORY + "<think>"


def test_thinking_mode_round_trips():
    answered = CONVERSATION + [{"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}]
    assert_round_trip(answered, thinking=True)
    assert_round_trip(answered, thinking=False)
    assert_round_trip(answered, thinking=True, drop_thinking=False)


# --- system, developer, response format, latest reminder -----------------------------------------------

TOOLS_TEXT = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
SCHEMA_TEXT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
    '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}'
)


def test_system_with_tools_and_response_format():
    system = {"role": "system", "content": "S", "tools": [WEATHER_TOOL], "response_format": SCHEMA}
    messages = [system, {"role": "user", "content": "U"}]
    assert encode_messages(messages) == (
        BOS + "S\n\n" + TOOLS_TEXT + "\n\n" + SCHEMA_TEXT + "<｜User｜>U<｜Assistant｜></think>"
    )
    only_format = [{"role": "system", "content": "S", "response_format": SCHEMA}, {"role": "user", "content": "U"}]
    assert encode_messages(only_format) == BOS + "S\n\n" + SCHEMA_TEXT + "<｜User｜>U<｜Assistant｜></think>"


def test_developer_turn_with_tools_and_response_format():
    developer = {"role": "developer", "content": "D", "tools": [WEATHER_TOOL], "response_format": SCHEMA}
    # A developer turn is a user turn that carries instructions; it opens the reply like one.
    assert encode_messages([developer]) == (
        BOS + "<｜User｜>D\n\n" + TOOLS_TEXT + "\n\n" + SCHEMA_TEXT + "<｜Assistant｜></think>"
    )
    # With tools defined, thinking mode keeps the developer turn and opens thinking.
    assert encode_messages([developer, {"role": "user", "content": "U"}], thinking=True).endswith(
        SCHEMA_TEXT + "<｜User｜>U<｜Assistant｜><think>"
    )


def test_latest_reminder_placement():
    # A reminder after a user turn comes after the opened reply; at the end it opens nothing.
    messages = [
        {"role": "user", "content": "U"},
        {"role": "latest_reminder", "content": "R"},
        {"role": "assistant", "content": "A"},
    ]
    assert encode_messages(messages) == BOS + "<｜User｜>U<｜Assistant｜></think><｜latest_reminder｜>RA" + EOS
    assert encode_messages(messages[:2]) == BOS + "<｜User｜>U<｜Assistant｜></think><｜latest_reminder｜>R"
    # A system prompt is text only: no role token, no newline, no reply after it.
    assert encode_messages([{"role": "system", "content": "S"}]) == BOS + "S"


# --- tool calls and results ----------------------------------------------------------------------------


def test_tool_call_parameter_types():
    args = {"city": "Zürich", "days": 3, "hourly": True, "fields": ["temp", "wind"], "unit": None, "at": {"h": 9}}
    raw = json.dumps(args)  # ASCII-escaped on the way in; rendered with the real characters
    messages = [
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("a", "get_weather", args)]},
    ]
    assert encode_messages(messages) == (
        BOS
        + "<｜User｜>U<｜Assistant｜></think>Checking.\n\n<｜DSML｜tool_calls>\n"
        + '<｜DSML｜invoke name="get_weather">\n'
        + '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="hourly" string="false">true</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="fields" string="false">["temp", "wind"]</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="unit" string="false">null</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="at" string="false">{"h": 9}</｜DSML｜parameter>\n'
        + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
        + EOS
    )
    assert "\\u00fc" in raw
    reply = assert_round_trip(messages, thinking=False)
    assert reply["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args, ensure_ascii=False)}}
    ]


def test_tool_call_arguments_that_are_not_an_object_string():
    def assistant(arguments):
        tool_call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
        return [{"role": "user", "content": "U"}, {"role": "assistant", "content": "", "tool_calls": [tool_call]}]

    def rendered(params):
        return (
            BOS + "<｜User｜>U<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
            f'<｜DSML｜invoke name="f">\n{params}\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS
        )

    # Text that is not JSON becomes one string parameter named "arguments"; so does any non-string value.
    assert encode_messages(assistant("go north")) == rendered(
        '<｜DSML｜parameter name="arguments" string="true">go north</｜DSML｜parameter>'
    )
    assert encode_messages(assistant({"x": 1})) == rendered(
        '<｜DSML｜parameter name="arguments" string="false">{"x": 1}</｜DSML｜parameter>'
    )
    # No arguments: an empty parameter list.
    assert encode_messages(assistant("{}")) == rendered("")
    assert_round_trip(assistant("go north"), thinking=False)
    assert_round_trip(assistant("{}"), thinking=False)
    # JSON that is not an object has no parameter names.
    with pytest.raises(ValueError, match="must be a JSON object"):
        encode_messages(assistant("[1, 2]"))


def test_tool_results_form_user_turns():
    calls = [call("a", "get_weather", {"city": "Paris"}), call("b", "get_weather", {"city": "Rome"})]
    image_result = [{"type": "text", "text": "rain"}, {"type": "image_url"}, {"type": "text", "text": "12C"}]
    messages = [
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": image_result},
        {"role": "tool", "tool_call_id": "a", "content": "sun"},
        {"role": "user", "content": "and Oslo?"},
    ]
    prompt = encode_messages(messages)
    # Results in call order, content blocks joined, unsupported blocks named, later user text in the same turn.
    assert prompt.endswith(
        EOS
        + "<｜User｜><tool_result>sun</tool_result>"
        + "\n\n<tool_result>rain\n\n[Unsupported image_url]\n\n12C</tool_result>"
        + "\n\nand Oslo?<｜Assistant｜></think>"
    )


def test_tool_result_order_comes_from_the_latest_calls():
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [call("x", "f", {}), call("y", "f", {})]},
        {"role": "assistant", "content": "no calls here"},
        {"role": "tool", "tool_call_id": "unknown", "content": "3"},
        {"role": "tool", "tool_call_id": "y", "content": "2"},
        {"role": "tool", "tool_call_id": "x", "content": "1"},
    ]
    # An assistant turn without calls keeps the previous order; an unknown id sorts as the first call.
    # With no user turn before it, the first tool result starts a user turn of its own.
    assert encode_messages(messages).endswith(
        "no calls here" + EOS + "<｜User｜><tool_result>3</tool_result>\n\n<tool_result>1</tool_result>"
        "\n\n<tool_result>2</tool_result><｜Assistant｜></think>"
    )
    # Ids may also sit inside "function".
    in_function = [{"type": "function", "function": {"name": "f", "arguments": "{}", "id": i}} for i in ("x", "y")]
    messages[0] = {"role": "assistant", "content": "", "tool_calls": in_function}
    assert encode_messages(messages).endswith("<tool_result>2</tool_result><｜Assistant｜></think>")


def test_unterminated_assistant_turn():
    # wo_eos leaves the turn open so that generation continues it (a prefilled reply).
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "Once upon", "wo_eos": True}]
    assert encode_messages(messages) == BOS + "<｜User｜>U<｜Assistant｜></think>Once upon"
    assert encode_messages(messages, thinking=True) == BOS + "<｜User｜>U<｜Assistant｜><think></think>Once upon"


# --- tasks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task, token", [("query", "<｜query｜>"), ("authority", "<｜authority｜>"), ("domain", "<｜domain｜>"),
                    ("title", "<｜title｜>"), ("read_url", "<｜read_url｜>")]
)
def test_task_token_replaces_the_reply(task, token):
    messages = [{"role": "user", "content": "U", "task": task}]
    assert encode_messages(messages) == BOS + "<｜User｜>U" + token
    assert encode_messages(messages, thinking=True) == BOS + "<｜User｜>U" + token
    # The task's answer has no reasoning part, in thinking mode too.
    answered = messages + [{"role": "assistant", "content": "label", "reasoning_content": "unused"}]
    assert encode_messages(answered, thinking=True) == BOS + "<｜User｜>U" + token + "label" + EOS
    assert_round_trip(answered, thinking=False)


def test_action_task_opens_the_reply():
    messages = [{"role": "user", "content": "U", "task": "action"}, {"role": "assistant", "content": "Search"}]
    assert encode_messages(messages) == BOS + "<｜User｜>U<｜Assistant｜></think><｜action｜>Search" + EOS
    assert encode_messages(messages, thinking=True) == BOS + "<｜User｜>U<｜Assistant｜><think><｜action｜>Search" + EOS
    assert_round_trip(messages, thinking=False)


def test_task_placement():
    # A task token only comes where a reply would: not before another user turn.
    messages = [{"role": "user", "content": "a", "task": "title"}, {"role": "user", "content": "b"}]
    # A user turn with a task also takes no following user text into it.
    assert encode_messages(messages) == BOS + "<｜User｜>a<｜User｜>b<｜Assistant｜></think>"
    # Any role can carry a task.
    system = [{"role": "system", "content": "S", "task": "domain"}]
    assert encode_messages(system) == BOS + "S<｜domain｜>"
    # A user text merged into an earlier turn leaves its task behind.
    merged = [{"role": "user", "content": "a"}, {"role": "user", "content": "b", "task": "query"}]
    assert encode_messages(merged) == BOS + "<｜User｜>a\n\nb<｜Assistant｜></think>"


# --- incremental encoding ------------------------------------------------------------------------------


def test_context_renders_only_the_new_messages():
    context = CONVERSATION[:3]
    new = CONVERSATION[3:]
    suffix = encode_messages(new, context=context)
    assert suffix == "<｜User｜>What is 2+2?<｜Assistant｜></think>"
    assert encode_messages(context) + suffix == encode_messages(CONVERSATION)
    # No reasoning-effort text either: that belongs to the start.
    assert encode_messages(new, context=context, thinking=True, reasoning_effort="max") == (
        "<｜User｜>What is 2+2?<｜Assistant｜><think>"
    )
    # A tool result in the new messages starts its own turn after the context.
    tool = [{"role": "tool", "tool_call_id": "a", "content": "sun"}]
    assert encode_messages(tool, context=[{"role": "user", "content": "U"}]) == (
        "<｜User｜><tool_result>sun</tool_result><｜Assistant｜></think>"
    )
    # Tools defined in the context keep the new turns' reasoning.
    system = {"role": "system", "content": "S", "tools": [WEATHER_TOOL]}
    answered = [*new, {"role": "assistant", "content": "4", "reasoning_content": "sum"}]
    assert encode_messages(answered, context=[system, *context], thinking=True) == (
        "<｜User｜>What is 2+2?<｜Assistant｜><think>sum</think>4" + EOS
    )


def test_context_counted_by_itself_in_thinking_mode():
    # As in the official encoder, the context's surviving turns are counted on the context alone. Here
    # the new user turn hides the context's developer turn, so the count is one too high and the new
    # user turn is not rendered.
    context = [
        {"role": "user", "content": "a"},
        {"role": "developer", "content": "D"},
        {"role": "assistant", "content": "A", "reasoning_content": "r"},
    ]
    new = [{"role": "user", "content": "b"}, {"role": "assistant", "content": "B", "reasoning_content": "s"}]
    assert encode_messages(new, context=context, thinking=True) == "s</think>B" + EOS


def test_without_bos():
    assert encode_messages(CONVERSATION, add_bos=False) == HISTORY[len(BOS):] + "</think>"


# --- parsing -------------------------------------------------------------------------------------------


def test_parse_keeps_non_string_values_as_written():
    completion = (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="ids" string="false">[1,2]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="q" string="true">say "hi"</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="g">\n\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>" + EOS
    )
    parsed = parse_completion(completion, thinking=False)
    assert parsed["content"] == ""
    assert parsed["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": '{"ids": [1,2], "q": "say \\"hi\\""}'}},
        {"type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


# --- tool calls in every spelling, streamed and not ---------------------------------------------------


def rendered_reply(content, calls):
    """An assistant turn with `calls` ({name: arguments}) as encode_messages renders it (DSV4's spelling)."""
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": content,
                                                   "tool_calls": [call(f"c{i}", name, args)
                                                                  for i, (name, args) in enumerate(calls.items())]}]
    return encode_messages(messages)[len(encode_messages(messages[:1])):]


def spelled(text, *bars):
    """`text` with its DSML markers spelled with `bars` in turn (each a pair: the marker's left and right bar)."""
    parts = text.split("｜DSML｜")
    return parts[0] + "".join(f"{bars[i % len(bars)][0]}DSML{bars[i % len(bars)][1]}{part}"
                              for i, part in enumerate(parts[1:]))


CALLS = {"get_weather": {"city": "Paris", "days": 2},
         "search": {"q": 'say "hi" <b>|x|</b> \\ ok', "n": [1, {"a": None}]}}
REPLY = rendered_reply("Sure.", CALLS)
# how peers' models write the same reply: ASCII bars, bars mixed in a tag and across tags, a fullwidth block
# whose invokes use ASCII bars, V3.2's block name
SPELLINGS = {
    "fullwidth": REPLY,
    "ascii": spelled(REPLY, "||"),
    "mixed": spelled(REPLY, "｜|", "|｜", "||", "｜｜"),
    "ascii invokes": REPLY.replace("｜DSML｜invoke", "|DSML|invoke").replace("｜DSML｜parameter", "|DSML|parameter"),
    "function_calls": REPLY.replace("tool_calls>", "function_calls>"),
    "function_calls ascii": spelled(REPLY.replace("tool_calls>", "function_calls>"), "||"),
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_tool_calls_in_every_spelling(spelling):
    parsed = parse_completion(SPELLINGS[spelling], thinking=False)
    assert parsed["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]] == \
        list(CALLS.items())
    assert parsed == parse_completion(REPLY, thinking=False)


def test_a_string_holding_markup_ends_at_its_own_closing_tag():
    """A string parameter whose value holds an invoke's closing tag (and a call block's) keeps it whole."""
    args = {"code": "end </｜DSML｜invoke> and </｜DSML｜tool_calls> here", "n": 1}
    parsed = parse_completion(rendered_reply("", {"write": args, "now": {}}), thinking=False)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]] == \
        [("write", args), ("now", {})]


TOK = Tokenizer.from_dir(BUNDLED_MODEL_DIR)


def streamed_message(pieces, thinking):
    """The chat message a client puts together from the chunks of a reply fed to ChunkStream in `pieces`, and
    the non-streamed message of the same reply (the bodies dsv4 serve sends)."""
    body = {"messages": [{"role": "user", "content": "U"}], "tools": [WEATHER_TOOL], "thinking": thinking}
    req = BodyParser(TOK, SamplingParams(), 4096).parse(body | {"stream": True}, chat=True, server=True)
    seq = Sequence("x", [0], req.params, 0, output_ids=[1], text="".join(pieces), finish_reason="stop")
    stream = ChunkStream(req, TOK, "tiny", "7")
    chunks = stream.first() + [c for piece in pieces for c in stream.update(piece, [])] + stream.finish(seq)
    choices = [c["choices"][0] for c in chunks]
    message = {"role": "assistant", "content": "".join(c["delta"].get("content") or "" for c in choices)}
    if thinking:
        message["reasoning_content"] = "".join(c["delta"].get("reasoning_content") or "" for c in choices)
    calls = {}
    for delta in (d for c in choices for d in c["delta"].get("tool_calls", [])):
        whole = calls.setdefault(delta["index"], {"id": delta.get("id"), "type": delta.get("type"),
                                                  "function": {"name": delta["function"].get("name"),
                                                               "arguments": ""}})
        whole["function"]["arguments"] += delta["function"]["arguments"]
    if calls:
        message["tool_calls"] = list(calls.values())
    whole = completion(req, seq, "tiny", TOK, "7")["choices"][0]
    return (message, choices[-1]["finish_reason"]), (whole["message"], whole["finish_reason"])


@pytest.mark.parametrize("text, thinking", [
    *((text, False) for text in SPELLINGS.values()),
    ("I think.</think>" + SPELLINGS["mixed"], True),
    (rendered_reply("Sure.", {"write": {"code": "end </｜DSML｜invoke> here"}}), False),
    # a bare marker is no call: it shows as the other special tokens do (not at all); ASCII ones are text
    ("Hello ｜DSML｜ world ｜DSML｜, a |DSML| b <|DSML|invoke c\n\n<d", False),
], ids=[*SPELLINGS, "thinking", "markup in a string", "bare markers"])
def test_streamed_reply_equals_the_message_at_every_split_point(text, thinking):
    """The reply fed in two pieces split at every character, and one character at a time: the chunks put
    together are the non-streamed message (content, reasoning, calls with their ids, finish reason), so no
    markup ever streams as content and no call is lost."""
    for pieces in [[text[:n], text[n:]] for n in range(len(text) + 1)] + [list(text)]:
        streamed, whole = streamed_message(pieces, thinking)
        assert streamed == whole, pieces
