"""The engine: greedy speculative output equals plain greedy, sampling stays distribution-exact,
seeds reproduce, cancel and stop rules work, and a decode step syncs with the host once."""
import copy
import threading

import pytest
import torch
from tiny import prompts

from dsv4cli import parallel
from dsv4cli.engine import Engine, EngineAPI, EngineFailed, EngineOptions, ModelInfo
from dsv4cli.engine.runner import StepRunner
from dsv4cli.engine.sampling import NEUTRAL, SamplingParams, SlotParams, plain_greedy, processed_logits, target_probs
from dsv4cli.engine.verify import verify, verify_greedy
from dsv4cli.kernels import cpu, native
from dsv4cli.model.quant import quantize_model, release_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@torch.no_grad()
def test_speculative_greedy_equals_plain_greedy(model, tok):
    # prompt lengths around the window (16), ratio-4 and ratio-128 boundaries
    ps = prompts([3, 15, 17, 127, 129, 200], tok.vocab_size)
    plain = [s.output_ids for s in Engine(model, tok,
                                          EngineOptions(max_batch=5, max_seq_len=320, drafts=0)).generate(ps, GREEDY)]
    ids = list(ps[4])
    for _ in range(24):                                # and plain decoding equals the full forward pass
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert plain[4] == ids[len(ps[4]):]
    for k in (1, 2, 3, 4):
        for batch in (1, 3, 5):       # one at a time, continuous batching with joins, all together
            eng = Engine(model, tok, EngineOptions(max_batch=batch, max_seq_len=320, drafts=k))
            got = [s.output_ids for s in eng.generate(ps, GREEDY)]
            assert got == plain, f"K={k} batch={batch}"


@torch.no_grad()
def test_context_exhaustion(model, tok):
    ps = prompts([50, 60], tok.vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    ref = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=70, drafts=0)).generate(ps, params)
    for k in (1, 4):
        got = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=70, drafts=k)).generate(ps, params)
        assert [s.output_ids for s in got] == [s.output_ids for s in ref]
        assert [len(s.prompt_ids) + len(s.output_ids) for s in got] == [70, 70]
        assert all(s.finish_reason == "length" for s in got)


def test_verify_is_distribution_exact():
    """With argmax drafts (a one-hot q, as a grammar forces them), committed tokens follow the target rows
    exactly: the first token ~ p0, and given it equals draft 1, the second ~ p1 (chi-square over 40k
    independent seeds)."""
    V, N = 6, 40_000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    drafts = torch.tensor([p[0].argmax(), p[1].argmax()])
    probs = p.expand(N, -1, -1)
    q = torch.nn.functional.one_hot(drafts, V).float().expand(N, -1, -1)
    tokens, n_acc = verify(probs, drafts.expand(N, -1), torch.arange(N), torch.zeros(N, dtype=torch.long), q)
    first = tokens[:, 0]
    second = tokens[n_acc >= 1, 1]

    def chi2(samples, q):
        counts = torch.bincount(samples, minlength=V).double()
        expected = q.double() * samples.numel()
        keep = expected > 0
        return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()

    # 99.9% quantile of chi-square with 5 degrees of freedom is 20.5
    assert chi2(first, p[0]) < 20.5
    assert chi2(second, p[1]) < 20.5
    assert (n_acc == 2).any() and (n_acc == 0).any()


def test_sampling_filters():
    sp = SlotParams(4, 5, "cpu")
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(4, 1, 5)
    for slot, p in enumerate([SamplingParams(temperature=0), SamplingParams(top_k=2),
                              SamplingParams(top_p=0.5), SamplingParams(min_p=0.3)]):
        sp.set(slot, p, 0, torch.tensor([], dtype=torch.long))
    probs = target_probs(processed_logits(logits, sp, slice(0, 4), torch.zeros(4, 1, 5)), sp, slice(0, 4))[:, 0]
    assert probs[0].tolist() == [1, 0, 0, 0, 0]
    assert (probs[1, 2:] == 0).all() and (probs[1, :2] > 0).all()
    assert probs[2].tolist() == [1, 0, 0, 0, 0]          # the top token alone holds > 0.5
    full = logits[0, 0].softmax(-1)
    assert ((probs[3] > 0) == (full >= 0.3 * full[0])).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))


