"""What a constrained reply must match, and the library that matches it: a `Grammar` is an llguidance
grammar (JSON schema, Lark or regular expression, compiled to llguidance's text) with, optionally, a token
that ends a free part before it (the reasoning's `</think>`). `problem` says why one cannot constrain a reply
(llguidance's diagnosis, or no token it allows to start with); `new_matcher` gives the matcher a request's
slot advances (`constraint.py`). llguidance is the `structured` extra, imported when a grammar first needs it.
"""
import functools
from dataclasses import dataclass

from dsv4cli.tokenizer import Tokenizer

# JSON as json.dumps writes it: one space after , and :, no other whitespace (a model may not pad forever)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance():
    """The grammar library (the `structured` extra), imported when a request first needs it."""
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured output needs llguidance: pip install 'dsv4cli[structured]'") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a constrained reply matches: an llguidance grammar (as `LLMatcher.grammar_from_*` writes it),
    after a free part ended by the token `after` when that is set (the reasoning, ended by `</think>`)."""
    text: str
    after: int | None = None

    @classmethod
    def json_schema(cls, schema: dict, after: int | None = None) -> "Grammar":
        """JSON matching a JSON schema (`{"type": "object"}`: any object)."""
        try:
            return cls(llguidance().LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS), after)
        except (TypeError, ValueError) as e:   # not JSON-serialisable
            raise ValueError(f"not a JSON schema: {e}") from None

    @classmethod
    def lark(cls, text: str, after: int | None = None) -> "Grammar":
        """A grammar in llguidance's Lark syntax (rules from `start`; `%json {...}` inlines a JSON schema)."""
        return cls(llguidance().LLMatcher.grammar_from_lark(text), after)

    @classmethod
    def regex(cls, text: str, after: int | None = None) -> "Grammar":
        return cls(llguidance().LLMatcher.grammar_from_regex(text), after)

    def problem(self, tok: Tokenizer, vocab: int) -> str | None:
        """Why this grammar cannot constrain a reply in this vocabulary, or None: what llguidance finds wrong
        (syntax, an unsupported keyword, an unsatisfiable schema), or no token it allows to start with."""
        llg = llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(self.text, matcher_tokenizer(tok, vocab))
        if failed:
            return messages[0].strip().splitlines()[0]
        matcher = new_matcher(tok, vocab, self)
        if not any(matcher.compute_bitmask()) or matcher.is_error():
            return "the grammar allows no token of the vocabulary to start with"
        return None


@functools.cache
def matcher_tokenizer(tok: Tokenizer, vocab: int):
    """llguidance's view of the tokenizer (built once: ~1 s at V4's vocabulary), `vocab` ids wide."""
    return llguidance().LLTokenizer(tok.to_json(), n_vocab=vocab, eos_token=tok.eos_id)


def new_matcher(tok: Tokenizer, vocab: int, grammar: Grammar):
    matcher = llguidance().LLMatcher(matcher_tokenizer(tok, vocab), grammar.text, log_level=0)
    if matcher.is_error():
        raise ValueError(f"grammar: {matcher.get_error().strip().splitlines()[0]}")
    return matcher
