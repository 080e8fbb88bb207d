"""Finished sequences -> OpenAI `chat.completion` / `text_completion` bodies, and a reply streamed as
`chat.completion.chunk` / `text_completion` chunks; `dsv4 batch` and `dsv4 serve` both build them here."""
import time

from dsv4cli.encoding import EOS, THINK_END, parse_completion, split_tool_calls, tool_calls_so_far
from dsv4cli.engine import Sequence, TokenLogprob
from dsv4cli.tokenizer import Tokenizer

from .requests import Request


def chat_logprobs(tok: Tokenizer, logprobs: list[TokenLogprob]) -> dict:
    """OpenAI chat `choices[].logprobs`: per output token its text, UTF-8 bytes, logprob and alternatives."""
    def entry(token: int, logprob: float) -> dict:
        text = tok.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(e.token, e.logprob) | {"top_logprobs": [entry(t, v) for t, v in e.top]}
                        for e in logprobs], "refusal": None}


def completion_logprobs(tok: Tokenizer, logprobs: list[TokenLogprob], n_top: int, offset: int = 0,
                        skip_special: bool = True) -> dict:
    """OpenAI completions `choices[].logprobs`: parallel lists, the `n_top` alternatives keyed by their text
    (null for an echoed prompt's first token, which nothing predicts); `offset` is where the first token's text
    starts in the reply (a streamed chunk's tokens start mid-reply), which shows no special tokens
    (`skip_special`) or shows them."""
    tokens = [tok.decode([e.token]) for e in logprobs]
    offsets = [offset + sum(len(shown(tok, t, skip_special)) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in logprobs],
            "top_logprobs": [None if e.logprob is None else {tok.decode([t]): v for t, v in e.top[:n_top]}
                             for e in logprobs], "text_offset": offsets}


def prompt_logprobs(tok: Tokenizer, logprobs: list[TokenLogprob], n_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first) its id's logprob and the `n_top` most
    likely ids' (rank: 1 for the most likely; null for the prompt's token where it is not among them)."""
    def entry(token: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": tok.decode([token])}

    out = []
    for e in logprobs:
        top = {str(t): entry(t, v, r) for r, (t, v) in enumerate(e.top[:n_top], 1)}
        out.append(None if e.logprob is None else top | {str(e.token): top.get(str(e.token))
                                                           or entry(e.token, e.logprob, None)})
    return out


def scored_reply(seq: Sequence) -> list[TokenLogprob]:
    """A completion's tokens with their logprobs as OpenAI and vLLM list them: the stop token that ended it too."""
    return seq.logprobs + ([seq.stop_logprob] if seq.stop_logprob is not None else [])


def tool_calls(calls: list[dict], prefix: str) -> list[dict]:
    """Parsed DSML calls with the ids OpenAI messages carry (a later `role: "tool"` turn answers by id)."""
    return [{"id": f"call_{prefix}{i}", **call} for i, call in enumerate(calls)]


def usage(seq: Sequence) -> dict:
    """Token counts, and the prompt tokens whose state came from the prefix cache (OpenAI's cached_tokens)."""
    return {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output_ids),
            "total_tokens": len(seq.prompt_ids) + len(seq.output_ids),
            "prompt_tokens_details": {"cached_tokens": seq.metrics.cached_tokens}}


def shown(tok: Tokenizer, text: str, skip_special: bool, final: bool = True) -> str:
    """Reply text as a reader sees it: without special tokens (`tok.visible`, vLLM's skip_special_tokens), or
    as the model wrote it."""
    return tok.visible(text, final) if skip_special else text


def reply_text(req: Request, seq: Sequence) -> str:
    """A finished reply's text, with the stop string that ended it where the request asks for it
    (include_stop_str_in_output)."""
    return seq.text + (seq.stopped_by or "") if req.include_stop_str else seq.text


def visible_message(tok: Tokenizer, text: str, thinking: bool, ignore_eos: bool = False, cut: bool = False,
                    skip_special: bool = True) -> dict:
    """A reply's assistant message (parse_completion, which reads the special tokens), its content and
    reasoning as readers see them: without special tokens (unless not `skip_special`)."""
    parsed = parse_completion(text, thinking, ignore_eos, cut)
    return parsed | {field: shown(tok, parsed[field], skip_special) for field in ("content", "reasoning_content")}


