"""DeepSeek V4 chat format: messages -> prompt string, completion text -> assistant message.

Renders byte for byte what the official `encoding/encoding_dsv4.py` renders (docs §5), every feature
of it: system/developer/user/latest_reminder/tool/assistant turns, tool schemas and DSML tool calls,
tool results merged into user turns in call order, response formats, thinking mode with dropped
reasoning, reasoning effort, task tokens, unterminated (`wo_eos`) assistant turns and incremental
encoding after a context. V4 ships no Jinja template, so this module is the chat template.
"""

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
TOOL_CALLS_OPENING = f"\n\n{TOOL_CALLS_START}"  # how an assistant turn's tool calls start

ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")
# The chat encodings: the April preview's, and 0731's (whose reasoning efforts differ, below).
ENCODINGS = ("preview", "0731")
# OpenAI-style efforts as peers map them onto the model's three.
EFFORT_ALIASES = {"minimal": "low", "medium": "high", "xhigh": "max"}
REASONING_EFFORTS = (None, "low", "high", "max", *EFFORT_ALIASES)
# A message's `task` asks for a one-off classification right after it, instead of a normal reply.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# The prompt texts below are part of the format the model was trained on: keep them byte-exact.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
REASONING_EFFORT_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# What each effort puts before the first message in thinking mode, per encoding, and the default: the
# preview renders its one text at max only (high, its default, adds none); 0731 defaults to low (none),
# renders the preview's max text at high and a new one at max.
REASONING_EFFORT_PROMPTS = {
    "preview": {"low": "", "high": "", "max": REASONING_EFFORT_MAX},
    "0731": {"low": "", "high": REASONING_EFFORT_MAX, "max": REASONING_EFFORT_BEYOND_MAX},
}
DEFAULT_REASONING_EFFORT = {"preview": "high", "0731": "low"}

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

RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def encode_messages(
    messages, thinking=False, reasoning_effort=None, drop_thinking=True, context=None, add_bos=True,
    encoding="preview",
) -> str:
    """Render a conversation as one prompt string.

    A user or developer turn that ends the conversation or precedes an assistant turn opens the reply:
    `<｜Assistant｜>` plus `<think>` (thinking mode) or `</think>` (chat mode); a message's `task` puts
    its task token there instead. In thinking mode with `drop_thinking`, reasoning before the last user
    turn is left out, unless a message defines tools (tools and response formats are rendered on system
    and developer messages only). With `context` (messages already rendered), only `messages` are
    rendered, to be appended to it. `encoding`: the checkpoint's ("preview" or "0731": `checkpoint_encoding`),
    which decides what a reasoning effort renders.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS[1:]}, got {reasoning_effort!r}")
    effort = EFFORT_ALIASES.get(reasoning_effort, reasoning_effort) or DEFAULT_REASONING_EFFORT[encoding]
    context = context or []
    if not messages:
        raise ValueError("cannot encode an empty conversation")
    for i, message in enumerate(context + messages):
        _check_message(i, message)

    msgs, n_context = _merge_user_turns(context, messages)
    # With tools in play every turn keeps its reasoning.
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        # Counting the context by itself as the official encoder does (the counts differ only when
        # the new messages hide a developer turn of the context).
        n_context = len(_drop_old_reasoning(msgs[:n_context]))
        msgs = _drop_old_reasoning(msgs)
    last_user = _last_user_index(msgs)

    prompt = BOS if add_bos and not context else ""
    if n_context == 0 and thinking:
        prompt += REASONING_EFFORT_PROMPTS[encoding][effort]
    for i in range(n_context, len(msgs)):
        m, role = msgs[i], msgs[i]["role"]
        if role == "system":
            prompt += m["content"] + _system_suffix(m)
        elif role == "developer":
            prompt += USER + m["content"] + _system_suffix(m)
        elif role == "user":
            prompt += USER + m["content"]
        elif role == "latest_reminder":
            prompt += LATEST_REMINDER + m["content"]
        else:
            reasoning = ""
            # A task's answer is a bare label: no reasoning part even in thinking mode.
            if thinking and not (i > 0 and msgs[i - 1].get("task")) and (not drop or i > last_user):
                reasoning = (m.get("reasoning_content") or "") + THINK_END
            content = m.get("content") or ""
            prompt += reasoning + content + _render_tool_calls(m.get("tool_calls"))
            if not m.get("wo_eos"):
                prompt += EOS

        next_role = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if next_role not in (None, "assistant", "latest_reminder"):
            continue
        task = m.get("task")
        if task == "action":
            prompt += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        elif task:
            prompt += TASK_TOKENS[task]
        elif role in ("user", "developer"):
            opens_thinking = thinking and (not drop or i >= last_user)
            prompt += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return prompt


def parse_completion(text: str, thinking: bool, ignore_eos: bool = False, cut: bool = False) -> dict:
    """Split generated text back into an assistant message (the inverse of an assistant turn).

    Gives what the official parser gives for a well-formed turn, and is lenient on truncation: a
    thinking completion cut off before `</think>` is all reasoning, a missing EOS is fine.
    `tool_calls` holds the DSML tool calls in OpenAI form (empty when there are none); a reply `cut` by its
    length keeps the call it was writing, its arguments so far (as they streamed). With `ignore_eos` the reply
    goes on past an EOS, which it then reads as no end.
    """
    text = text if ignore_eos else text.partition(EOS)[0]
    reasoning = ""
    if thinking:
        reasoning, found, rest = text.partition(THINK_END)
        text = rest if found else ""
    content, calls = split_tool_calls(text)
    tool_calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                  for c in tool_calls_so_far(calls) if c["done"] or cut] if calls is not None else []
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


def split_tool_calls(answer: str, final: bool = True) -> tuple[str, str | None]:
    """(the content, the tool-calls block after its opening tag, None without one) of an answer. Tolerant: the
    opening in any spelling (`_CALLS_OPENINGS`), and a block the model opened without the blank line before it
    still ends the content, so its markup never shows as text. While a reply streams (`final` False), an ending
    of the content that could open the block is held back."""
    if m := _CALLS_START.search(answer):
        return answer[:m.start()].removesuffix("\n\n"), answer[m.end():]
    return answer[:len(answer) - (0 if final else _held_back(answer, _CALLS_HELD))], None


def tool_calls_so_far(block: str) -> list[dict]:
    """The DSML calls in a tool-calls block as {"name", "arguments", "done"}: the arguments built as the
    official parser builds them (string values JSON-quoted, others as the model wrote them), `done` once
    the call's closing tag came. The arguments of a call not done are those so far, a prefix of the whole
    ones, without an ending that could be the start of a closing tag: no markup ever shows in them, while
    the reply streams or when it was cut off. Tolerant: tags in any spelling of the marker, no newline needed
    after an invoke's opening tag, anything else between tags skipped."""
    calls, at = [], 0
    while m := _INVOKE_OPEN.search(block, at):
        arguments, at = _arguments(block, m.end())
        calls.append({"name": m[1], "arguments": arguments, "done": at is not None})
        if at is None:
            break
    return calls


