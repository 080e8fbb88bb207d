"""Prompt logprobs (`SamplingParams.prompt_logprobs`): every prompt token scored by the model's own
log-softmax, whatever the chunking, the drafter, the prefix store or the rest of the batch."""
import torch
from tiny import prompts

from dsv4cli.engine import Engine, EngineOptions, SamplingParams

STORE = (64 << 20, 0)


def reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain full forward pass: row i scores token i + 1."""
    return model.forward(torch.tensor([ids])).log_softmax(-1)[0]


def worst_error(model, seq, n_top: int) -> float:
    """The largest difference between a request's prompt logprobs (and alternatives) and the reference."""
    ids = seq.prompt_ids
    assert len(seq.prompt_logprobs) == len(ids)
    assert seq.prompt_logprobs[0].token == ids[0] and seq.prompt_logprobs[0].logprob is None
    if len(ids) == 1:
        return 0.0
    ref = reference(model, ids)[:-1]
    scored = seq.prompt_logprobs[1:]
    assert [e.token for e in scored] == ids[1:]
    got = torch.tensor([e.logprob for e in scored])
    err = (got - ref.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]).abs().max().item()
    if n_top:
        top = ref.topk(n_top, -1)
        assert [[t for t, _ in e.top] for e in scored] == top.indices.tolist()
        err = max(err, (torch.tensor([[v for _, v in e.top] for e in scored]) - top.values).abs().max().item())
    return err


@torch.no_grad()
def test_prompt_logprobs_equal_a_full_forward_pass(model, tok):
    """Prompts crossing the window (16), ratio-4 and ratio-128 blocks and the prefill chunk (48), scored in
    chunks beside running streams, with and without a drafter: within 1e-4 nats of the full forward pass; the
    generated tokens are those of the same request unscored."""
    ps = prompts([2, 47, 130, 300], tok.vocab_size, seed=11)
    worst = 0.0
    for mtp in (0, 2):
        eng = Engine(model, tok,
                     EngineOptions(max_batch=3, max_seq_len=512, drafts=mtp, prefill_chunk=48, prefill_budget=64))
        plain = eng.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        for n_top in (0, 5):
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=n_top)
            for seq, want in zip(eng.generate(ps, params), plain):
                worst = max(worst, worst_error(model, seq, n_top))
                assert seq.output_ids == want.output_ids
    print(f"max |prompt logprob - full forward log_softmax|: {worst:.2e}")
    assert worst <= 1e-4


@torch.no_grad()
def test_a_scored_prompt_is_prefilled_whole_not_from_the_prefix_store(model, tok):
    """The store holds the prompt's prefix; a scored request refills it (cached_tokens 0) and scores every
    token; an unscored one after it still resumes from the store."""
    (prompt,) = prompts([300], tok.vocab_size, seed=12)
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=1, prefix_cache=STORE))
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    (seq,) = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    assert seq.metrics.cached_tokens == 0
    assert worst_error(model, seq, 3) <= 1e-4
    (again,) = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert again.metrics.cached_tokens == 256


@torch.no_grad()
def test_max_tokens_0_scores_the_prompt_and_generates_nothing(model, tok):
    ps = prompts([1, 30], tok.vocab_size, seed=13)
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=128, drafts=0))
    for seq in eng.generate(ps, SamplingParams(temperature=0.8, max_tokens=0, prompt_logprobs=0)):
        assert seq.output_ids == [] and seq.finish_reason == "length"
        assert worst_error(model, seq, 0) <= 1e-4
    assert SamplingParams(max_tokens=-1).problem(300) is not None


@torch.no_grad()
def test_score_ids_report_the_logprobs_of_given_ids(model, tok):
    """`score_ids`: each position also reports the logprobs of the ids given for it (another run's top ids, for
    a KL divergence), in chunks as in one pass; mismatched lists are refused at submit."""
    (prompt,) = prompts([90], tok.vocab_size, seed=14)
    g = torch.Generator().manual_seed(0)
    given = torch.randint(0, tok.vocab_size, (len(prompt), 3), generator=g).tolist()
    eng = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=128, drafts=0, prefill_chunk=32, prefill_budget=32))
    (seq,) = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1, score_ids=given))
    want = reference(model, prompt)[:-1].gather(-1, torch.tensor(given[1:]))
    got = torch.tensor([e.given for e in seq.prompt_logprobs[1:]])
    assert (got - want).abs().max().item() <= 1e-4
    assert worst_error(model, seq, 1) <= 1e-4
    for bad in (given[:-1], [[1, 2]] + given[1:], [[]] * len(prompt), [[tok.vocab_size] * 3] * len(prompt)):
        try:
            eng.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0, score_ids=bad))
        except ValueError as e:
            assert "score_ids" in str(e)
        else:
            raise AssertionError(f"score_ids {bad[:2]}... accepted")


@torch.no_grad()
def test_the_head_runs_on_a_chunk_at_a_time(model, tok, monkeypatch):
    """A scored 400-token prompt never holds its logits whole: each LM head call takes at most a prefill
    chunk's rows (memory bounded by the chunk, not the prompt)."""
    rows = []
    logits = model.logits
    monkeypatch.setattr(model, "logits", lambda h: rows.append(h.shape[-4] * h.shape[-3]) or logits(h))
    (prompt,) = prompts([400], tok.vocab_size, seed=15)
    eng = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=0, prefill_chunk=64, prefill_budget=64))
    (seq,) = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert len(seq.prompt_logprobs) == 400 and max(rows) <= 64 and sum(rows) >= 399