def completion(req: Request, seq: Sequence, model: str, tok: Tokenizer, number: str, prompt: int = 0) -> dict:
    """The response body of a finished request (of its `prompt`-th prompt): ids `chatcmpl-<number>` /
    `cmpl-<number>`, tool call ids `call_<number>_<n>`. The text shows no special tokens (unless the request
    keeps them); with echo it starts with the prompt, and its logprobs with the prompt's."""
    finish_reason, text, skip = seq.finish_reason, reply_text(req, seq), req.skip_special_tokens
    if req.chat:
        parsed = visible_message(tok, text, req.thinking, req.params.ignore_eos, finish_reason == "length", skip)
        message = {"role": "assistant", "content": parsed["content"]}
        if req.thinking:
            message["reasoning_content"] = parsed["reasoning_content"]
        if parsed["tool_calls"]:
            message["tool_calls"] = tool_calls(parsed["tool_calls"][:None if req.parallel_tool_calls else 1],
                                               f"{number}_")
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        logprobs = chat_logprobs(tok, seq.logprobs) if req.params.logprobs is not None else None
        choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
        body = {"id": f"chatcmpl-{number}", "object": "chat.completion"}
    else:
        echo = req.echo is not None
        logprobs = None if req.params.logprobs is None else completion_logprobs(
            tok, (seq.prompt_logprobs if echo else []) + scored_reply(seq), req.params.logprobs, 0, skip)
        text = (req.echo[prompt] if echo else "") + shown(tok, text, skip)
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(tok, seq.prompt_logprobs, req.prompt_logprobs)
        body = {"id": f"cmpl-{number}", "object": "text_completion"}
    if req.chat and req.prompt_logprobs is not None:        # vLLM puts a chat reply's on the body
        body["prompt_logprobs"] = prompt_logprobs(tok, seq.prompt_logprobs, req.prompt_logprobs)
    return body | {"created": int(time.time()), "model": model, "choices": [choice], "usage": usage(seq),
                   "dsv4_stats": seq.metrics.as_dict()}


def _before(text: str, marker: str) -> tuple[str, bool]:
    """The text before `marker` and whether it was found; while not found, an ending that could be the
    start of the marker is held back, so no markup ever streams."""
    head, found, _ = text.partition(marker)
    if not found:
        held = next((n for n in range(len(marker) - 1, 0, -1) if head.endswith(marker[:n])), 0)
        head = head[: len(head) - held]
    return head, bool(found)


