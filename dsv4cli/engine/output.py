"""Committed tokens -> a request's output: stop tokens, length limits, stop strings (none before min_tokens),
and text held back while it could still turn into a stop string."""
from .request import Event, Sequence, TokenLogprob


def append_output(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None, eos_id: int,
                  max_seq_len: int) -> Event:
    """Append committed tokens to a sequence, applying stop rules; the event streams the text that
    can no longer become part of a stop string."""
    p = seq.params
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {eos_id})
    new_ids, text = [], ""
    if not p.max_tokens:            # a prompt scored only: its first token is not a reply
        tokens, seq.finish_reason = [], "length"
    for j, t in enumerate(tokens):
        if t in stops:
            seq.finish_reason = "stop"
            seq.stop_logprob = logprobs[j] if logprobs is not None else None
            break
        new_ids.append(t)
        seq.output_ids.append(t)
        if logprobs is not None:
            seq.logprobs.append(logprobs[j])
        text += seq.decoder.push(t)
        if len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= max_seq_len:
            seq.finish_reason = "length"
            break
    seq.metrics.output_tokens = len(seq.output_ids)
    if seq.finished:
        text += seq.decoder.flush()
    full = seq.text + text
    longest = max((len(s) for s in p.stop), default=0)
    # min_tokens: no stop string ends a shorter reply (the device holds its stop tokens back)
    for s in p.stop if len(seq.output_ids) >= p.min_tokens else ():
        cut = full.find(s, max(0, len(seq.text) - len(s) + 1))
        if cut >= 0:
            full = full[:cut]
            seq.finish_reason, seq.stopped_by = "stop", s
    seq.text = full
    ready = len(full) if seq.finished else max(seq.emitted, len(full) - longest + 1 if longest else len(full))
    text, seq.emitted = full[seq.emitted:ready], ready
    return Event(seq, text, new_ids, seq.finished)