@torch.no_grad()
def test_seeded_sampling_reproducible_across_batches_and_k(model, tok):
    ps = prompts([9, 30, 140], tok.vocab_size, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = [s.output_ids for s in Engine(model, tok,
                                      EngineOptions(max_batch=3, max_seq_len=256, drafts=1)).generate(ps, params)]
    b = [s.output_ids for s in Engine(model, tok,
                                      EngineOptions(max_batch=1, max_seq_len=256, drafts=1)).generate(ps, params)]
    assert a == b
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    c = [s.output_ids for s in Engine(model, tok,
                                      EngineOptions(max_batch=3, max_seq_len=256, drafts=1)).generate(ps, other)]
    assert c != a


@torch.no_grad()
def test_cancel_and_continuous_batching(model, tok):
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=1))
    ps = prompts([10, 12, 14], tok.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seqs = [eng.submit(p, params) for p in ps]
    eng.step()
    assert seqs[2] in eng.waiting                       # only two slots
    eng.cancel(seqs[0])
    while eng.has_work():
        eng.step()
    assert seqs[0].finish_reason == "cancelled" and len(seqs[0].output_ids) < 20
    ref = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=0)).generate(ps[1:], params)
    assert [s.output_ids for s in seqs[1:]] == [s.output_ids for s in ref]


@torch.no_grad()
def test_stop_rules(model, tok):
    p = prompts([20], tok.vocab_size, seed=4)[0]
    free = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=1)).generate(
        [p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop_id = free.output_ids[5]
    first = free.output_ids.index(stop_id)
    s = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=2)).generate(
        [p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert s.output_ids == free.output_ids[:first] and s.finish_reason == "stop"
    needle = free.text[10:13]
    s = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=2)).generate(
        [p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[needle]))[0]
    assert s.text == free.text[: free.text.find(needle)] and s.finish_reason == "stop"
    s = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=3)).generate(
        [p], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert s.output_ids == free.output_ids[:7] and s.finish_reason == "length"


def host_routed_copy(model):
    """The model with its weights packed for the CPU's kernels (as big ones are), so its experts read their
    routing on the host; the fixture's small experts are stacked, as accelerators run them (grouped
    GEMMs with the routing kept on the device)."""
    if not native.available():
        pytest.skip("no native kernels on this machine")
    model = copy.deepcopy(model)
    cpu.PACK_MIN_BYTES, before = 0, cpu.PACK_MIN_BYTES
    try:
        model.prepare()
    finally:
        cpu.PACK_MIN_BYTES = before
    assert all(layer.ffn.stack is None for layer in [*model.layers, *model.mtp])
    return model


@torch.no_grad()
def test_one_host_sync_per_decode_step(model, tok, monkeypatch):
    """Exactly one host read per step, plus, on the CPU, one per MoE call that reads its routing on the host:
    packed experts (routed_experts) or stacked ones (grouped_experts, each expert's rows on its slice), not
    a paired or widened stack (wide_grouped_experts, static shapes); tensors live there, so those reads
    cost no device sync."""
    assert all(layer.ffn.stack is not None for layer in [*model.layers, *model.mtp])
    moe_calls, static = [], []
    monkeypatch.setattr(cpu, "routed_experts", spy(cpu.routed_experts, moe_calls))
    monkeypatch.setattr(cpu, "grouped_experts", spy(cpu.grouped_experts, moe_calls))
    monkeypatch.setattr(cpu, "wide_grouped_experts", spy(cpu.wide_grouped_experts, static))
    # the second case asks for logprobs: they travel in the same packed tensor
    for run, logprobs in ((model, None), (host_routed_copy(model), None), (model, 5)):
        eng = Engine(run, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=2))
        for p in prompts([10, 40], tok.vocab_size, seed=5):
            eng.submit(p, SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, logprobs=logprobs))
        eng.step()                                          # admission (prefill) + first decode step
        syncs = []
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
                m.setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name), syncs, name))
            for _ in range(3):
                syncs.clear()
                moe_calls.clear()
                static.clear()
                eng.step()
                # trunk layers + the MTP layer over the verified rows + its chained draft (K = 2)
                assert len(moe_calls) == len(run.layers) + 2
                assert syncs == ["tolist"] * (1 + len(moe_calls) - len(static)), syncs


