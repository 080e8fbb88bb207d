"""DeepSeek V4 chat format: messages -> prompt string, completion text -> assistant message.

Mirrors the rendering rules of the official `encoding/encoding_dsv4.py` (docs §5). V4 ships no
Jinja template, so this module is the chat template. Internal "task" tokens are not supported.
"""

import contextlib
import json
import re

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")
REASONING_EFFORTS = (None, "high", "max")

# The two prompt texts below are part of the format the model was trained on: keep them byte-exact.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), \
you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def encode_messages(messages, thinking=False, reasoning_effort=None, add_generation_prompt=True) -> str:
    """Render a conversation as one prompt string (starting with BOS).

    When the conversation ends with a user turn and `add_generation_prompt` is set, the prompt ends
    with `<｜Assistant｜>` plus `<think>` (thinking mode) or `</think>` (chat mode).
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    if not messages:
        raise ValueError("cannot encode an empty conversation")
    for i, message in enumerate(messages):
        _check_message(i, message)

    msgs = _merge_user_turns(messages)
    # With tools in play every turn keeps its reasoning; otherwise thinking mode drops old reasoning.
    keep_reasoning = any(m.get("tools") for m in msgs)
    if thinking and not keep_reasoning:
        last = _last_user_index(msgs)
        msgs = [m for i, m in enumerate(msgs) if m["role"] != "developer" or i >= last]
    last_user = _last_user_index(msgs)

    prompt = BOS
    if thinking and reasoning_effort == "max":
        prompt += REASONING_EFFORT_MAX
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            prompt += m["content"] + _tools_suffix(m)
        elif role == "developer":
            prompt += USER + m["content"] + _tools_suffix(m)
        elif role == "user":
            prompt += USER + m["content"]
        elif role == "latest_reminder":
            prompt += LATEST_REMINDER + m["content"]
        else:
            reasoning = ""
            if thinking and (keep_reasoning or i > last_user):
                reasoning = (m.get("reasoning_content") or "") + THINK_END
            prompt += reasoning + (m.get("content") or "") + _render_tool_calls(m.get("tool_calls")) + EOS

        next_role = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        opens_reply = next_role in ("assistant", "latest_reminder") or (
            next_role is None and add_generation_prompt
        )
        if role in ("user", "developer") and opens_reply:
            opens_thinking = thinking and (keep_reasoning or i >= last_user)
            prompt += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return prompt


def parse_completion(text: str, thinking: bool) -> dict:
    """Split generated text back into an assistant message (the inverse of an assistant turn).

    Lenient on truncation: a thinking completion cut off before `</think>` is all reasoning.
    `tool_calls` holds the DSML tool calls in OpenAI form (empty when there are none).
    """
    text = text.removesuffix(EOS)
    reasoning = ""
    if thinking:
        reasoning, found, rest = text.partition(THINK_END)
        text = rest if found else ""
    content, found, calls = text.partition("\n\n" + TOOL_CALLS_START)
    tool_calls = _parse_tool_calls(calls) if found else []
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


def _check_message(i, m):
    """Every malformed message raises ValueError, so callers have one exception type to catch."""
    if not isinstance(m, dict):
        raise ValueError(f"message {i} must be a dict, got {type(m).__name__}")  # noqa: TRY004
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"message {i} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = m.get("content")
    if role == "assistant":
        if content is None and not m.get("tool_calls"):
            raise ValueError(f"message {i} (assistant) needs 'content' or 'tool_calls'")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"message {i} (assistant) has non-string 'content'")
        for call in m.get("tool_calls") or []:
            if not isinstance(call, dict) or "name" not in call.get("function", call):
                raise ValueError(f"message {i} (assistant) has a tool call without a function name")
    elif not isinstance(content, str):
        raise ValueError(f"message {i} ({role}) needs a string 'content'")
    if not isinstance(m.get("reasoning_content") or "", str):
        raise ValueError(f"message {i} ({role}) has non-string 'reasoning_content'")  # noqa: TRY004


def _merge_user_turns(messages):
    """Fold tool results and consecutive user messages into single user turns (V4 has no tool role).

    Tool results are ordered like the calls of the latest assistant turn, matched by call id.
    """
    merged, call_rank = [], {}
    for m in messages:
        role = m["role"]
        if role not in ("user", "tool"):
            if role == "assistant":
                call_rank = {c.get("id"): k for k, c in enumerate(m.get("tool_calls") or [])}
            merged.append(m)
            continue
        if role == "tool":
            part = (call_rank.get(m.get("tool_call_id"), 0), f"<tool_result>{m['content']}</tool_result>")
        else:
            part = (None, m["content"])
        if merged and merged[-1]["role"] == "user":
            merged[-1]["parts"].append(part)
        else:
            merged.append({"role": "user", "parts": [part]})

    for m in merged:
        if m["role"] == "user":
            parts = m.pop("parts")
            slots = [k for k, (rank, _) in enumerate(parts) if rank is not None]
            for k, part in zip(slots, sorted((parts[k] for k in slots), key=lambda p: p[0])):
                parts[k] = part
            m["content"] = "\n\n".join(text for _, text in parts)
    return merged


def _last_user_index(msgs):
    return max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)


def _tools_suffix(m):
    tools = m.get("tools")
    if not tools:
        return ""
    schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return "\n\n" + TOOLS_PROMPT.format(schemas=schemas)


def _render_tool_calls(tool_calls):
    if not tool_calls:
        return ""
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call)  # OpenAI form {"function": {...}} or a bare {"name", "arguments"}
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"arguments": args}
            if not isinstance(args, dict):
                args = {"arguments": fn["arguments"]}
        params = "\n".join(_render_param(key, value) for key, value in args.items())
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return "\n\n" + TOOL_CALLS_START + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def _render_param(key, value):
    # Strings go in verbatim; every other type as JSON, flagged so the parser can tell them apart.
    if isinstance(value, str):
        return f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>'
    return f'<{DSML}parameter name="{key}" string="false">{json.dumps(value, ensure_ascii=False)}</{DSML}parameter>'


_INVOKE = re.compile(f'<{DSML}invoke name="(.*?)">\n(.*?)\n</{DSML}invoke>', re.DOTALL)
_PARAM = re.compile(f'<{DSML}parameter name="(.*?)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)


def _parse_tool_calls(block):
    calls = []
    for name, body in _INVOKE.findall(block):
        args = {}
        for key, is_string, value in _PARAM.findall(body):
            if is_string == "false":
                with contextlib.suppress(json.JSONDecodeError):  # else keep the raw text
                    value = json.loads(value)
            args[key] = value
        calls.append(
            {
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    return calls
