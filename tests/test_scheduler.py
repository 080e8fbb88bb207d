"""The token-budget scheduler: prefill chunks interleave with decode steps (in the same forward passes, or
in passes of their own), and greedy outputs equal each request run alone, whatever the interleaving
(chunk cuts at window 16, ratio 4 and ratio 128 edges)."""
import dataclasses
import math

import pytest
import torch
from tiny import prompts

from dsv4cli.engine import Engine, EngineOptions, pace
from dsv4cli.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@torch.no_grad()
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_interleaved_greedy_equals_alone(model, tok, k):
    """Two requests start; the others arrive while they decode (more than the free slots, so some wait).
    Budgets of 3 and 4 cut chunks at every ratio-4 edge and off them, 16 at the window's, all three
    across position 128; a budget larger than the chunk runs several chunks, of several prompts, a step."""
    ps = prompts([140, 9, 130, 33, 129], tok.vocab_size, seed=k)
    alone = [Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=320, drafts=k)).generate([p], GREEDY)[0]
             .output_ids for p in ps]
    for budget, chunk in ((3, 16), (4, 256), (16, 16), (50, 32)):
        eng = Engine(model, tok,
                     EngineOptions(max_batch=3, max_seq_len=320, drafts=k, prefill_chunk=chunk, prefill_budget=budget))
        seqs = [eng.submit(p, GREEDY) for p in ps[:2]]
        while len(seqs[1].output_ids) < 3:
            eng.step()
        seqs += [eng.submit(p, GREEDY) for p in ps[2:]]
        while eng.has_work():
            eng.step()
        assert [s.output_ids for s in seqs] == alone, (budget, chunk)


@torch.no_grad()
def test_a_long_prompt_does_not_stall_running_streams(model, tok):
    """Every step decodes the running stream while a prompt prefills at `budget` tokens a step; the
    prompt's first token comes with its last chunk."""
    short, long = prompts([10, 140], tok.vocab_size, seed=7)
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=320, drafts=1, prefill_chunk=32, prefill_budget=16))
    running = eng.submit(short, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()                                    # its prefill: the first token, no decode step yet
    assert len(running.output_ids) == 1
    new = eng.submit(long, GREEDY)
    for step in range(-(-140 // 16)):
        events = eng.step()
        assert running in [e.seq for e in events]
        assert new.prefilled == min(16 * (step + 1), 140)
        assert bool(new.output_ids) == (new.prefilled == 140)


@torch.no_grad()
def test_prefill_while_streams_decode_is_bounded_in_time(model, tok):
    """While streams decode, a step prefills the prompt tokens that take about SHARE of a decode step here
    (measured: the step's costs); with none decoding, the whole token budget."""
    short, long = prompts([10, 300], tok.vocab_size, seed=7)
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=0, prefill_chunk=256,
                                           prefill_budget=160))
    alone = eng.submit(long, GREEDY)
    eng.step()
    assert alone.prefilled == 160                  # no stream waits on it
    eng.cancel(alone)
    running = eng.submit(short, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.pace.decode_s > 0 and eng.pace.token_s > 0       # measured by the steps that ran
    eng.pace.decode_s, eng.pace.token_s = 0.010, 0.0005        # 10 ms a decode step, 0.5 ms a prompt token
    new = eng.submit(long, GREEDY)
    eng.step()
    assert new.prefilled == int(pace.SHARE * 0.010 / 0.0005) and len(running.output_ids) == 3
    eng.pace.token_s = 0.1                                      # a slow device: never below MIN_TOKENS
    eng.step()
    assert new.prefilled == int(pace.SHARE * 0.010 / 0.0005) + pace.MIN_TOKENS


def test_prefill_pace_measures_a_prompt_tokens_share_of_a_step():
    p = pace.PrefillPace(160)
    assert p.tokens(True) == p.tokens(False) == 160            # nothing measured yet
    p.ran(40, True, 0.030)                                      # a mixed step before any decode step: no measure
    assert p.token_s is None
    p.ran(0, True, 0.010)
    p.ran(40, True, 0.030)                                      # 20 ms for 40 tokens beside a 10 ms decode
    assert p.decode_s == 0.010 and p.token_s == pytest.approx(0.0005)
    assert p.tokens(True) == int(pace.SHARE * 0.010 / 0.0005) and p.tokens(False) == 160


@torch.no_grad()
def test_free_slot_state_survives_decode_steps(model, tok):
    """A free slot below a running one is stepped by every decode step but keeps its state: a chat turn
    resuming it after 300 of them equals a fresh engine's (unmasked, it would write past its history
    and wrap its rings)."""
    first, other, more = prompts([40, 12, 9], tok.vocab_size, seed=11)
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=0, reuse_prefix=True))
    turn = eng.submit(first, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.submit(other, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    while eng.has_work():
        eng.step()
    resumed = eng.submit(first + turn.output_ids + more, GREEDY)
    eng.step()
    assert resumed.slot == 0 and resumed.metrics.cached_tokens > 40
    while eng.has_work():
        eng.step()
    fresh = Engine(model, tok,
                   EngineOptions(max_batch=1, max_seq_len=512, drafts=0)).generate([first + turn.output_ids + more],
                                                                             GREEDY)[0]
    assert resumed.output_ids == fresh.output_ids


def count_mixed_passes(model, monkeypatch) -> list[int]:
    """Counts the trunk passes that run a decode step's rows and prefill chunks together."""
    calls, forward = [0], model.forward_segments

    def counted(segments):
        calls[0] += len(segments) > 1
        return forward(segments)

    monkeypatch.setattr(model, "forward_segments", counted)
    return calls


@torch.no_grad()
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_mixed_pass_below_a_running_stream_equals_alone(model, tok, k, monkeypatch):
    """A prompt prefilling in slot 0 while slot 1 decodes shares slot 1's forward passes, and its decode
    rows write garbage at its chunk's end. Chunks of 120: the garbage at 240.. aliases the ring slots of
    positions 109.., which the chunk [120, 240) reads (run before the chunk, it would change it), then a
    last chunk of 20; budget 16: a last chunk of 1, shorter than K+1, past the ratio-128 edge."""
    short, other, long = prompts([9, 33, 260], tok.vocab_size, seed=20 + k)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    mixed = count_mixed_passes(model, monkeypatch)
    for budget, prompt in ((120, long), (16, long[:129])):
        alone = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=320, drafts=k)).generate([prompt], GREEDY)[0]
        other_alone = Engine(model, tok,
                             EngineOptions(max_batch=1, max_seq_len=320, drafts=k)).generate([other], params)[0]
        eng = Engine(model, tok,
                     EngineOptions(max_batch=2, max_seq_len=320, drafts=k, prefill_chunk=budget, prefill_budget=budget))
        eng.pace.share = math.inf       # the token budget alone: the passes are counted
        first = eng.submit(short, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        running = eng.submit(other, params)
        while not first.finished or not running.output_ids:
            eng.step()
        before = mixed[0]
        new = eng.submit(prompt, GREEDY)
        while eng.has_work():
            eng.step()
        assert new.slot == 0 and mixed[0] - before == -(-len(prompt) // budget)
        assert new.output_ids == alone.output_ids and running.output_ids == other_alone.output_ids


@torch.no_grad()
def test_mixed_pass_logprobs_equal_passes_alone(model, tok):
    """Logprobs of the first token (packed with the decode rows' in the step's one host read) and of the
    running stream's tokens are those each request gets alone."""
    requests = [(prompts([12], tok.vocab_size, seed=3)[0],
                 SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)),
                (prompts([40], tok.vocab_size, seed=4)[0],
                 SamplingParams(temperature=0.8, seed=5, max_tokens=5, ignore_eos=True, logprobs=3))]
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=320, drafts=2, prefill_chunk=16, prefill_budget=16))
    running = eng.submit(*requests[0])
    eng.step()
    new = eng.submit(*requests[1])
    while eng.has_work():
        eng.step()
    alone = [Engine(model, tok,
                    EngineOptions(max_batch=1, max_seq_len=320, drafts=2, prefill_chunk=16,
                                  prefill_budget=16)).generate([ids], params)[0] for ids, params in requests]
    runs = [[(s.output_ids, [(lp.token, lp.logprob, lp.top) for lp in s.logprobs]) for s in seqs]
            for seqs in ((running, new), alone)]
    for (ids, lps), (ids_sep, lps_sep) in zip(*runs):
        assert ids == ids_sep and len(lps) == len(ids)
        for (t, lp, top), (t_sep, lp_sep, top_sep) in zip(lps, lps_sep):
            assert t == t_sep and lp == pytest.approx(lp_sep, abs=1e-5)
            assert [i for i, _ in top] == [i for i, _ in top_sep]