@torch.no_grad()
def test_one_host_sync_per_mixed_step(model, tok, monkeypatch):
    """A step running prefill chunks in the decode step's passes reads the host once too, the step whose
    chunk ends a prompt included (its first token, and logprobs, ride in the packed tensor), a scored chunk's
    rows in the same read (`prompt_logprobs`); on the CPU,
    once more per MoE call that reads its routing on the host (not on a paired or widened stack)."""
    moe_calls, static = [], []
    monkeypatch.setattr(cpu, "grouped_experts", spy(cpu.grouped_experts, moe_calls))
    monkeypatch.setattr(cpu, "wide_grouped_experts", spy(cpu.wide_grouped_experts, static))
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=2, prefill_budget=16))
    running, prompt = prompts([10, 40], tok.vocab_size, seed=6)
    eng.submit(running, SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True))
    eng.step()                                              # its prefill alone
    new = eng.submit(prompt, SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, logprobs=2,
                                            prompt_logprobs=1))
    syncs = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name), syncs, name))
        for _ in range(3):                                  # chunks of 16, 16 and 8, with decode rows
            syncs.clear()
            moe_calls.clear()
            static.clear()
            eng.step()
            assert syncs == ["tolist"] * (1 + len(moe_calls) - len(static)), syncs
    assert len(new.output_ids) == 1 and len(new.logprobs) == 1 and len(new.prompt_logprobs) == 40


def spy(fn, log, name=None):
    def counted(*a, **kw):
        log.append(name or fn.__name__)
        return fn(*a, **kw)
    return counted


@torch.no_grad()
def test_stacked_experts_give_the_same_greedy_tokens(model, tok):
    ps = prompts([7, 33, 130], tok.vocab_size, seed=9)
    host_routed = host_routed_copy(model)
    for k in (0, 2):
        grouped = [s.output_ids for s in Engine(model, tok,
                                                EngineOptions(max_batch=3, max_seq_len=256, drafts=k)).generate(ps,
                                                                                                             GREEDY)]
        host = Engine(host_routed, tok, EngineOptions(max_batch=3, max_seq_len=256, drafts=k)).generate(ps, GREEDY)
        assert [s.output_ids for s in host] == grouped


def test_rows_without_filters_skip_the_vocabulary_sort(model, tok, monkeypatch):
    """Greedy and plain-temperature rows give the same distributions unsorted; a step sorts the
    vocabulary only when some running request filters by top-k, top-p or min-p."""
    sp = SlotParams(3, 50, "cpu")
    sp.set(0, SamplingParams(temperature=0), 0, torch.tensor([1]))
    sp.set(1, SamplingParams(temperature=0.7, repetition_penalty=1.3), 0, torch.tensor([2, 3]))
    sp.set(2, SamplingParams(temperature=1.5, presence_penalty=0.5), 0, torch.tensor([4]))
    logits, counts = torch.randn(3, 2, 50), torch.randint(0, 3, (3, 2, 50)).float()
    processed = processed_logits(logits, sp, slice(0, 3), counts)
    torch.testing.assert_close(target_probs(processed, sp, slice(0, 3), sort=False),
                               target_probs(processed, sp, slice(0, 3)), rtol=1e-6, atol=1e-7)
    sorts = []
    orig = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda t, *a, **kw: sorts.append(t.shape[-1]) or orig(t, *a, **kw))
    for params, sorted_vocab in ((SamplingParams(temperature=0.8, max_tokens=4), False),
                                 (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4), True)):
        sorts.clear()
        Engine(model, tok,
               EngineOptions(max_batch=2, max_seq_len=128, drafts=1)).generate(prompts([5, 9], tok.vocab_size), params)
        assert (tok.vocab_size in sorts or model.cfg.vocab_size in sorts) == sorted_vocab


