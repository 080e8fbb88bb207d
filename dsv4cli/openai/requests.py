"""OpenAI request bodies -> requests the engine can run, or a BadRequest with a code and a message.

`dsv4 batch` (one body per input line) and `dsv4 serve` (one per HTTP request) parse bodies here, so both
follow one field policy: every body field is honoured, accepted as harmless (HARMLESS, with the reason),
or refused with an error naming it; no field is silently dropped (README, "Request fields").
"""
import dataclasses
import difflib
import functools
import json
import re
from dataclasses import dataclass

from dsv4cli.config import SAMPLING_KEYS, check
from dsv4cli.encoding import encode_messages, is_tool
from dsv4cli.engine import TOP_LOGPROBS, SamplingParams
from dsv4cli.errors import UsageError
from dsv4cli.structured import (
    ANY_OBJECT,
    LARK_START,
    choice_grammar,
    json_grammar,
    regex_grammar,
    text_grammar,
    tool_grammar,
)
from dsv4cli.tokenizer import Tokenizer

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"

# body field -> sampling settings key, the values checked by the same rules as the flags: every sampling key
# under its own name but logprobs (OpenAI spells it differently, see _logprobs), and OpenAI's newer name
# for max_tokens
SAMPLING_FIELDS = {name: name for name in SAMPLING_KEYS if name != "logprobs"} | {"max_completion_tokens": "max_tokens"}
# fields read elsewhere in this module
# sampling fields the Anthropic and Responses translators hand on as they are: the extensions chat completions
# takes (top_k, min_p, seed, ...), but the length and stop fields, which those APIs name their own way
PASSED_SAMPLING = {name for name in SAMPLING_FIELDS if name not in ("max_tokens", "max_completion_tokens", "stop")}
HONOURED = {"messages", "prompt", "stream", "n", "best_of", "echo", "thinking", "reasoning_effort", "logprobs",
            "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "logit_bias", "response_format",
            "prompt_logprobs", "chat_template_kwargs", "skip_special_tokens", "include_stop_str_in_output",
            "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
            "continue_final_message", "add_generation_prompt"}
# fields only a chat body has (they shape the rendered conversation or the tool calls)
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "continue_final_message",
             "add_generation_prompt")
# vLLM's ways of constraining a reply (besides response_format), by the kind of constraint each gives
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")       # vLLM's structured_outputs object: one of them
TEMPLATE_KWARGS = ("thinking", "reasoning_effort")              # what chat_template_kwargs may set (DeepSeek's)
# accepted and without effect, for this reason
HARMLESS = {
    "model": "a run serves the one model given by --model",
    "user": "an end-user id for abuse monitoring: nothing to monitor offline",
    "metadata": "tags for stored completions (OpenAI's limits checked): nothing is stored",
    "store": "nothing is stored",
    "stream_options": "options of streaming, which batch requests do not do (honoured by dsv4 serve)",
}
# fields known to be unsupported, with what to do instead
REFUSED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "functions": "deprecated; use tools",
    "function_call": "deprecated; use tool_choice",
    "web_search_options": "web search is not supported",
    "suffix": "insertion (suffix) is not supported",
}
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}     # response_format's json_schema object
MAX_STOP = 4                                          # OpenAI's limit on stop strings
MAX_CHOICES = 128                                     # OpenAI's limit on n
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512      # OpenAI's limits on `metadata`
MAX_PROMPTS = 2048                                    # prompts in one completion (evaluation harnesses batch them)
TOKENIZE_CHAT_FIELDS = {"messages", "tools", "tool_choice", "thinking", "reasoning_effort", "chat_template_kwargs",
                        "add_generation_prompt", "continue_final_message"}
# what a JSON text holding a lone surrogate has: a \uD800-\uDFFF escape, or one encoded as (invalid) UTF-8, which
# json.loads passes through too (its lead byte 0xED also starts Hangul; looking for these is memchr-fast)
SURROGATE_SIGNS = (b"\\ud", b"\\uD", b"\xed")


