"""Tokenizer wrapper (HF `tokenizers`) and streaming detokenisation."""

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from dsv4cli.encoding import checkpoint_encoding

# DeepSeek V4 special tokens (docs §5). Only those present in a given vocab show up in `special_ids`.
SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜System｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    "｜DSML｜",
    "<｜tool▁calls▁begin｜>",
    "<｜fim▁begin｜>",
    "<|EOT|>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
)
DEFAULT_BOS = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS = "<｜end▁of▁sentence｜>"


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, bos_token: str = DEFAULT_BOS, eos_token: str = DEFAULT_EOS,
                 encoding: str = "preview"):
        """`encoding`: the checkpoint's chat encoding (`encoding.checkpoint_encoding`), for the front ends'
        prompts."""
        self._tok = tokenizer
        self.bos_id = self._require_id(bos_token)
        self.eos_id = self._require_id(eos_token)
        self.encoding = encoding
        self.special_ids = {t: i for t in SPECIAL_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
        # every token the vocabulary marks special, longest first, so one inside another is matched whole
        specials = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}, key=len,
                          reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._special_starts = {t[:n] for t in specials for n in range(1, len(t))}
        self._longest_special = max(map(len, specials), default=0)

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer file not found: {tokenizer_file}")
        try:
            tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust loader raises a bare Exception on bad JSON
            raise ValueError(f"cannot read tokenizer file {tokenizer_file}: {e}") from e
        bos, eos = DEFAULT_BOS, DEFAULT_EOS
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ValueError(f"cannot read tokenizer config {config_file}: {e}") from e
            bos = _token_string(config.get("bos_token")) or bos
            eos = _token_string(config.get("eos_token")) or eos
        return cls(tokenizer, bos, eos, checkpoint_encoding(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Rendered prompts already carry BOS; special-token strings in `text` still map to single ids.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` holds it (what the grammar library reads)."""
        return self._tok.to_str()

    def visible(self, text: str, final: bool = True) -> str:
        """Decoded text as a reader sees it: without the special tokens (chat markers, `</think>`, EOS), as
        vLLM's skip_special_tokens gives it; the parsers (reasoning, tool calls) read the text with them. While
        a reply streams (`final` False), an ending that could be the start of a special token is held back,
        so what streams is always the beginning of the final text."""
        if not final:
            tail = range(max(len(text) - self._longest_special + 1, 0), len(text))
            # the last characters of a whole special token (the `｜` ending `｜DSML｜`) start none
            whole = [m.span() for m in self._specials.finditer(text) if m.end() > tail.start] if self._specials else []
            text = text[:next((i for i in tail if text[i:] in self._special_starts
                               and not any(a < i < b for a, b in whole)), len(text))]
        return self._specials.sub("", text) if self._specials else text

    def _require_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer vocabulary")
        return token_id


def _token_string(value):
    """tokenizer_config.json stores special tokens either as strings or as AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


class StreamDecoder:
    """Turns a stream of token ids into text chunks without ever splitting a UTF-8 character.

    Byte-level BPE tokens may end in the middle of a multi-byte character; decoding such a tail
    yields U+FFFD, so text is held back until the character completes. Only a short window of
    recent ids is decoded per token: once everything is emitted the window shrinks to `context`
    ids, kept so decoders that look at neighbouring tokens stay exact.
    """

    def __init__(self, tokenizer: Tokenizer, context: int = 4):
        self._tok = tokenizer
        self._context = context
        self._ids: list[int] = []
        self._sent = 0  # characters of decode(self._ids) already returned

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        ready = len(text.rstrip("\ufffd"))
        chunk = text[self._sent : ready]
        self._sent = max(self._sent, ready)
        if ready == len(text) and len(self._ids) > 2 * self._context:
            self._ids = self._ids[-self._context :]
            self._sent = len(self._tok.decode(self._ids))
        return chunk

    def flush(self) -> str:
        """Return whatever is held back (possibly U+FFFD for truly broken bytes) and reset."""
        chunk = self._tok.decode(self._ids)[self._sent :]
        self._ids, self._sent = [], 0
        return chunk