def _arguments(block: str, at: int) -> tuple[str, int | None]:
    """The parameters of the invoke whose opening tag ends at `at`, as a JSON object's text, and where the
    invoke's closing tag ends; while it is not closed, the arguments so far and None. A value ends at its own
    closing tag, and the invoke at the closing tag after its last parameter, so a string may hold other markup."""
    params = []
    while (m := _INVOKE_NEXT.search(block, at)) and m["name"] is not None:
        end = _PARAM_CLOSE.search(block, m.end())
        value = block[m.end():end.start() if end else len(block)]
        if not end:             # hold back a possible start of the closing tag
            value = value[:len(value) - _held_back(value, _PARAM_CLOSES)]
        quoted = json.dumps(value, ensure_ascii=False) if m["string"] == "true" else value
        if not end and m["string"] == "true":
            quoted = quoted[:-1]            # the string goes on: no closing quote yet
        params.append(f"{json.dumps(m['name'], ensure_ascii=False)}: {quoted}")
        if not end:
            return "{" + ", ".join(params), None
        at = end.end()
    return "{" + ", ".join(params) + ("}" if m else ""), m.end() if m else None


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many of the last characters of `text` could start one of `markers`."""
    return next((n for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1)
                 if any(marker.startswith(text[-n:]) for marker in markers)), 0)


def is_tool(t) -> bool:
    """Whether `t` is a tool in OpenAI form: {"type": "function", "function": {"name": ..., ...}}."""
    return (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str))


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
        if not isinstance(m.get("tool_calls") or [], list):
            raise ValueError(f"message {i} (assistant) has 'tool_calls' that are not a list")
        for call in m.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"message {i} (assistant) has a tool call without a function name")
            if not isinstance(call.get("id") or function.get("id") or "", str):
                raise ValueError(f"message {i} (assistant) has a tool call whose id is not a string")
    elif role == "tool" and not isinstance(m.get("tool_call_id", ""), str | None):
        raise ValueError(f"message {i} (tool) has a 'tool_call_id' that is not a string")
    elif role == "tool" and isinstance(content, list):
        if not all(isinstance(block, dict) for block in content):
            raise ValueError(f"message {i} (tool) has a content block that is not a dict")
    elif not isinstance(content, str):
        raise ValueError(f"message {i} ({role}) needs a string 'content'")
    elif role == "developer" and not content:
        raise ValueError(f"message {i} (developer) needs non-empty 'content'")
    if not isinstance(m.get("reasoning_content") or "", str):
        raise ValueError(f"message {i} ({role}) has non-string 'reasoning_content'")  # noqa: TRY004
    task = m.get("task")
    if task is not None and not (isinstance(task, str) and task in TASK_TOKENS):
        raise ValueError(f"message {i} ({role}) has unknown task {task!r}; expected one of {', '.join(TASK_TOKENS)}")
    if not isinstance(m.get("tools") or [], list):
        raise ValueError(f"message {i} ({role}) has 'tools' that are not a list")
    for tool in m.get("tools") or []:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ValueError(f"message {i} ({role}) has a tool that is not {{'type': 'function', 'function': {{...}}}}")


def _merge_user_turns(context, messages):
    """(turns, how many of them come from `context`): tool results and consecutive user messages
    folded into single user turns (V4 has no tool role).

    A user message after a turn that carries a task starts a new turn; the context's last turn is never
    extended by the new messages. Tool results are ordered like the calls of the latest assistant turn
    with calls, matched by call id.
    """
    merged, call_rank, n_context = [], {}, 0
    for k, m in enumerate(context + messages):
        if k == len(context):
            n_context = len(merged)
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            ids = [c.get("id") or c["function"].get("id") for c in m["tool_calls"]]
            call_rank = {call_id: rank for rank, call_id in enumerate(ids) if call_id}
        if role not in ("user", "tool"):
            merged.append(m)
            continue
        previous = merged[-1] if merged and k != len(context) else None
        extends = previous is not None and previous["role"] == "user" and (role == "tool" or not previous.get("task"))
        if not extends:
            turn = {"role": "user", "parts": []}
            if role == "user" and m.get("task"):
                turn["task"] = m["task"]
            merged.append(turn)
        if role == "tool":
            merged[-1]["parts"].append((call_rank.get(m.get("tool_call_id"), 0), _tool_result(m["content"])))
        else:
            merged[-1]["parts"].append((None, m["content"]))

    for m in merged:
        if m["role"] == "user":
            parts = m.pop("parts")
            slots = [k for k, (rank, _) in enumerate(parts) if rank is not None]
            for k, part in zip(slots, sorted((parts[k] for k in slots), key=lambda p: p[0])):
                parts[k] = part
            m["content"] = "\n\n".join(text for _, text in parts)
    return merged, n_context


def _tool_result(content):
    if isinstance(content, list):  # content blocks: text kept, anything else named
        content = "\n\n".join(
            b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]" for b in content
        )
    return f"<tool_result>{content}</tool_result>"


def _drop_old_reasoning(msgs):
    """Thinking mode: turns before the last user turn lose their reasoning, developer turns go."""
    last = _last_user_index(msgs)
    kept = []
    for i, m in enumerate(msgs):
        if i < last and m["role"] == "assistant":
            kept.append({k: v for k, v in m.items() if k != "reasoning_content"})
        elif i >= last or m["role"] != "developer":
            kept.append(m)
    return kept


def _last_user_index(msgs):
    return max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)


def _system_suffix(m):
    suffix = ""
    if m.get("tools"):
        schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in m["tools"])
        suffix += "\n\n" + TOOLS_PROMPT.format(schemas=schemas)
    if m.get("response_format"):
        suffix += "\n\n" + RESPONSE_FORMAT_PROMPT + json.dumps(m["response_format"], ensure_ascii=False)
    return suffix


def _render_tool_calls(tool_calls):
    if not tool_calls:
        return ""
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        params = "\n".join(_render_param(key, value) for key, value in _call_arguments(fn).items())
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return TOOL_CALLS_OPENING + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def _call_arguments(fn):
    """The arguments as a dict: a JSON object string is decoded; anything else (text that is not
    JSON, a non-string value) becomes the single parameter `arguments`."""
    raw = fn.get("arguments")
    try:
        args = json.loads(raw)
    except (TypeError, ValueError):
        return {"arguments": raw}
    if not isinstance(args, dict):
        raise ValueError(f"tool call {fn['name']!r}: arguments must be a JSON object, got {raw!r}")
    return args


def _render_param(key, value):
    # Strings go in verbatim; every other type as JSON, flagged so the parser can tell them apart.
    if isinstance(value, str):
        return f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>'
    return f'<{DSML}parameter name="{key}" string="false">{json.dumps(value, ensure_ascii=False)}</{DSML}parameter>'


INVOKE_CLOSE, PARAM_CLOSE = f"</{DSML}invoke>", f"</{DSML}parameter>"


def _spellings(*tags: str) -> tuple[str, ...]:
    """The tags (written with DSML) with each bar of the marker fullwidth or ASCII: models write all four."""
    return tuple(tag.replace(DSML, f"{a}DSML{b}") for tag in tags for a in "｜|" for b in "｜|")


def _any_of(spellings: tuple[str, ...]) -> str:
    return "(?:" + "|".join(map(re.escape, spellings)) + ")"


# Every spelling of the block's opening (V3.2 named it function_calls), and the endings of a streamed answer
# that may start one.
_CALLS_OPENINGS = _spellings(TOOL_CALLS_START, f"<{DSML}function_calls>")
_CALLS_START = re.compile(_any_of(_CALLS_OPENINGS))
_CALLS_HELD = _CALLS_OPENINGS + tuple("\n\n" + opening for opening in _CALLS_OPENINGS)
_PARAM_CLOSES = _spellings(PARAM_CLOSE)
_PARAM_CLOSE = re.compile(_any_of(_PARAM_CLOSES))
_INVOKE_OPEN = re.compile(_any_of(_spellings(f"<{DSML}invoke")) + ' name="([^"\n]*)">\n?')
# what comes next in an invoke: a parameter's opening tag or the invoke's closing tag
_INVOKE_NEXT = re.compile(_any_of(_spellings(f"<{DSML}parameter"))
                          + ' name="(?P<name>[^"\n]*)" string="(?P<string>true|false)">'
                          + "|" + _any_of(_spellings(INVOKE_CLOSE)))


def checkpoint_encoding(model_dir) -> str:
    """The chat encoding of the checkpoint in `model_dir`: that of the official encoder it ships
    (`encoding/encoding_dsv4.py`: 0731's defines REASONING_EFFORT_PROMPTS), else 0731's for a config
    with a DSpark drafter (released together), else the preview's."""
    from pathlib import Path

    model_dir = Path(model_dir)
    encoder = model_dir / "encoding" / "encoding_dsv4.py"
    if encoder.is_file():
        return "0731" if "REASONING_EFFORT_PROMPTS" in encoder.read_text(encoding="utf-8", errors="replace") \
            else "preview"
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "preview"
    return "0731" if isinstance(config, dict) and config.get("dspark_block_size") else "preview"