@dataclass
class Request:
    chat: bool                      # /v1/chat/completions; else /v1/completions
    prompts: list[list[int]]        # one; completions in dsv4 serve: several (n choices each, in order)
    params: SamplingParams
    thinking: bool
    stream: bool = False            # send chunks as they come (dsv4 serve only)
    include_usage: bool = False     # stream_options.include_usage: a last chunk with the usage
    n: int = 1                      # choices returned (dsv4 serve only)
    best_of: int = 1                # candidates generated, the n most likely returned (completions, dsv4 serve)
    echo: list[str] | None = None   # completions with echo: each prompt's text, which its choices' texts start with
    parallel_tool_calls: bool = True    # false: one tool call at most (a forced call's grammar; else the first)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: each choice lists its prompt's, N alternatives
    skip_special_tokens: bool = True    # vLLM's: the reply text without special tokens; false: with them
    include_stop_str: bool = False      # vLLM's include_stop_str_in_output: a reply a stop string ended keeps it

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0]


class BadRequest(Exception):
    """A body that cannot run: an OpenAI error code (e.g. `unsupported_parameter`) and a message that
    names the field."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def renamed(e: BadRequest, names: dict[str, str]) -> BadRequest:
    """A chat body's error as a translated API names the field: `stop: ...` -> `stop_sequences: ...`."""
    field = re.match(r"\w+", e.message)
    if field is None or field[0] not in names:
        return e
    return BadRequest(e.code, names[field[0]] + e.message[field.end():])


def refuse_unknown(value: dict, known, place: str) -> None:
    """An object's keys against those known: the first other one is an error naming it (`place.key`)."""
    if (key := next((k for k in value if k not in known), None)) is not None:
        raise BadRequest("unsupported_parameter", f"{place}.{key}: not supported")


