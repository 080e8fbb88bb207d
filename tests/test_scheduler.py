"""The token-budget scheduler: prefill chunks interleave with decode steps, and greedy outputs equal each
request run alone, whatever the interleaving (chunk cuts at window 16, ratio 4 and ratio 128 edges)."""
import pytest
import torch
from tiny import prompts

from dsv4cli.engine import Engine
from dsv4cli.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@torch.no_grad()
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_interleaved_greedy_equals_alone(model, tok, k):
    """Two requests start; the others arrive while they decode (more than the free slots, so some wait).
    Budgets of 3 and 4 cut chunks at every ratio-4 edge and off them, 16 at the window's, all three
    across position 128; a budget larger than the chunk runs several chunks, of several prompts, a step."""
    ps = prompts([140, 9, 130, 33, 129], tok.vocab_size, seed=k)
    alone = [Engine(model, tok, max_batch=1, max_seq_len=320, mtp=k).generate([p], GREEDY)[0].output_ids
             for p in ps]
    for budget, chunk in ((3, 16), (4, 256), (16, 16), (50, 32)):
        eng = Engine(model, tok, max_batch=3, max_seq_len=320, mtp=k, prefill_chunk=chunk, prefill_budget=budget)
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
    eng = Engine(model, tok, max_batch=2, max_seq_len=320, mtp=1, prefill_chunk=32, prefill_budget=16)
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
def test_free_slot_state_survives_decode_steps(model, tok):
    """A free slot below a running one is stepped by every decode step but keeps its state: a chat turn
    resuming it after 300 of them equals a fresh engine's (unmasked, it would write past its history
    and wrap its rings)."""
    first, other, more = prompts([40, 12, 9], tok.vocab_size, seed=11)
    eng = Engine(model, tok, max_batch=2, max_seq_len=512, mtp=0, reuse_prefix=True)
    turn = eng.submit(first, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.submit(other, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    while eng.has_work():
        eng.step()
    resumed = eng.submit(first + turn.output_ids + more, GREEDY)
    eng.step()
    assert resumed.slot == 0 and resumed.metrics.cached_tokens > 40
    while eng.has_work():
        eng.step()
    fresh = Engine(model, tok, max_batch=1, max_seq_len=512, mtp=0).generate([first + turn.output_ids + more],
                                                                             GREEDY)[0]
    assert resumed.output_ids == fresh.output_ids