@torch.no_grad()
@pytest.mark.parametrize("k", [0, 2])
def test_background_streams_give_way_to_a_foreground_prompt(model, tok, k):
    """Background requests (an API batch's) decode; a foreground prompt arrives: the step that prefills it
    decodes none of them (its first token waits for no background decoding), the next one decodes them all
    with it, and every output, greedy and seeded sampled, is the one the same requests give in the foreground.
    A background prompt's prefill does not pause them."""
    ps = prompts([9, 12, 20, 6], tok.vocab_size, seed=11)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)

    def run(background: bool) -> list[list[int]]:
        eng = Engine(model, tok, EngineOptions(max_batch=4, max_seq_len=320, drafts=k))
        eng.pace.share = math.inf       # the token budget alone: which step each prompt ends in is counted
        bg = [eng.submit(p, dataclasses.replace(params, background=background))
              for p, params in zip(ps[:2], (GREEDY, sampled))]
        while len(bg[1].output_ids) < 4:
            eng.step()
        late = eng.submit(ps[3], dataclasses.replace(GREEDY, background=background))
        assert {e.seq.id for e in eng.step()} == {bg[0].id, bg[1].id, late.id}     # decoded while it prefilled
        fg = eng.submit(ps[2], GREEDY)
        assert {e.seq.id for e in eng.step()} == ({fg.id} if background else {fg.id, late.id, *(s.id for s in bg)})
        assert {e.seq.id for e in eng.step()} == {fg.id, late.id, *(s.id for s in bg)}
        while eng.has_work():
            eng.step()
        return [s.output_ids for s in (*bg, late, fg)]

    assert run(background=True) == run(background=False)