def load_json(raw: bytes):
    """A request's JSON text -> its value, or BadRequest: not JSON, nested deeper than the decoder goes, or
    holding a string that is not Unicode (a lone surrogate such as \\ud800, which no tokenizer or UTF-8
    writer takes)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadRequest("invalid_json", "not valid JSON: nested too deeply") from None
    except ValueError as e:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest("invalid_json", f"not valid JSON: {e}") from None
    if any(sign in raw for sign in SURROGATE_SIGNS) and (place := _not_unicode(value)) is not None:
        raise BadRequest("invalid_json", f"{place}: not valid Unicode (a lone surrogate such as \\ud800)")
    return value


def _not_unicode(value) -> str | None:
    """Where in a JSON value a string or key holds a lone surrogate, as `messages[0].content` (a key by its
    ascii(), so the message stays writable); None if nowhere. Iterative: values nest as deep as json.loads goes."""
    todo = [(value, "")]
    while todo:
        v, place = todo.pop()
        if isinstance(v, str):
            if not _is_unicode(v):
                return place or "the body"
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _is_unicode(k):
                    return f"{place}.{ascii(k)}" if place else ascii(k)
                todo.append((item, f"{place}.{k}" if place else k))
        elif isinstance(v, list):
            todo += ((item, f"{place}[{i}]") for i, item in enumerate(v))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class BodyRules:
    """What a body is read against besides the sampling defaults: thinking and its effort for a body that names
    neither, the limits on a request's size (`max_messages`, None: none; `max_prompt_tokens`, None:
    max_seq_len - 1), and the model's vocabulary size grammars are checked against (None: the tokenizer's)."""
    thinking: bool = False
    reasoning_effort: str | None = None
    max_messages: int | None = None
    max_prompt_tokens: int | None = None
    vocab: int | None = None


class BodyParser:
    """Parses request bodies against the run's sampling defaults, max_seq_len and `rules`."""

    def __init__(self, tok: Tokenizer, defaults: SamplingParams, max_seq_len: int, rules: BodyRules = BodyRules()):
        self.tok, self.defaults, self.max_seq_len = tok, defaults, max_seq_len
        self.vocab = rules.vocab or tok.vocab_size
        self.thinking, self.reasoning_effort = rules.thinking, rules.reasoning_effort
        self.max_messages = rules.max_messages
        fits = max_seq_len - 1                          # the reply needs a position too
        self.max_prompt_tokens = min(rules.max_prompt_tokens or fits, fits)
        self.prompt_limit = (f"max_prompt_tokens is {rules.max_prompt_tokens}" if self.max_prompt_tokens < fits
                             else f"max_seq_len is {max_seq_len}")

    def parse(self, body, chat: bool, place: str = "", seed: int | None = None, server: bool = False,
              extra: tuple[str, ...] = ()) -> Request:
        """One body -> Request, or raise BadRequest. `place` prefixes field names in messages ("body."),
        `seed` is the seed of a body that names none, `server` whether the body came to dsv4 serve (which
        streams, returns n choices and echoes; batch does not), `extra` fields the caller reads itself."""
        if not isinstance(body, dict):
            raise BadRequest("invalid_request", f"{place.rstrip('.') or 'the body'}: must be a JSON object")
        _check_fields(body, place, extra)
        check_metadata(body.get("metadata"), place)
        stream = body.get("stream")
        if server and stream is not None and not isinstance(stream, bool):
            raise BadRequest("invalid_parameter", f"{place}stream: must be true or false")
        if stream and not server:
            raise BadRequest("unsupported_parameter", f"{place}stream: batch requests cannot stream")
        include_usage = _stream_options(body, place) if server else False
        n, best_of = _choices(body, place, chat, server)
        fmt = _response_format(body, place)
        constraint = _constraint(body, place, fmt)
        echo = _echo(body, place, chat)
        prompt_logprobs = _prompt_logprobs(body, place)
        if prompt_logprobs is not None and stream:
            raise BadRequest("unsupported_parameter", f"{place}prompt_logprobs: not streamed; ask without stream "
                                                      f"(or, on {COMPLETIONS_URL}, with echo and logprobs)")
        params = self._params(body, place, seed, scoring=echo or prompt_logprobs is not None)
        params.logprobs = _logprobs(body, place, chat)
        params.logit_bias = self._logit_bias(body.get("logit_bias"), place)
        # the prompt's logprobs, for vLLM's field or echoed with the reply's (OpenAI's legacy scoring)
        scored = [v for v in (prompt_logprobs, params.logprobs if echo else None) if v is not None]
        params.prompt_logprobs = max(scored, default=None)
        thinking, tools, choice = False, [], "auto"
        if chat:
            thinking, effort = self._thinking(_with_template_kwargs(body, place), place)
            tools, choice = _tools(body, place)
            prompts = [(self._chat_ids(body, place, thinking, effort, tools, fmt), None)]
        else:
            for name in CHAT_ONLY:
                if name in body:
                    raise BadRequest("unsupported_parameter", f"{place}{name}: only for {CHAT_URL}")
            prompts = self._completion_prompts(body, place, server)
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise BadRequest("invalid_parameter", f"{place}parallel_tool_calls: must be true or false")
        params.grammar = self._grammar(constraint, tools, choice, thinking, place, parallel)
        if params.grammar is not None and params.ignore_eos:
            raise BadRequest("invalid_parameter", f"{place}ignore_eos: not with response_format, guided_*, "
                                                  f"structured_outputs or a forced tool call (the grammar says where "
                                                  f"the reply ends)")
        echoed = [text if text is not None else self.tok.decode(ids) for ids, text in prompts] if echo else None
        return Request(chat, [ids for ids, _ in prompts], params, thinking, bool(stream), include_usage, n, best_of,
                       echoed, parallel, prompt_logprobs, _flag(body, "skip_special_tokens", True, place),
                       _flag(body, "include_stop_str_in_output", False, place))

    def tokenize(self, body) -> tuple[list[int], bool]:
        """A `/tokenize` body (vLLM's) -> the prompt's token ids, and whether each token's text is wanted
        (`return_token_strs`). `prompt` (with `add_special_tokens`, default true: BOS before a text) is
        tokenised as a completion's prompt; `messages` (with `tools`, `tool_choice`, `thinking`,
        `reasoning_effort`) as a chat request's, whose template starts with BOS whatever `add_special_tokens`
        says (vLLM's meaning: the tokenizer adds nothing to a template)."""
        if not isinstance(body, dict):
            raise BadRequest("invalid_request", "the body: must be a JSON object")
        chat = "messages" in body
        if chat == ("prompt" in body):
            raise BadRequest("invalid_request", "give exactly one of messages or prompt")
        fields = {"model", "return_token_strs", "add_special_tokens"} | (TOKENIZE_CHAT_FIELDS if chat else {"prompt"})
        for name in body:
            if name not in fields:
                raise BadRequest("unsupported_parameter", f"{name}: not a field of a /tokenize body with "
                                                          f"{'messages' if chat else 'prompt'}")
        flags = {name: _flag(body, name, default, "") for name, default in (("add_special_tokens", True),
                                                                             ("return_token_strs", False))}
        if chat:
            thinking, effort = self._thinking(_with_template_kwargs(body, ""), "")
            return self._chat_ids(body, "", thinking, effort, _tools(body, "")[0]), flags["return_token_strs"]
        prompt = body.get("prompt")
        if isinstance(prompt, str) and not flags["add_special_tokens"]:
            return self._encode(prompt, []), flags["return_token_strs"]
        return self._completion_ids(prompt, "prompt"), flags["return_token_strs"]

    def detokenize(self, body) -> list[int]:
        """A `/detokenize` body (vLLM's: `tokens`, and `model`) -> the token ids to decode."""
        if not isinstance(body, dict):
            raise BadRequest("invalid_request", "the body: must be a JSON object")
        for name in body:
            if name not in ("model", "tokens"):
                raise BadRequest("unsupported_parameter", f"{name}: not a field of a /detokenize body")
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise BadRequest("invalid_parameter", "tokens: must be a list of token ids")
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.tok.vocab_size:
                raise BadRequest("invalid_parameter", f"tokens[{i}]: must be a token id (0..{self.tok.vocab_size - 1})")
        return tokens

    def _grammar(self, constraint: tuple[str, str, object] | None, tools: list, choice, thinking: bool, place: str,
                 parallel: bool):
        """What the reply must match: the forced tool calls (tool_choice required or named), else the
        constraint (`_constraint`): JSON (or, with tools offered, that JSON or tool calls), a regex, one of
        some choices or a Lark grammar; one call at most without `parallel`; None: free text."""
        name, kind, value = constraint or (None, None, None)
        forced = choice == "required" or isinstance(choice, dict)
        if forced and name is not None and name != "response_format":
            raise BadRequest("invalid_parameter", f"{place}{name}: not with tool_choice {json.dumps(choice)}: only "
                                                  f"one way of constraining a reply")
        schema = value if kind == "json" else None
        calls = forced or (schema is not None and tools)
        try:
            if calls:
                return tool_grammar(tools, choice, self.tok, self.vocab, thinking, schema, parallel)
            grammars = {"json": json_grammar, "regex": regex_grammar, "choice": choice_grammar,
                        "grammar": text_grammar}
            return None if kind is None else grammars[kind](value, self.tok, self.vocab, thinking)
        except ValueError as e:
            raise BadRequest("invalid_parameter", f"{place}{'tools' if calls else name}: {e}") from None

    def _params(self, body: dict, place: str, seed: int | None, scoring: bool) -> SamplingParams:
        """The run's sampling defaults with the body's values on top; `scoring` (echo or prompt_logprobs):
        max_tokens may be 0, the prompt scored and nothing generated."""
        given = {}
        for name, key in SAMPLING_FIELDS.items():
            value = body.get(name)
            if key == "max_tokens" and value == 0 and type(value) is int and scoring:
                given[key] = 0
            elif value is not None:
                given[key] = _check(key, [value] if name == "stop" and isinstance(value, str) else value, place + name)
        if len(given.get("stop", [])) > MAX_STOP:
            raise BadRequest("invalid_parameter", f"{place}stop: at most {MAX_STOP} strings")
        if seed is not None:
            given.setdefault("seed", seed)
        params = dataclasses.replace(self.defaults, **given)
        if params.min_tokens > params.max_tokens:
            raise BadRequest("invalid_parameter", f"{place}min_tokens: at most max_tokens ({params.max_tokens}), got "
                                                  f"{params.min_tokens}")
        return params

    def _thinking(self, body: dict, place: str) -> tuple[bool, str | None]:
        """Whether the reply reasons, and how hard: `thinking`, else a `reasoning_effort` asks for it (an effort
        means "reason", as in OpenAI's API), else the run's setting."""
        thinking = body.get("thinking", self.thinking if body.get("reasoning_effort") is None else True)
        if isinstance(thinking, dict):    # the DeepSeek API spelling: {"type": "enabled"}
            thinking = thinking.get("type") == "enabled"
        effort = body.get("reasoning_effort")
        if effort is not None:
            effort = _check("reasoning_effort", effort, place + "reasoning_effort")
        return _check("thinking", thinking, place + "thinking"), effort or self.reasoning_effort

    def _logit_bias(self, bias, place: str) -> dict[int, float]:
        """OpenAI's {"token id": bias in [-100, 100]} -> {id: bias}."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise BadRequest("invalid_parameter", f"{place}logit_bias: must be an object of token id -> bias")
        out = {}
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and int(key) < self.tok.vocab_size):   # not "²" nor "٣"
                raise BadRequest("invalid_parameter", f"{place}logit_bias: {key!r} is not a token id "
                                                   f"(0..{self.tok.vocab_size - 1})")
            if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
                raise BadRequest("invalid_parameter", f"{place}logit_bias[{key}]: must be a number in -100..100")
            out[int(key)] = float(value)
        return out

    def _chat_ids(self, body: dict, place: str, thinking: bool, effort: str | None, tools: list,
                  fmt: dict | None = None) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("invalid_messages", f"{place}messages: must be a non-empty list of messages")
        if self.max_messages is not None and len(messages) > self.max_messages:
            raise BadRequest("too_many_messages", f"{place}messages: {len(messages)} messages; at most "
                                                  f"{self.max_messages} (max_messages)")
        messages = [_plain(m) for m in messages]
        if _continues(body, place, messages, thinking):
            messages[-1] = {**messages[-1], "wo_eos": True}     # rendered open: the reply goes on from its end
        self._refuse_long(sum(len(m["content"]) for m in messages if isinstance(m, dict)
                              and isinstance(m.get("content"), str)), 0)
        # DSV4 renders tools and the response format on a system message: the first one, or a new empty one
        shown = ({"tools": tools} if tools else {}) | ({"response_format": fmt} if fmt else {})
        if shown:
            first = messages[0] if isinstance(messages[0], dict) and messages[0].get("role") == "system" else None
            messages = [{**(first or {"role": "system", "content": ""}), **shown}] + messages[first is not None:]
        try:
            text = encode_messages(messages, thinking=thinking, reasoning_effort=effort, encoding=self.tok.encoding)
        except ValueError as e:
            raise BadRequest("invalid_messages", f"{place}messages: {e}") from None
        except RecursionError:          # a tool's schema or a call's arguments nested deeper than json.dumps goes
            raise BadRequest("invalid_messages", f"{place}messages: nested too deeply") from None
        return self._encode(text, [])

    def _completion_prompts(self, body: dict, place: str, server: bool) -> list[tuple[list[int], str | None]]:
        """A completion's prompts, each as token ids and its text (None where given as ids): OpenAI's four forms,
        a text, token ids, or a list of either (several prompts: dsv4 serve only, a batch line is one request)."""
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt)):
            return [(self._completion_ids(prompt, f"{place}prompt"), prompt if isinstance(prompt, str) else None)]
        if len(prompt) > 1 and not server:
            raise BadRequest("unsupported_parameter", f"{place}prompt: a batch line gives one prompt; give each "
                                                      f"its own line (and custom_id)")
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest("invalid_parameter", f"{place}prompt: {len(prompt)} prompts; at most {MAX_PROMPTS}")
        return [(self._completion_ids(p, f"{place}prompt[{i}]"), p if isinstance(p, str) else None)
                for i, p in enumerate(prompt)]

    def _completion_ids(self, prompt, name: str) -> list[int]:
        """One completion prompt: a text (BOS, then its tokens), or token ids used as they are (OpenAI's other
        form). `name` names it in errors."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < self.tok.vocab_size), None)
            if bad is not None:
                raise BadRequest("invalid_prompt", f"{name}: {bad} is not a token id (0..{self.tok.vocab_size - 1})")
            if len(prompt) > self.max_prompt_tokens:
                raise BadRequest("prompt_too_long", f"the prompt has {len(prompt)} tokens; at most "
                                                    f"{self.max_prompt_tokens} fit ({self.prompt_limit})")
            return list(prompt)
        if not isinstance(prompt, str):
            raise BadRequest("invalid_prompt", f"{name}: must be a string or a non-empty list of token ids (or, for "
                                               f"several prompts, a list of those)")
        return self._encode(prompt, [self.tok.bos_id])

    def _encode(self, text: str, ids: list[int]) -> list[int]:
        """`ids` followed by the text's tokens, refused when there are more than max_prompt_tokens."""
        self._refuse_long(len(text), len(ids))
        ids = ids + self.tok.encode(text)
        if len(ids) > self.max_prompt_tokens:
            raise BadRequest("prompt_too_long", f"the prompt has {len(ids)} tokens; at most {self.max_prompt_tokens} "
                                                f"fit ({self.prompt_limit})")
        return ids

    def _refuse_long(self, chars: int, ids: int) -> None:
        """Refuse a prompt of `ids` tokens and a text of `chars` characters when its length alone makes it too
        long: before the work of rendering and tokenising it, which is long for a prompt of megabytes
        (docs/decisions.md: Server)."""
        if chars + ids > self.max_prompt_tokens:       # else even a token per character fits
            least = -(-chars // self._longest_token) + ids
            if least > self.max_prompt_tokens:
                raise BadRequest("prompt_too_long", f"the prompt has at least {least} tokens; at most "
                                                    f"{self.max_prompt_tokens} fit ({self.prompt_limit})")

    @functools.cached_property
    def _longest_token(self) -> int:
        """The most characters one token stands for: a text of c characters has at least c / this many tokens."""
        return max(len(self.tok.decode([i])) for i in range(self.tok.vocab_size))


def _check(key: str, value, place: str):
    """A body value checked by the rules of the settings key; one body's mistake must not reach the engine."""
    try:
        return check(key, value, place)
    except UsageError as e:
        raise BadRequest("invalid_parameter", str(e)) from None


def check_metadata(metadata, place: str = "") -> None:
    """OpenAI's `metadata` (None: none): at most 16 pairs, keys of at most 64 characters, string values of at most
    512, as its API limits them (a server keeps them with what it stores)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS:
        raise BadRequest("invalid_parameter", f"{place}metadata: must be an object of at most {METADATA_PAIRS} "
                                              f"key-value pairs")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY:
            raise BadRequest("invalid_parameter", f"{place}metadata: key {key[:METADATA_KEY]!r}...: at most "
                                                  f"{METADATA_KEY} characters")
        if not isinstance(value, str) or len(value) > METADATA_VALUE:
            raise BadRequest("invalid_parameter", f"{place}metadata: the value of {key!r} must be a string of at most "
                                                  f"{METADATA_VALUE} characters")


def _check_fields(body: dict, place: str, extra: tuple[str, ...]) -> None:
    """The field policy: a field that is neither honoured nor harmless is an error naming it (and the closest
    known field, where a typo is likely)."""
    known = [*SAMPLING_FIELDS, *HONOURED, *HARMLESS, *extra]
    for name in body:
        if name in REFUSED:
            raise BadRequest("unsupported_parameter", f"{place}{name}: {REFUSED[name]}")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise BadRequest("unsupported_parameter", f"{place}{name}: not a supported request field{hint}")


def _flag(body: dict, name: str, default: bool, place: str) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest("invalid_parameter", f"{place}{name}: must be true or false")
    return value


def _with_template_kwargs(body: dict, place: str) -> dict:
    """The body with vLLM's chat_template_kwargs under it: DeepSeek's template switches, `thinking` and
    `reasoning_effort`, which the body's own fields override."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return body
    if not isinstance(kwargs, dict):
        raise BadRequest("invalid_parameter", f'{place}chat_template_kwargs: must be an object such as '
                                              f'{{"thinking": true}}')
    refuse_unknown(kwargs, TEMPLATE_KWARGS, f"{place}chat_template_kwargs")
    return kwargs | body


def _continues(body: dict, place: str, messages: list, thinking: bool) -> bool:
    """Whether the reply continues the last (assistant) message, vLLM's `continue_final_message` (with
    `add_generation_prompt: false`), rather than opening a reply of its own (the defaults)."""
    opens, continues = (_flag(body, "add_generation_prompt", True, place),
                        _flag(body, "continue_final_message", False, place))
    if opens == continues:
        name = "continue_final_message" if continues else "add_generation_prompt"
        raise BadRequest("invalid_parameter", f"{place}{name}: exactly one of add_generation_prompt (a new reply, the "
                                              f"default) and continue_final_message (the last message continued) "
                                              f"must be true")
    if not continues:
        return False
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant" or last.get("tool_calls"):
        raise BadRequest("invalid_parameter", f"{place}continue_final_message: the last message must be an "
                                              f"assistant's, without tool_calls")
    if thinking:
        raise BadRequest("invalid_parameter", f"{place}continue_final_message: only without thinking (the "
                                              f"message continued is the answer, after the reasoning)")
    return True


def _constraint(body: dict, place: str, fmt: dict | None) -> tuple[str, str, object] | None:
    """What the reply must match besides tool calls: (the field asking, its kind: json, regex, choice or grammar,
    the schema or text), from response_format, vLLM's guided_* fields or its structured_outputs; None: nothing.
    One way of constraining a request: a second is an error naming it."""
    given = []
    for name, value in body.items():
        if name == "response_format" and fmt is not None:
            given.append((name, "json", fmt.get("json_schema", {}).get("schema", ANY_OBJECT)))
        elif name in GUIDED and value is not None:
            given.append((name, GUIDED[name], value))
        elif name == "structured_outputs" and value is not None:
            if not isinstance(value, dict) or len(value) != 1:
                raise BadRequest("invalid_parameter", f"{place}{name}: must be an object of one of "
                                                      f"{', '.join(STRUCTURED_KINDS)}")
            refuse_unknown(value, STRUCTURED_KINDS, f"{place}{name}")
            kind, value = next(iter(value.items()))
            given.append((f"{name}.{kind}", kind, value))
    if len(given) > 1:
        raise BadRequest("invalid_parameter", f"{place}{given[1][0]}: not with {given[0][0]}: only one way of "
                                              f"constraining a reply")
    if not given:
        return None
    name, kind, value = given[0]
    if kind == "json" and isinstance(value, str):       # a schema given as its JSON text
        try:
            value = json.loads(value)
        except ValueError as e:
            raise BadRequest("invalid_parameter", f"{place}{name}: not JSON: {e}") from None
    wanted = {"json": "a JSON schema (an object, or its JSON text)", "regex": "a regular expression (a string)",
              "choice": "a non-empty list of strings", "grammar": "a Lark grammar (a string defining start)"}[kind]
    right = {"json": isinstance(value, dict), "regex": isinstance(value, str),
             "choice": isinstance(value, list) and value and all(isinstance(c, str) for c in value),
             "grammar": isinstance(value, str) and LARK_START.search(value)}[kind]
    if not right:
        raise BadRequest("invalid_parameter", f"{place}{name}: must be {wanted}")
    return name, kind, value


def _choices(body: dict, place: str, chat: bool, server: bool) -> tuple[int, int]:
    """(n, best_of): how many choices to return, and how many candidates to generate for them (completions'
    best_of: the n with the highest cumulative logprob are returned)."""
    n, best_of = body.get("n"), body.get("best_of")
    for name, value in (("n", n), ("best_of", best_of)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
            raise BadRequest("invalid_parameter", f"{place}{name}: must be an integer 1..{MAX_CHOICES}")
        if value > 1 and not server:
            raise BadRequest("unsupported_parameter", f"{place}{name}: a batch line gives one choice; repeat the "
                                                      f"line (with another custom_id) for more")
    if best_of is not None and chat:
        raise BadRequest("unsupported_parameter", f"{place}best_of: only for {COMPLETIONS_URL}")
    n = n or 1
    best_of = best_of or n
    if best_of < n:
        raise BadRequest("invalid_parameter", f"{place}best_of: must be at least n ({n})")
    if best_of > n and body.get("stream"):
        raise BadRequest("invalid_parameter", f"{place}best_of: cannot stream (the best are known at the end)")
    return n, best_of


def _echo(body: dict, place: str, chat: bool) -> bool:
    """Whether a completion's text starts with its prompt (and, with logprobs, its logprobs with the prompt's)."""
    echo = body.get("echo")
    if echo is None:
        return False
    if not isinstance(echo, bool):
        raise BadRequest("invalid_parameter", f"{place}echo: must be true or false")
    if echo and chat:
        raise BadRequest("unsupported_parameter", f"{place}echo: only for {COMPLETIONS_URL}")
    return echo


def _prompt_logprobs(body: dict, place: str) -> int | None:
    """vLLM's prompt_logprobs: each prompt token's logprob and the N most likely (None: off)."""
    n = body.get("prompt_logprobs")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= TOP_LOGPROBS):
        raise BadRequest("invalid_parameter", f"{place}prompt_logprobs: must be an integer 0..{TOP_LOGPROBS}")
    return n


def _stream_options(body: dict, place: str) -> bool:
    """Whether a streamed reply ends with a usage chunk (`stream_options: {"include_usage": true}`)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise BadRequest("invalid_parameter", f"{place}stream_options: only allowed with stream: true")
    if not isinstance(options, dict) or any(k != "include_usage" for k in options):
        raise BadRequest("invalid_parameter", f'{place}stream_options: must be {{"include_usage": true or false}}')
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise BadRequest("invalid_parameter", f"{place}stream_options.include_usage: must be true or false")
    return usage


def _logprobs(body: dict, place: str, chat: bool) -> int | None:
    """How many alternatives to report per token (None: no logprobs). Chat: logprobs true and
    top_logprobs 0..20; completions: logprobs 0..20."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat and logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("invalid_parameter", f"{place}logprobs: must be true or false")
    count = top if chat else logprobs
    name = "top_logprobs" if chat else "logprobs"
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= TOP_LOGPROBS):
        raise BadRequest("invalid_parameter", f"{place}{name}: must be an integer 0..{TOP_LOGPROBS}")
    if not chat:
        if top is not None:
            raise BadRequest("unsupported_parameter", f"{place}top_logprobs: only for {CHAT_URL}; give logprobs N")
        return count
    if top is not None and not logprobs:
        raise BadRequest("invalid_parameter", f"{place}top_logprobs: needs logprobs: true")
    return (top or 0) if logprobs else None