def test_verify_greedy_is_verify_on_one_hot_rows():
    g = torch.Generator().manual_seed(0)
    for k in (0, 1, 3):
        targets = torch.randint(0, 5, (64, k + 1), generator=g)
        # drafts that match their targets often, so every count of accepted drafts turns up
        other = torch.randint(0, 5, (64, k), generator=g)
        drafts = torch.where(torch.rand(64, k, generator=g) < 0.7, targets[:, :k], other)
        one_hot = torch.zeros(64, k + 1, 5).scatter_(-1, targets[..., None], 1.0)
        q = torch.zeros(64, k, 5).scatter_(-1, drafts[..., None], 1.0)     # drafts from any q
        want = verify(one_hot, drafts, torch.arange(64), torch.zeros(64, dtype=torch.long), q)
        got = verify_greedy(targets, drafts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert k == 0 or set(got[1].tolist()) == set(range(k + 1))


def test_every_field_that_changes_logits_keeps_a_greedy_request_off_the_argmax_path():
    """A field declared as changing logits (`sampling._logits`), set, makes a greedy request compute its
    distribution; the declaration is the one place to add such a field."""
    changed = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 3,
               "logit_bias": {5: 2.0}}
    assert set(NEUTRAL) == set(changed)
    assert plain_greedy([SamplingParams(temperature=0)])
    for name, value in changed.items():
        assert not plain_greedy([SamplingParams(temperature=0, **{name: value})]), name


@torch.no_grad()
def test_plain_greedy_steps_take_the_argmax_and_give_the_distributions_tokens(model, tok, monkeypatch):
    """A step whose rows are all greedy with no penalty or bias takes the logits' argmax (no softmax,
    no draw). Its tokens equal the distributions' ones: the same requests beside a sampled one, which
    makes every step compute the distributions, give the same output."""
    ps = prompts([6, 40], tok.vocab_size, seed=3)
    steps = []                    # each decode call's `greedy`
    step = StepRunner.step
    monkeypatch.setattr(StepRunner, "step", lambda self, key, *chunks: (
        key.batch and steps.append(key.sampling.greedy)) or step(self, key, *chunks))
    sampled = SamplingParams(temperature=0.9, seed=1, max_tokens=60, ignore_eos=True)   # 20+ steps
    for k in (0, 2):
        steps.clear()
        alone = [s.output_ids for s in Engine(model, tok, EngineOptions(max_batch=3, max_seq_len=256, drafts=k))
                 .generate(ps, GREEDY)]
        assert steps and all(steps)
        steps.clear()
        eng = Engine(model, tok, EngineOptions(max_batch=3, max_seq_len=256, drafts=k))
        beside = [eng.submit(p, GREEDY) for p in ps] + [eng.submit(ps[0], sampled)]
        while eng.has_work():
            eng.step()
        assert steps and not any(steps[:8])          # a greedy request takes 8+ steps
        assert [s.output_ids for s in beside[:2]] == alone
        penalised = Engine(model, tok, EngineOptions(max_batch=3, max_seq_len=256, drafts=k)).generate(
            ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.0001))
        assert not any(steps[-5:])                     # a penalty needs the processed logits
        assert len(penalised[0].output_ids) == 24


def test_penalties():
    sp = SlotParams(3, 4, "cpu")
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]]).expand(3, 1, 4)
    counts = torch.tensor([0.0, 3.0, 0.0, 0.0]).expand(3, 1, 4)          # token 1 generated three times
    sp.set(0, SamplingParams(temperature=1, repetition_penalty=2.0), 0, torch.tensor([0, 2]))
    sp.set(1, SamplingParams(temperature=1, presence_penalty=0.5), 0, torch.tensor([], dtype=torch.long))
    sp.set(2, SamplingParams(temperature=1, frequency_penalty=0.5), 0, torch.tensor([], dtype=torch.long))
    probs = target_probs(processed_logits(logits, sp, slice(0, 3), counts), sp, slice(0, 3))[:, 0]
    expect = [torch.tensor([1.0, 0.5, -2.0, 0.5]),     # seen (prompt 0, 2; output 1): >0 halved, <0 doubled
              torch.tensor([2.0, 0.5, -1.0, 0.5]),     # presence: -0.5 once
              torch.tensor([2.0, -0.5, -1.0, 0.5])]    # frequency: -0.5 per occurrence
    for row, e in zip(probs, expect):
        assert torch.allclose(row, e.softmax(-1))


