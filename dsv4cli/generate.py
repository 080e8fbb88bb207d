"""`dsv4 generate`: one prompt, streamed to stdout (or one JSON object).

What needs torch (the engine, grammars, OpenAI-shaped results) is imported once the prompt, files and model
directory are checked, so a mistake there is said without waiting for torch."""
import json
import sys

from dsv4cli.config import Settings, read_text_file
from dsv4cli.encoding import THINK_END, encode_messages
from dsv4cli.errors import RunError, UsageError
from dsv4cli.options import CliOptions, check_model_dir, model_options
from dsv4cli.tokenizer import Tokenizer

DIM, RESET = "\x1b[2m", "\x1b[0m"


def read_prompt(s: Settings) -> str:
    """The prompt from --prompt, --prompt-file, or stdin (`-p -`, or no prompt given and stdin not a terminal).
    One trailing newline of a file or stdin is not part of it."""
    if s.prompt is not None and s.prompt_file is not None:
        raise UsageError("--prompt-file: the prompt is also given with --prompt; give one of them")
    if s.prompt is not None and s.prompt != "-":
        return s.prompt
    if s.prompt_file is not None:
        return read_text_file("prompt_file", s.prompt_file)
    if s.prompt is None and sys.stdin.isatty():
        raise UsageError("--prompt: missing; give the text with -p, --prompt-file, or on stdin")
    try:
        text = sys.stdin.buffer.read().decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError:
        raise UsageError("stdin: the prompt is not UTF-8 text") from None
    if not text:
        raise UsageError("--prompt: missing; stdin was empty" if s.prompt is None else "-p -: stdin was empty")
    return text


def prompt_ids(engine, s: Settings, prompt: str, tools: list[dict]) -> list[int]:
    """Chat-encode the prompt (system with the tools + one user turn), or BOS + the text as is with --raw."""
    tok = engine.tok
    if s.raw:
        return [tok.bos_id, *tok.encode(prompt)]
    system = {"role": "system", "content": s.system} | ({"tools": tools} if tools else {})
    messages = ([system] if s.system or tools else []) + [{"role": "user", "content": prompt}]
    text = encode_messages(messages, thinking=s.thinking, reasoning_effort=s.reasoning_effort, encoding=tok.encoding)
    return tok.encode(text)


def split_reasoning(text: str, final: bool) -> tuple[str, str]:
    """(reasoning, answer) of a thinking reply so far. While it streams, an ending that could be the start
    of `</think>` is held back, so the markup never shows."""
    reasoning, found, answer = text.partition(THINK_END)
    if not found and not final:
        held = next((n for n in range(len(THINK_END) - 1, 0, -1) if reasoning.endswith(THINK_END[:n])), 0)
        reasoning = reasoning[: len(reasoning) - held]
    return reasoning, answer


class ReplyStream:
    """Streams a reply: the answer to stdout; in thinking mode the reasoning first, dimmed on a terminal,
    on stderr when stdout is piped (so stdout holds the answer alone). No special tokens are shown."""

    def __init__(self, tok: Tokenizer, thinking: bool):
        self.tok, self.thinking, self.tty = tok, thinking, sys.stdout.isatty()
        self.reasoning = self.answer = 0     # characters of each already written

    def update(self, text: str, final: bool = False) -> None:
        reasoning, answer = split_reasoning(text, final) if self.thinking else ("", text)
        reasoning = self.tok.visible(reasoning, final=final or THINK_END in text)
        answer = self.tok.visible(answer, final)
        if len(reasoning) > self.reasoning:
            chunk = reasoning[self.reasoning:]
            if self.tty:
                sys.stdout.write(DIM + chunk + RESET)
            else:
                sys.stderr.write(chunk)
                sys.stderr.flush()
            self.reasoning = len(reasoning)
        if answer and not self.answer and reasoning:     # the reasoning ends: set it apart from the answer
            (sys.stdout if self.tty else sys.stderr).write("\n\n" if self.tty else "\n")
        sys.stdout.write(answer[self.answer:])
        sys.stdout.flush()
        self.answer = len(answer)


def given_ids(s: Settings) -> list[int] | None:
    """--prompt-ids as token ids (checked against the vocabulary once the model is loaded), or None."""
    if s.prompt_ids is None:
        return None
    for other in ("prompt", "prompt_file", "system", "tools"):
        if getattr(s, other):
            flag = "--" + other.replace("_", "-")
            raise UsageError(f"--prompt-ids: the prompt is given as token ids, used as they are; drop {flag}")
    parts = [p.strip() for p in s.prompt_ids.split(",")]
    bad = next((p for p in parts if not (p.isascii() and p.isdigit())), None)
    if bad is not None:
        raise UsageError(f"--prompt-ids: {bad!r} is not a token id; give ids separated by commas, e.g. 0,17,183")
    return [int(p) for p in parts]