def _tools(body: dict, place: str) -> tuple[list, str | dict]:
    """The tools to render (none with tool_choice "none") and the tool choice: auto, none, required (some
    call of an offered tool) or a named function (a call of it); the last two are enforced (`_grammar`)."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
        and isinstance(choice["function"].get("name"), str)
    if choice not in ("auto", "none", "required") and not named:
        raise BadRequest("invalid_parameter", f'{place}tool_choice: must be auto, none, required or {{"type": '
                                              f'"function", "function": {{"name": ...}}}}, got {json.dumps(choice)}')
    if tools is not None and (not isinstance(tools, list) or not all(is_tool(t) for t in tools)):
        raise BadRequest("invalid_parameter",
                      f'{place}tools: must be a list of {{"type": "function", "function": {{"name": ..., ...}}}}')
    tools = tools or []
    if (choice == "required" or named) and not tools:
        raise BadRequest("invalid_parameter", f"{place}tool_choice: {json.dumps(choice)} needs tools to call")
    if named and choice["function"]["name"] not in [t["function"]["name"] for t in tools]:
        raise BadRequest("invalid_parameter", f"{place}tool_choice: {choice['function']['name']!r} is not one of "
                                              f"the offered tools")
    # "none": the model is not shown the tools, so it has nothing to call (rendering them and then
    # ignoring a call would return DSML markup as the answer)
    return ([] if choice == "none" else tools), choice


def _response_format(body: dict, place: str) -> dict | None:
    """The response format the reply must follow: {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}, enforced whether strict or not; None: text."""
    fmt, name = body.get("response_format"), f"{place}response_format"
    if fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text" and len(fmt) == 1:
        return None
    kinds = '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}'
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise BadRequest("invalid_parameter", f"{name}: must be {kinds}")
    extra = next((k for k in fmt if k not in ("type", "json_schema")), None)
    if extra is not None or (fmt["type"] == "json_object") == ("json_schema" in fmt):
        raise BadRequest("invalid_parameter", f"{name}: must be {kinds}")
    spec = fmt.get("json_schema")
    if spec is None:
        return fmt
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise BadRequest("invalid_parameter", f"{name}.json_schema.schema: missing; give the JSON schema (an object)")
    if unknown := next((k for k in spec if k not in JSON_SCHEMA_FIELDS), None):
        raise BadRequest("unsupported_parameter", f"{name}.json_schema.{unknown}: not a field of json_schema "
                                                  f"({', '.join(sorted(JSON_SCHEMA_FIELDS))})")
    return fmt


def _plain(message):
    """OpenAI content parts [{"type": "text", "text": ...}, ...] -> one string; anything else as is."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return {**message, "content": "".join(str(p.get("text", "")) for p in content)}
    return message