@torch.no_grad()
def test_prefix_reuse_resumes_chat_turns(model, tok):
    """Each turn's prompt extends the previous prompt and reply: the slot's state is resumed one row
    before the end of the shared prefix (mid-block starts, a ratio-128 block closing over rows from
    earlier turns), and the replies equal a fresh engine's."""
    for k in (0, 1, 3):
        eng = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=k, reuse_prefix=True))
        fresh = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=k))
        conversation, shared = prompts([40], tok.vocab_size)[0], 0
        for turn, user in enumerate(prompts([20, 30, 5, 1], tok.vocab_size, seed=2)):
            seq = eng.generate([conversation], GREEDY)[0]
            assert seq.output_ids == fresh.generate([conversation], GREEDY)[0].output_ids, f"K={k} turn {turn}"
            assert seq.metrics.cached_tokens >= shared - 1, f"K={k} turn {turn}"
            shared = len(conversation) + len(seq.output_ids)     # the previous prompt and reply
            conversation = conversation + seq.output_ids + user


@torch.no_grad()
def test_prefix_reuse_partial_and_refused(model, tok):
    """A prompt that leaves the previous one midway resumes before the divergence; one whose shared
    rows were overwritten by later positions of the same slot is prefilled afresh."""
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=512, drafts=1, reuse_prefix=True))
    fresh = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=1))
    base, other = prompts([150, 30], tok.vocab_size, seed=4)
    assert eng.generate([base], GREEDY)[0].metrics.cached_tokens == 0
    diverged = base[:100] + other
    seq = eng.generate([diverged], GREEDY)[0]
    assert seq.metrics.cached_tokens == 99 and seq.slot == 0       # the slot with the shared prefix
    assert seq.output_ids == fresh.generate([diverged], GREEDY)[0].output_ids
    # 200 more tokens overwrite the ring rows of the first ~130 positions
    eng.generate([base[:130]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    late = base[:130] + other
    seq = eng.generate([late], GREEDY)[0]
    assert seq.metrics.cached_tokens == 0
    assert seq.output_ids == fresh.generate([late], GREEDY)[0].output_ids
    # without reuse an engine never resumes
    plain = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=1))
    plain.generate([base], GREEDY)
    assert plain.generate([base + other], GREEDY)[0].metrics.cached_tokens == 0


def reference_logprobs(model, prompt, output, temperature=1.0, bias=None):
    """log_softmax of the full forward pass at every output position (what produced each output token)."""
    logits = model(torch.tensor([prompt + output]))[0, len(prompt) - 1: -1].float()
    if bias is not None:
        logits = logits + bias
    return (logits / temperature).log_softmax(-1)


@torch.no_grad()
def test_logprobs_match_the_reference_log_softmax(model, tok):
    """Every committed token (first, accepted drafts, corrections and bonus tokens) reports its logprob and
    the top alternatives under the model's processed distribution, with and without MTP, greedy and sampled
    (a sampled row is scored before its top-p truncation)."""
    ps = prompts([12, 40, 130], tok.vocab_size, seed=6)
    bias = {5: 2.0, 7: -1.5}
    dense = torch.zeros(model.cfg.vocab_size)
    dense[list(bias)] = torch.tensor(list(bias.values()))
    cases = (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5),
             SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=20,
                            logit_bias=bias))
    worst = {}
    for k in (0, 2):
        for params in cases:
            for seq in Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=k)).generate(ps, params):
                assert [e.token for e in seq.logprobs] == seq.output_ids
                temperature = params.temperature or 1.0
                ref = reference_logprobs(model, seq.prompt_ids, seq.output_ids, temperature,
                                         dense if params.logit_bias else None)
                got = torch.tensor([e.logprob for e in seq.logprobs])
                want = ref.gather(-1, torch.tensor(seq.output_ids)[:, None])[:, 0]
                top = ref.topk(params.logprobs, -1)
                assert all(len(e.top) == params.logprobs for e in seq.logprobs)
                assert [[t for t, _ in e.top] for e in seq.logprobs] == top.indices.tolist()
                got_top = torch.tensor([[v for _, v in e.top] for e in seq.logprobs])
                err = max((got - want).abs().max().item(), (got_top - top.values).abs().max().item())
                worst[k] = max(worst.get(k, 0.0), err)
    print(f"max |logprob - reference log_softmax|: {worst}")
    assert all(e <= 1e-4 for e in worst.values()), worst