def read_constraint(s: Settings) -> tuple[str, object] | None:
    """--json-schema (its JSON) or --grammar (its text), read before the model loads: ("json_schema" or
    "grammar", what the file holds), or None."""
    if s.json_schema and s.grammar:
        raise UsageError("--grammar: the answer is constrained by --json-schema already; give one of them")
    name = "json_schema" if s.json_schema else "grammar" if s.grammar else None
    if name is None:
        return None
    text = read_text_file(name, getattr(s, name))
    if name == "grammar":
        return name, text
    try:
        return name, json.loads(text)
    except ValueError as e:
        raise UsageError(f"--json-schema {s.json_schema}: not JSON: {e}") from None


def constraint(s: Settings, given: tuple[str, object] | None, engine, thinking: bool, tools: list[dict]):
    """The engine's grammar for what `read_constraint` read (with --tools, the answer or a tool call), or a
    UsageError naming the flag and the problem."""
    if given is None:
        return None
    from dsv4cli.structured import json_grammar, text_grammar, tool_grammar

    name, value = given
    tok, vocab = engine.tok, engine.model_info.vocab_size
    try:
        if name == "grammar":
            return text_grammar(value, tok, vocab, thinking)
        if tools:
            return tool_grammar(tools, "auto", tok, vocab, thinking, value)
        return json_grammar(value, tok, vocab, thinking)
    except ValueError as e:
        raise UsageError(f"--{name.replace('_', '-')} {getattr(s, name)}: {e}") from None


def run_generate(s: Settings) -> int:
    ids = given_ids(s)
    prompt = read_prompt(s) if ids is None else None
    if s.tools and s.raw:
        raise UsageError("--tools: a --raw prompt has no chat template to render tools into")
    given = read_constraint(s)
    check_model_dir(s)
    from dsv4cli.loading import load_engine, load_tools, sampling_params

    tools = load_tools(s.tools, "--tools") if s.tools else []
    engine = load_engine(s, "generate")
    if ids is None:
        ids = prompt_ids(engine, s, prompt, tools)
    elif (bad := next((t for t in ids if t >= engine.tok.vocab_size), None)) is not None:
        raise UsageError(f"--prompt-ids: {bad} is not a token id of this model (0..{engine.tok.vocab_size - 1})")
    # a raw prompt, or one of token ids, opens no reasoning
    thinking = s.thinking and not s.raw and s.prompt_ids is None
    params = sampling_params(s)
    params.grammar = constraint(s, given, engine, thinking, tools)
    if s.logprobs is not None and not s.json:
        print("warning: --logprobs: shown only with --json; ignored", file=sys.stderr)
        params.logprobs = None
    try:
        seq = engine.submit(ids, params)
    except ValueError as e:
        raise UsageError(str(e)) from None
    stream = None if s.json else ReplyStream(engine.tok, thinking)
    try:
        while engine.has_work():
            engine.step()
            if stream:
                stream.update(seq.text[: seq.emitted])
    except KeyboardInterrupt:
        engine.cancel(seq)
    if seq.error is not None:
        raise RunError(seq.error)
    reasoning, answer = split_reasoning(seq.text, final=True) if thinking else ("", seq.text)
    if s.json:
        from dsv4cli.openai.responses import chat_logprobs, tool_calls, visible_message

        # the text without special tokens; token_ids keep every token
        result = {"text": engine.tok.visible(answer),
                  **({"reasoning_content": engine.tok.visible(reasoning)} if thinking else {}),
                  "token_ids": seq.output_ids, "finish_reason": seq.finish_reason}
        parsed = visible_message(engine.tok, seq.text, thinking) if tools else None
        if parsed and parsed["tool_calls"]:    # the text before the calls, and the calls in OpenAI form
            result |= {"text": parsed["content"], "tool_calls": tool_calls(parsed["tool_calls"], ""),
                       "finish_reason": "tool_calls" if seq.finish_reason == "stop" else seq.finish_reason}
        if s.logprobs is not None:
            result["logprobs"] = chat_logprobs(engine.tok, seq.logprobs)["content"]
        drafting = {"drafter": engine.model_info.drafter if engine.draft_depth else None,
                    "drafts_setting": engine.drafts, "verify": engine.verify}
        print(json.dumps(result | {"stats": seq.metrics.as_dict() | drafting}))
    else:
        stream.update(seq.text[: seq.emitted], final=True)
        sys.stdout.write("\n")
    return 130 if seq.finish_reason == "cancelled" else 0


@model_options("prompt", "prompt_file", "prompt_ids", "raw", "json", "system", "system_file", "thinking",
               "reasoning_effort", "tools", "json_schema", "grammar")
def generate(opts: CliOptions) -> int:
    settings, _ = opts.resolve()
    return run_generate(settings)
