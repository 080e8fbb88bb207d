"""Input lines -> requests the engine can run, or a BadLine with the line number, a code and a message.

Two line forms:
  OpenAI batch: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
  simple:       {"id", "messages": [...] | "prompt": "...", sampling keys...}  (the line is its own body)

The body itself is parsed by `dsv4cli.openai.requests`, the field policy `dsv4 serve` follows too.
"""
import hashlib
import json
from dataclasses import dataclass

from dsv4cli.engine import SamplingParams
from dsv4cli.openai import requests as body_requests
from dsv4cli.openai.requests import CHAT_URL, COMPLETIONS_URL, BadRequest, BodyParser, BodyRules, load_json
from dsv4cli.tokenizer import Tokenizer

from .shards import Shard

LINE_KEYS = {"custom_id", "method", "url", "body"}     # an OpenAI batch line around its body


@dataclass
class Request(body_requests.Request):
    line: int = 0
    custom_id: str = ""


class BadLine(BadRequest):
    """A line that cannot run; `parse` fills in its line number and custom_id (when it has one)."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(code, message)
        self.custom_id, self.line = custom_id, 0


def request_seed(run_seed: int, custom_id: str) -> int:
    """The seed of a request that names none: fixed by the run seed and its custom_id, so a resumed
    run samples it exactly as an uninterrupted one would."""
    digest = hashlib.blake2b(f"{run_seed}:{custom_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2    # 62 bits, like the engine's own seeds


class RequestParser:
    """Parses lines in input order; remembers the custom_ids seen so a repeat is a `duplicate_custom_id`."""

    def __init__(self, tok: Tokenizer, defaults: SamplingParams, run_seed: int, max_seq_len: int,
                 rules: BodyRules | None = None, shard: Shard | None = None):
        """`shard`: parse only that shard's lines (`parse` returns None for the others, untokenised)."""
        self.bodies = BodyParser(tok, defaults, max_seq_len, rules or BodyRules())
        self.run_seed, self.shard = run_seed, shard
        self.seen: set[str] = set()

    def parse(self, line: int, raw: bytes) -> Request | None:
        """One non-blank input line (1-based number `line`) -> Request, None when another shard answers it, or
        raise BadLine (with the line's custom_id once the line has claimed it)."""
        owner = custom_id = None        # the line's id; and once claimed (a repeat's record keeps null)
        try:
            obj = load_json(raw)
            if not isinstance(obj, dict):
                raise BadLine("invalid_request", f"a line must be a JSON object, got {type(obj).__name__}")
            owner = self._custom_id(obj)
            if self.shard is not None and not self.shard.owns(owner):
                return None             # before tokenising: each shard parses only its own lines
            custom_id = self._claim(owner)
            return self._request(line, obj, custom_id)
        except BadRequest as e:
            if self.shard is not None and not self.shard.owns(owner):
                return None
            bad = e if isinstance(e, BadLine) else BadLine(e.code, e.message)
            bad.line, bad.custom_id = line, bad.custom_id or custom_id
            raise bad from None

    def _custom_id(self, obj: dict) -> str:
        """The line's custom_id (an int `id` of a simple line counts too)."""
        openai = "body" in obj
        cid = obj.get("custom_id") if openai else obj.get("custom_id", obj.get("id"))
        if cid is None:
            raise BadLine("missing_custom_id", "custom_id: missing" if openai else "id: missing (or custom_id)")
        if not (isinstance(cid, str) or not openai and isinstance(cid, int) and not isinstance(cid, bool)):
            raise BadLine("invalid_request", f"custom_id: must be a string, got {json.dumps(cid)}")
        cid = str(cid)
        if not cid:
            raise BadLine("invalid_request", "custom_id: must not be empty")
        return cid

    def _claim(self, cid: str) -> str:
        """The line takes its custom_id, even if the rest of it is bad; a repeat is a `duplicate_custom_id`."""
        if cid in self.seen:
            # the record keeps custom_id null: the id already belongs to the earlier line's record, and a
            # reader matching results by custom_id must find each id once
            raise BadLine("duplicate_custom_id", f"custom_id {cid!r} was already used by an earlier line")
        self.seen.add(cid)
        return cid

    def _request(self, line: int, obj: dict, custom_id: str) -> Request:
        seed = request_seed(self.run_seed, custom_id)
        if "body" in obj:
            extra = next((k for k in obj if k not in LINE_KEYS), None)
            if extra is not None:
                raise BadLine("unsupported_parameter", f"{extra}: not a field of a batch request line "
                                                       f"(custom_id, method, url, body)")
            if obj.get("method", "POST") != "POST":
                raise BadLine("unsupported_method", f"method: only POST is supported, got {json.dumps(obj['method'])}")
            url = obj.get("url")
            if url not in (CHAT_URL, COMPLETIONS_URL):
                raise BadLine("unsupported_url", f"url: must be {CHAT_URL} or {COMPLETIONS_URL}, got {json.dumps(url)}")
            req = self.bodies.parse(obj["body"], url == CHAT_URL, "body.", seed)
        else:
            if ("messages" in obj) == ("prompt" in obj):
                raise BadLine("invalid_request", "give exactly one of messages (chat) or prompt (completion)")
            req = self.bodies.parse(obj, "messages" in obj, "", seed, extra=("id", "custom_id"))
        return Request(**vars(req), line=line, custom_id=custom_id)