@torch.no_grad()
def test_logprobs_do_not_change_the_tokens(model, tok):
    ps = prompts([9, 33], tok.vocab_size, seed=7)
    for params in (GREEDY, SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True)):
        plain = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=2)).generate(ps, params)
        scored = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=2)).generate(
            ps, SamplingParams(**{**params.__dict__, "logprobs": 0}))
        assert [s.output_ids for s in scored] == [s.output_ids for s in plain]
        assert all(len(s.logprobs) == len(s.output_ids) and not s.logprobs[0].top for s in scored)
        assert not plain[0].logprobs


@torch.no_grad()
def test_logit_bias(model, tok):
    """A large bias forces a token, a negative one bans it; the bias is the request's alone (a later request
    in the same slot is unbiased), and speculative greedy still equals plain greedy under a bias."""
    p = prompts([15], tok.vocab_size, seed=8)[0]
    free = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=0)).generate([p], GREEDY)[0].output_ids
    forced = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={42: 100.0})
    banned = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={t: -100.0 for t in free})
    for k in (0, 2):
        eng = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=k))
        assert eng.generate([p], forced)[0].output_ids == [42] * 8
        out = eng.generate([p], banned)[0].output_ids
        assert not set(out) & set(free)
        assert eng.generate([p], GREEDY)[0].output_ids == free
    with pytest.raises(ValueError, match="logit_bias: token id"):
        Engine(model, tok,
               EngineOptions(max_batch=1, max_seq_len=256, drafts=0)).submit(p, SamplingParams(logit_bias={10**6: 1.0}))


@torch.no_grad()
def test_min_tokens_holds_back_what_ends_a_reply(model, tok):
    """vLLM's min_tokens: EOS and stop token ids can't end a reply shorter than it, row by row, so a greedy step
    that verifies drafts commits plain decoding's tokens, and a sampled one (drafts drawn from the drafter's
    distribution) ends no earlier; a stop string neither."""
    p = prompts([15], tok.vocab_size, seed=8)[0]
    eos = {tok.eos_id: 100.0}        # without min_tokens the reply ends at once
    greedy = SamplingParams(temperature=0, max_tokens=20, logit_bias=eos)
    assert Engine(model, tok,
                  EngineOptions(max_batch=1, max_seq_len=256, drafts=0)).generate([p], greedy)[0].output_ids == []
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias=eos, min_tokens=5)
    stop_id = SamplingParams(temperature=0, max_tokens=20, logit_bias={42: 100.0}, stop_token_ids=[42], min_tokens=3)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=20, logit_bias={tok.eos_id: 3.0}, min_tokens=7)
    want = {}
    for k in (0, 1, 3):
        eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=256, drafts=k))
        got = eng.generate([p], held)[0]
        assert len(got.output_ids) == 5 and got.finish_reason == "stop"   # EOS the first token it may be
        out = eng.generate([p], stop_id)[0].output_ids
        assert len(out) == 3 and 42 not in out         # the stop id (forced) the first token it may be
        runs = {name: eng.generate([p], params)[0].output_ids for name, params in (("held", held), ("stop", stop_id))}
        assert runs == want.setdefault("runs", runs), k
        out = eng.generate([p], sampled)[0].output_ids
        assert len(out) >= 7 and tok.eos_id not in out
    text = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=0)).generate(
        [p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[text.text[:1]], min_tokens=6)
    got = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=256, drafts=0)).generate([p], stop)[0]
    assert len(got.output_ids) >= 6 and got.text.startswith(text.text[: len(got.text)])
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="min_tokens: must be in 0..max_tokens"):
            Engine(model, tok,
                   EngineOptions(max_batch=1, max_seq_len=256, drafts=0)).submit(p, SamplingParams(max_tokens=20,
                                                                                              min_tokens=bad))