class ChunkStream:
    """One reply as stream chunks: `update` with each event's text and logprobs gives the chunks to send;
    `finish` the last ones. Reasoning streams as `delta.reasoning_content`, the answer as `delta.content`,
    tool calls as `delta.tool_calls` as they are written (a call's id and name once its opening tag is whole,
    then its arguments as they grow: `encoding.tool_calls_so_far`, which holds back markup); the concatenated
    deltas equal the non-streamed message (special tokens held back until they are whole, and left out unless
    the request keeps them; a stop string it keeps comes last), but for a call cut off by max_tokens, whose
    arguments so far streamed and which the message leaves out."""

    def __init__(self, req: Request, tok: Tokenizer, model: str, number: str):
        self.req, self.tok = req, tok
        self.base = {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{number}",
                     "object": "chat.completion.chunk" if req.chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.number = number
        self.text = ""                          # the reply so far
        self.sent = {"reasoning_content": 0, "content": 0, "text": 0}     # characters of each already sent
        self.offset = 0                         # completions: characters of text whose logprobs were sent
        self.arguments: list[int] = []          # characters of each tool call's arguments already sent

    def first(self) -> list[dict]:
        """A chat stream opens with the assistant role (OpenAI's first chunk); a completion with nothing."""
        return [self._chunk({"role": "assistant", "content": ""})] if self.req.chat else []

    def echo(self, text: str, logprobs: list[TokenLogprob]) -> list[dict]:
        """An echoing completion's first chunk, once its prompt is prefilled: the prompt's text (and logprobs)."""
        return [self._chunk(text, logprobs if self.req.params.logprobs is not None else [])]

    def update(self, text: str, logprobs: list[TokenLogprob]) -> list[dict]:
        self.text += text
        if not self.req.chat:
            return self._text(self._shown(self.text, final=False), logprobs)
        # what parse_completion reads: up to an EOS, but with ignore_eos, which writes past it
        text = self.text if self.req.params.ignore_eos else _before(self.text, EOS)[0]
        reasoning, answer, thought = "", text, True
        if self.req.thinking:
            reasoning, thought = _before(text, THINK_END)
            answer = text.partition(THINK_END)[2] if thought else ""
        content, calls = split_tool_calls(answer, final=False)     # an ending that may open the calls is held back
        chunks = self._deltas(self._shown(reasoning, final=thought), self._shown(content, final=False), logprobs)
        return chunks + self._calls(tool_calls_so_far(calls) if calls is not None else [])

    def finish(self, seq: Sequence) -> list[dict]:
        """The rest of the reply (parsed whole, as the non-streamed body is), tool calls, the finish reason
        and, when asked for, the usage."""
        finish_reason, chunks, whole = seq.finish_reason, [], reply_text(self.req, seq)
        if self.req.chat:
            ignore_eos = self.req.params.ignore_eos
            parsed = visible_message(self.tok, whole, self.req.thinking, ignore_eos, finish_reason == "length",
                                     self.req.skip_special_tokens)
            chunks = self._deltas(parsed["reasoning_content"], parsed["content"], [])
            text = whole if ignore_eos else whole.partition(EOS)[0]    # the answer as parse_completion reads it
            calls = split_tool_calls(text.partition(THINK_END)[2] if self.req.thinking else text)[1]
            chunks += self._calls(tool_calls_so_far(calls) if calls is not None else [])
            if parsed["tool_calls"]:
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        else:
            chunks = self._text(self._shown(whole), scored_reply(seq)[len(seq.logprobs):])
        chunks.append(self._chunk({} if self.req.chat else "", finish_reason=finish_reason))
        if self.req.include_usage:
            chunks.append(self.base | {"choices": [], "usage": usage(seq)})
        return chunks

    def _calls(self, calls: list[dict]) -> list[dict]:
        """A chunk with what the tool calls so far add: a new call's index, id, type, name and arguments so far,
        then the arguments each call's grew by (the first call only, without parallel tool calls)."""
        deltas = []
        for i, call in enumerate(calls[:None if self.req.parallel_tool_calls else 1]):
            if i == len(self.arguments):
                deltas.append({"index": i, "id": f"call_{self.number}_{i}", "type": "function",
                               "function": {"name": call["name"], "arguments": call["arguments"]}})
                self.arguments.append(len(call["arguments"]))
            elif len(call["arguments"]) > self.arguments[i]:
                deltas.append({"index": i, "function": {"arguments": call["arguments"][self.arguments[i]:]}})
                self.arguments[i] = len(call["arguments"])
        return [self._chunk({"tool_calls": deltas})] if deltas else []

    def _shown(self, text: str, final: bool = True) -> str:
        return shown(self.tok, text, self.req.skip_special_tokens, final)

    def _text(self, text: str, logprobs: list[TokenLogprob]) -> list[dict]:
        """A completion's chunk with the text beyond what was sent."""
        delta, self.sent["text"] = text[self.sent["text"]:], max(self.sent["text"], len(text))
        return [self._chunk(delta, logprobs)] if delta or logprobs else []

    def _deltas(self, reasoning: str, content: str, logprobs: list[TokenLogprob]) -> list[dict]:
        delta = {}
        for field, text in (("reasoning_content", reasoning), ("content", content)):
            if len(text) > self.sent[field]:
                delta[field] = text[self.sent[field]:]
                self.sent[field] = len(text)
        return [self._chunk(delta, logprobs)] if delta or logprobs else []

    def _chunk(self, delta: dict | str, logprobs: list[TokenLogprob] | None = None,
               finish_reason: str | None = None) -> dict:
        wanted = self.req.params.logprobs is not None
        if self.req.chat:
            choice = {"index": 0, "delta": delta,
                      "logprobs": chat_logprobs(self.tok, logprobs or []) if wanted and logprobs else None}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None}
            if wanted:
                choice["logprobs"] = completion_logprobs(self.tok, logprobs or [], self.req.params.logprobs,
                                                         self.offset, self.req.skip_special_tokens)
                self.offset += sum(len(self._shown(t)) for t in choice["logprobs"]["tokens"])
        return self.base | {"choices": [choice | {"finish_reason": finish_reason}]}