def test_engine_and_tp_leader_provide_the_engine_api(model, tok):
    """Front ends see one API: the engine's own in one process, rank 0's Leader (which mirrors commands to
    the other ranks) under --tp; the Leader spells out each member instead of forwarding unknown names."""
    engine = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=64, drafts=1))
    leader = parallel.Leader(engine, control=None, procs=[], watchdog=threading.Event())
    assert isinstance(engine, EngineAPI) and isinstance(leader, EngineAPI)
    assert not hasattr(parallel.Leader, "__getattr__")
    assert (leader.tok, leader.draft_depth, leader.max_seq_len, leader.totals) == (tok, 1, 64, engine.totals)
    cfg = model.cfg
    info = leader.model_info
    assert info == ModelInfo(parameters=sum(p.numel() for p in model.parameters()), weights="float", dtype="float32",
                             device="cpu", layers=cfg.n_layers, drafter_layers=cfg.n_mtp_layers,
                             vocab_size=cfg.vocab_size, drafter="mtp", block_size=0)
    int8 = Engine(quantize_model(copy.deepcopy(model)), tok,
                  EngineOptions(max_batch=1, max_seq_len=64, drafts=0)).model_info
    assert int8.weights == "w8a8" and int8.parameters == info.parameters      # weight scales are not parameters
    release = Engine(release_model(copy.deepcopy(model)), tok,
                     EngineOptions(max_batch=1, max_seq_len=64, drafts=0)).model_info
    assert release.weights == "fp8+fp4" and release.parameters == info.parameters     # FP4: two values a byte


@torch.no_grad()
def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on(model, tok):
    """A fault in the device state makes a step raise: the requests in that step end with an error event
    and free their slots, a request admitted next answers as on a fresh engine, a request whose own
    settings can't be admitted fails alone."""
    ps = prompts([5, 9, 7, 6], tok.vocab_size, seed=3)
    ref = [s.output_ids for s in Engine(model, tok,
                                        EngineOptions(max_batch=2, max_seq_len=128, drafts=1)).generate(ps, GREEDY)]
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=128, drafts=1))
    a, b = eng.submit(ps[0], GREEDY), eng.submit(ps[1], GREEDY)
    while not (a.output_ids and b.output_ids):
        eng.step()
    eng.runner.state.last[0] = tok.vocab_size + 5        # a token id the embedding doesn't have: the next step raises
    events = eng.step()
    assert sorted(id(e.seq) for e in events) == sorted([id(a), id(b)]) and all(e.finished for e in events)
    assert a.finish_reason == b.finish_reason == "error" and a.error.startswith("engine step failed: IndexError")
    assert not eng.has_work() and eng.failed_steps == 1
    c, d = eng.submit(ps[2], GREEDY), eng.submit(ps[3], GREEDY)
    d.params = SamplingParams(temperature=1e300)    # changed after submit: its admission raises
    while eng.has_work():
        eng.step()
    assert c.output_ids == ref[2] and eng.failed_steps == 0
    assert d.finish_reason == "error" and "overflow" in d.error and not d.output_ids


@torch.no_grad()
def test_steps_that_keep_failing_end_the_engine(model, tok):
    broken = copy.deepcopy(model)
    broken.embed.weight.data = broken.embed.weight.data[:0]     # every step's lookup fails, whatever it holds
    eng = Engine(broken, tok, EngineOptions(max_batch=2, max_seq_len=128, drafts=0))
    for _ in range(2):
        seq = eng.submit(prompts([5], tok.vocab_size)[0], GREEDY)
        assert [e.seq.finish_reason for e in eng.step()] == ["error"] and seq.error
    eng.submit(prompts([5], tok.vocab_size)[0], GREEDY)
    with pytest.raises(EngineFailed, match="3 engine steps in a row failed; the last: RuntimeError"):
        eng.step()
    with pytest.raises(ValueError, match="temperature: must be a finite float32 number"):
        eng.submit([1, 2], SamplingParams(temperature=1e300))   # the Python API checks what the device holds
