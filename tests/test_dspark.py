"""The 0731 checkpoints' DSpark drafter: its block against a reference written from the spec
(dsv4-dspark.md §3), greedy speculative output equal to plain greedy at every verified length and under
`auto`, sampling distribution-exact under the drafts' q, and the checkpoint layouts loaded tensor by
tensor (official FP8/FP4, msModelSlim W8A8 with the drafter's own vocabulary copies) or refused in one line."""
import math

import pytest
import torch
from test_fp8 import is_official_fp8, write_official
from tiny import prompts, random_model, tiny_dspark_config, write_checkpoint

from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.engine.draft_length import DraftLength
from dsv4cli.engine.verify import verify
from dsv4cli.kernels import reference
from dsv4cli.model import DecodeState, LoadError, Segment, load_model
from dsv4cli.model.quant import save_w8a8
from dsv4cli.tokenizer import Tokenizer

CFG = tiny_dspark_config()            # window 16; ratio-4 and ratio-128 layers; 3 stages; block 5
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("dspark")
    write_checkpoint(path, CFG, seed=3)
    return load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir("dsv4cli/assets/dsv4-tiny")      # any tokenizer: the tests read token ids


# ---- a reference from the spec ------------------------------------------------------------------

def rms(x, weight=None, eps=1e-6):
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope(x, positions, rd, theta, inverse=False):
    """Interleaved pairs of the last `rd` dims rotated by position * theta^(-2i/rd) (GPT-J style), or back."""
    freqs = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    angle = positions.double()[:, None] * freqs * (-1 if inverse else 1)          # [S, rd/2]
    shape = [len(positions)] + [1] * (x.dim() - 2) + [rd // 2]
    cos, sin = angle.cos().view(shape).float(), angle.sin().view(shape).float()
    a, b = x[..., -rd:][..., 0::2], x[..., -rd:][..., 1::2]
    return torch.cat([x[..., :-rd], torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)], -1)


def spec_attention(attn, x, context, block_pos, cfg):
    """DSparkAttention.forward of the spec for one sequence: x [5, D] the block's rows at block_pos,
    context [C, Dh] the ring's keys; every query sees all of them (non-causal) and the sink."""
    H, Dh, rd = attn.n_heads, cfg.head_dim, cfg.rope_dim
    q = attn.wq_b(rms(attn.wq_a(x), attn.q_norm.weight))
    q = rope(rms(q.view(-1, H, Dh)), block_pos, rd, cfg.rope_theta)
    kv = rope(rms(attn.wkv(x), attn.kv_norm.weight), block_pos, rd, cfg.rope_theta)
    keys = torch.cat([context, kv])                                             # K = V
    scores = torch.einsum("shd,nd->shn", q, keys) * Dh ** -0.5
    sink = attn.attn_sink.view(1, H, 1).expand(len(x), H, 1)
    p = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    o = rope(torch.einsum("shn,nd->shd", p, keys), block_pos, rd, cfg.rope_theta, inverse=True)
    G, r = attn.n_groups, cfg.o_lora_rank
    z = torch.einsum("sgd,grd->sgr", o.reshape(len(x), G, -1), attn.wo_a.weight.view(G, r, -1))
    return attn.wo_b(z.flatten(1))


@torch.no_grad()
def spec_block(model, prompt: list[int], anchor: int, embed=None, head=None, features=None):
    """forward_spec after a prefill of `prompt` with `anchor` as the newest token: target features from
    hooks on the trunk's target layers (mean of their output streams), main_x, each stage's ring keys
    of the last `window` positions, the block through the stages, hc_head, norm, head, the Markov bias
    slot by slot (greedy drafts), confidence; `embed`, `head`: the drafter's own (else the trunk's);
    `features` [P, F]: the target features given (else the model's trunk computes them).
    Returns (base logits, biased logits, drafts, confidence)."""
    embed = model.embed.weight if embed is None else embed
    head = model.head.weight if head is None else head
    cfg = model.cfg
    if features is None:
        outs = {}
        hooks = [model.layers[i].register_forward_hook(lambda m, a, out, i=i: outs.__setitem__(i, out))
                 for i in cfg.dspark_target_layer_ids]
        model(torch.tensor([prompt]))
        for h in hooks:
            h.remove()
        features = torch.cat([outs[i][0].mean(1) for i in cfg.dspark_target_layer_ids], -1)      # [P, 3D]
    first, last = model.mtp[0], model.mtp[-1]
    main_x = rms(first.main_proj(features), first.main_norm.weight)
    n = len(prompt)
    ctx = torch.arange(max(0, n - cfg.window_size), n)
    block_pos = n + torch.arange(cfg.dspark_block_size)
    ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (cfg.dspark_block_size - 1))
    h = embed[ids][None, :, None].repeat(1, 1, cfg.hc_mult, 1)
    for stage in model.mtp:
        attn = stage.attn
        context = rope(rms(attn.wkv(main_x[ctx]), attn.kv_norm.weight), ctx, cfg.rope_dim, cfg.rope_theta)
        h = stage.hyper_connection(h, "attn", lambda x, s=stage, c=context: spec_attention(
            s.attn, s.attn_norm(x)[0], c, block_pos, cfg)[None])
        h = stage.hyper_connection(h, "ffn", lambda x, s=stage: s.ffn(s.ffn_norm(x), None))
    hf = h[0].flatten(1)
    mix = hf @ last.hc_head_fn.T * torch.rsqrt(hf.square().mean(-1, keepdim=True) + cfg.norm_eps)
    pre = torch.sigmoid(mix * last.hc_head_scale + last.hc_head_base) + cfg.hc_eps
    y = (pre[..., None] * h[0]).sum(1)                                            # [5, D]
    base = rms(y, last.norm.weight) @ head.T
    markov, biased, drafts, embeddings, prev = last.markov_head, [], [], [], anchor
    for i in range(cfg.dspark_block_size):
        e = markov.markov_w1.weight[prev]
        biased.append(base[i] + e @ markov.markov_w2.weight.T)
        prev = int(biased[-1].argmax())
        drafts.append(prev)
        embeddings.append(e)
    confidence = torch.cat([y, torch.stack(embeddings)], -1) @ last.confidence_head.proj.weight[0]
    return base, torch.stack(biased), drafts, confidence


@torch.no_grad()
def engine_block(model, prompt: list[int], anchor: int):
    """The same through the model's cached path as the drafter runs it: prefill into a DecodeState, the
    committed rows into the rings, one block pass, then the Markov bias and confidence."""
    state = DecodeState(model, 1, 256, max_draft=6)
    start = torch.tensor([0])
    ids = torch.tensor([prompt])
    (rows,) = model.forward_segments([Segment(ids, start, state)])
    committed = Segment(ids, start, state, length=torch.tensor([len(prompt)]))
    model.dspark_write(model.dspark_context(rows.features), committed)
    base, y = model.dspark_block(torch.tensor([anchor]), torch.tensor([len(prompt)]), state)
    markov, biased, drafts, embeddings, prev = model.mtp[-1].markov_head, [], [], [], torch.tensor([anchor])
    for i in range(model.cfg.dspark_block_size):
        e, bias = markov(prev)
        biased.append(base[0, i] + bias[0])
        prev = biased[-1].argmax()[None]
        drafts.append(int(prev))
        embeddings.append(e)
    confidence = model.mtp[-1].confidence_head(y, torch.stack(embeddings, 1))[0]
    return base[0], torch.stack(biased), drafts, confidence


@pytest.mark.parametrize("length", [3, 16, 17, 40, 130])        # inside, at and past the window of 16
def test_the_block_equals_the_spec(model, length):
    prompt = prompts([length], CFG["vocab_size"], seed=length)[0]
    want, got = spec_block(model, prompt, 42), engine_block(model, prompt, 42)
    for a, b in zip(got[:2], want[:2]):
        assert ((a - b).norm() / b.norm()).item() < 1e-4
    assert got[2] == want[2]
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-4)


# ---- exactness through the engine -------------------------------------------------------------

@torch.no_grad()
def test_greedy_with_dspark_equals_greedy_without(model, tok):
    """Every verified length and `auto`, batch 1 and 8 (continuous batching with joins), prompts around the
    window (16), the ratio-4 and ratio-128 boundaries, and chunked prefill (200 tokens over a budget of 160;
    then chunks of 16 through the ring's edges)."""
    ps = prompts([3, 15, 17, 127, 129, 200], CFG["vocab_size"])
    plain = [s.output_ids for s in Engine(model, tok,
                                          EngineOptions(max_batch=6, max_seq_len=320, drafts=0)).generate(ps, GREEDY)]
    for k in (1, 2, 3, 5, "auto"):
        for batch in (1, 8):
            eng = Engine(model, tok, EngineOptions(max_batch=batch, max_seq_len=320, drafts=k, isolate_failures=False))
            assert [s.output_ids for s in eng.generate(ps, GREEDY)] == plain, (k, batch)
            assert eng.totals.draft_tokens > 0
            if k != "auto":         # --drafts L verifies L of the block's drafts every step, not the whole block
                assert eng.totals.draft_tokens == k * eng.totals.drafts, (k, batch)
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=320, drafts=5, prefill_chunk=16, prefill_budget=16))
    assert [s.output_ids for s in eng.generate(ps, GREEDY)] == plain


@torch.no_grad()
def test_a_resumed_chat_turn_leaves_the_drafters_rings_as_a_fresh_prefill_does(model, tok):
    """Prefix reuse (chat) resumes a slot's state one row before the shared prefix ends: the stages' rings
    must then hold what a fresh engine's hold (greedy tokens would not show a wrong ring, only acceptance
    would), and the replies and their acceptance equal a fresh engine's."""
    eng = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=5, reuse_prefix=True))
    fresh = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=512, drafts=5))
    conversation = prompts([40], CFG["vocab_size"])[0]
    for turn, user in enumerate(prompts([20, 3, 30], CFG["vocab_size"], seed=2)):
        seq, want = eng.generate([conversation], GREEDY)[0], fresh.generate([conversation], GREEDY)[0]
        assert seq.output_ids == want.output_ids and (turn == 0 or seq.metrics.cached_tokens > 0)
        assert seq.metrics.accepted_per_position == want.metrics.accepted_per_position, turn
        end = len(conversation) + len(seq.output_ids) - 1          # positions the trunk has committed
        for a, b in zip(eng.runner.state.cache.drafter, fresh.runner.state.cache.drafter):
            ring = a.win.shape[1]
            rows = torch.arange(max(0, end - ring), end) % ring
            torch.testing.assert_close(a.win[0, rows], b.win[0, rows], rtol=1e-5, atol=1e-5)
        conversation = conversation + seq.output_ids + user


def test_auto_verifies_the_length_with_the_most_tokens_per_second():
    """DraftLength: each length measured first, then the one with the most expected tokens per measured
    second; plain (L 0) when no length pays for its step."""
    lengths, sure = DraftLength(5, torch.device("cpu"), 1), [[0.9] * 5]
    for n in range(6):
        assert lengths.choose(1, sure) == n
        lengths.observe(1, n, 1.0 + 0.1 * n)
    # confident drafts: 1 + .9 + .81 + ... tokens for 1.5 s beats 1 token for 1.0 s
    assert lengths.choose(1, sure) == 5
    # drafts that are rarely right: plain, which skips the block pass
    assert lengths.choose(1, [[0.05] * 5]) == 0
    assert lengths.report()["chosen"] == {0: 2, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2}


@pytest.mark.parametrize("costs_ms", [(5.0, 17.0, 20.3, 23.4, 26.3, 26.5),     # a CPU at batch 1: plain wins
                                      (5.0, 5.1, 5.2, 5.3, 5.4, 5.5)])         # an accelerator: L 5 wins
def test_auto_re_measuring_loses_at_most_one_percent(costs_ms):
    """Over 20,000 steps at fixed costs, auto's tokens per second (re-measurements included) stay within 1 %
    of always verifying the best length, and every length is still re-measured now and then."""
    confidences = [[0.6, 0.5, 0.4, 0.3, 0.2]]
    lengths, seconds, tokens = DraftLength(5, torch.device("cpu"), 1), 0.0, 0.0
    for _ in range(20_000):
        n = lengths.choose(1, confidences)
        lengths.observe(1, n, costs_ms[n] / 1e3)
        seconds, tokens = seconds + costs_ms[n] / 1e3, tokens + DraftLength.expected_tokens(n, confidences)
    best = max(DraftLength.expected_tokens(n, confidences) / (c / 1e3) for n, c in enumerate(costs_ms))
    assert tokens / seconds >= 0.99 * best
    assert all(lengths.chosen[n] >= 3 for n in range(6)), lengths.chosen


def test_a_row_verifying_fewer_drafts_commits_what_a_step_of_that_many_does():
    """verify with per-row limits, token for token against a step of each row's own length (sampled, drafts
    from q), and a limit of 0 samples the first row as plain decoding does."""
    B, K, V = 64, 4, 5
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    seed, pos = torch.arange(B), torch.randint(0, 100, (B,), generator=g)
    limit = torch.arange(B) % (K + 1)
    tokens, n_acc = verify(p, drafts, seed, pos, q, limit)
    for i in range(B):
        n = int(limit[i])
        want, want_n = verify(p[i:i + 1, :n + 1], drafts[i:i + 1, :n], seed[i:i + 1], pos[i:i + 1], q[i:i + 1, :n])
        assert int(n_acc[i]) == int(want_n[0]) <= n
        assert tokens[i, :n + 1][: int(n_acc[i]) + 1].tolist() == want[0, : int(want_n[0]) + 1].tolist()


@torch.no_grad()
def test_auto_going_plain_and_back_keeps_greedy_output(model, tok):
    """An engine whose measured costs make plain best, then drafting best again: the steps switch between
    plain (no block pass) and drafting, each slot back from plain verifying nothing its first step, and the
    tokens stay plain greedy's."""
    ps = prompts([15, 40], CFG["vocab_size"], seed=11)
    want = [s.output_ids for s in Engine(model, tok,
                                         EngineOptions(max_batch=2, max_seq_len=320, drafts=0)).generate(ps, GREEDY)]
    eng = Engine(model, tok, EngineOptions(max_batch=2, max_seq_len=320, drafts="auto"))
    seqs = [eng.submit(p, GREEDY) for p in ps]
    steps = 0
    while eng.has_work():
        # every length measured, as the engine would measure them: plain cheap for 8 steps, then dear
        plain_cost = 1e-9 if steps // 8 % 2 == 0 else 1e3
        eng.lengths.cost = {(b, n): (plain_cost if n == 0 else 1.0) for b in (1, 2) for n in range(6)}
        eng.lengths.seen = {k: eng.lengths.steps for k in eng.lengths.cost}
        eng.step()
        steps += 1
    assert [s.output_ids for s in seqs] == want
    assert eng.lengths.chosen.get(0, 0) > 0 and eng.lengths.chosen.get(5, 0) > 0 and eng.totals.draft_tokens > 0


@torch.no_grad()
def test_a_seeded_sampled_request_gives_its_tokens_whatever_auto_measures(model, tok):
    """Under auto a sampled request with a seed verifies the whole block every step: its tokens are those
    of --drafts 5, alone or beside greedy requests whose steps auto makes plain."""
    prompt = prompts([20], CFG["vocab_size"], seed=13)[0]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    want = Engine(model, tok,
                  EngineOptions(max_batch=1, max_seq_len=320, drafts=5)).generate([prompt], params)[0].output_ids
    alone = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=320, drafts="auto")).generate([prompt], params)[0]
    assert alone.output_ids == want
    eng = Engine(model, tok, EngineOptions(max_batch=3, max_seq_len=320, drafts="auto"))
    others = [eng.submit(p, GREEDY) for p in prompts([9, 30], CFG["vocab_size"], seed=14)]
    for _ in range(3):
        eng.step()
    seeded = eng.submit(prompt, params)
    while eng.has_work():
        eng.lengths.cost = {(b, n): (1e-9 if n == 0 else 1.0) for b in (1, 2, 3) for n in range(6)}   # plain best
        eng.lengths.seen = {k: eng.lengths.steps for k in eng.lengths.cost}
        eng.step()
    assert seeded.output_ids == want and all(s.finish_reason == "length" for s in others)


def test_verify_with_the_drafts_q_is_distribution_exact():
    """Drafts drawn from q (not argmaxes), accepted with min(1, p/q), the residual max(p - q, 0) on
    rejection: the first token ~ p0, and given the first draft was accepted, the second ~ p1
    (chi-square over 40k independent seeds)."""
    V, N = 6, 40_000
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(2)], 1)
    tokens, n_acc = verify(p.expand(N, -1, -1), drafts, torch.arange(N), torch.zeros(N, dtype=torch.long),
                           q.expand(N, -1, -1))

    def chi2(samples, want):
        counts = torch.bincount(samples, minlength=V).double()
        expected = want.double() * samples.numel()
        return (((counts - expected) ** 2) / expected).sum().item()

    assert chi2(tokens[:, 0], p[0]) < 20.5          # 99.9% quantile of chi-square with 5 degrees of freedom
    assert chi2(tokens[n_acc >= 1, 1], p[1]) < 20.5
    assert (n_acc == 2).any() and (n_acc == 0).any()


@torch.no_grad()
def test_sampled_dspark_keeps_the_models_distribution(model, tok):
    """The first two sampled tokens of 2,000 seeded requests with DSpark (every draft drawn from its
    Markov-biased q) follow the model's own distributions: the first its prompt's last row, the second
    (given the commonest first) the row after it; and a seeded request gives the same tokens at batch 1
    and beside others."""
    prompt = prompts([12], CFG["vocab_size"], seed=7)[0]
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=2, ignore_eos=True) for s in range(2000)]
    eng = Engine(model, tok, EngineOptions(max_batch=16, max_seq_len=64, drafts=5))
    seqs = [eng.submit(prompt, p) for p in params]
    while eng.has_work():
        eng.step()
    assert eng.totals.accepted_tokens > 100           # drafts were accepted, not just rejected
    first = torch.tensor([s.output_ids[0] for s in seqs])
    p0 = (model(torch.tensor([prompt]))[0, -1] / 1.5).softmax(-1)
    top = int(first.mode().values)
    p1 = (model(torch.tensor([prompt + [top]]))[0, -1] / 1.5).softmax(-1)
    second = torch.tensor([s.output_ids[1] for s in seqs if s.output_ids[0] == top])

    def chi2(samples, want):       # bins with an expected count of 5 and more; the rest pooled
        counts, expected = torch.bincount(samples, minlength=len(want)).double(), want.double() * samples.numel()
        big = expected >= 5
        stat = (((counts - expected) ** 2) / expected)[big].sum() + \
            (counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum().clamp(min=1e-9)
        return stat.item(), int(big.sum())        # degrees of freedom: the bins

    for samples, want in ((first, p0), (second, p1)):
        stat, bins = chi2(samples, want)
        limit = bins + 3.3 * math.sqrt(2 * bins)                  # about the 99.9% quantile
        assert stat < limit, (stat, limit)
    again = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=64, drafts=5)).generate([prompt], params[5])[0]
    assert again.output_ids == seqs[5].output_ids


# ---- checkpoints ------------------------------------------------------------------------------

def test_the_official_release_loads_with_its_three_stages(tmp_path):
    """config.json as 0731 ships it: num_nextn_predict_layers still 1 and 46 compress_ratios; the stages are
    read off compress_ratios and checked against the mtp.N tensors (FP8 linears, FP4 experts, bf16 heads)."""
    assert is_official_fp8("mtp.0.main_proj") and not is_official_fp8("mtp.2.confidence_head.proj")
    want = write_official(tmp_path, CFG, seed=2)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.cfg.drafter == "dspark" and model.cfg.n_mtp_layers == 3 and not model.cfg.dspark_vocab_copies
    prompt = prompts([30], CFG["vocab_size"], seed=3)[0]
    for a, b in zip(engine_block(model, prompt, 9)[:2], spec_block(want.eval(), prompt, 9)[:2]):
        assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_a_missing_or_leftover_drafter_tensor_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file
    write_checkpoint(tmp_path, CFG, seed=1)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("mtp.2.markov_head.markov_w2.weight")
    save_file(tensors, path)
    with pytest.raises(LoadError, match=r"missing tensor 'mtp\.2\.markov_head\.markov_w2\.weight'$"):
        load_model(tmp_path)
    tensors["mtp.2.markov_head.markov_w2.weight"] = torch.zeros(CFG["vocab_size"], CFG["dspark_markov_rank"])
    tensors["mtp.1.e_proj.weight"] = torch.zeros(4, 4)             # a preview-layout tensor left over
    save_file(tensors, path)
    with pytest.raises(LoadError, match=r"unexpected tensor 'mtp\.1\.e_proj\.weight'$"):
        load_model(tmp_path)
    config = tiny_dspark_config(compress_ratios=[0, 4, 128, 4, 0, 0])          # two stages in the config
    with pytest.raises(LoadError, match=r"n_mtp_layers \(the DSpark stages.*is 2 but the checkpoint has DSpark "
                                        r"stages 0\.\.2"):
        write_checkpoint(tmp_path / "two", CFG, seed=1)
        (tmp_path / "two" / "config.json").write_text(__import__("json").dumps(config))
        load_model(tmp_path / "two")


@torch.no_grad()
def test_w8a8_drafting_uses_its_own_vocabulary_and_equals_its_dequantised_math(tmp_path):
    """msModelSlim's layout: the stages' linears int8 (wo_a/wo_b and main_proj included, read by label; wo_a
    held dequantised), mtp.0.embed and mtp.2.head written beside the trunk's. The loaded drafter reads
    those copies (here: made different from the trunk's, as QuaRot's rotated trunk would be) and equals its
    dequantised float math on the same target features: the spec's reference on float weights int8 x scale,
    each int8 linear's input rounded to int8 per token as the W8A8 GEMMs take it (the int32 sums against
    fp32 ones: an activation now and then crosses a rounding step). Without a crossing the two agree to ~4e-7;
    one moves the logits by up to ~6e-3 (this seed on a Zen 4 core, whose fp32 GEMMs sum in another order),
    a wrong table or scale by far more."""
    float_model = random_model(CFG, seed=4)
    save_w8a8(float_model, CFG, tmp_path)
    from safetensors.torch import load_file, save_file
    shard = tmp_path / "quant_model_weights.safetensors"
    tensors = load_file(shard)
    assert tensors["mtp.0.attn.wo_a.weight"].dtype == tensors["mtp.0.main_proj.weight"].dtype == torch.int8
    tensors["embed.weight"] = tensors["embed.weight"].roll(1, 0)       # the trunk's, no longer the drafter's
    save_file(tensors, shard)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.cfg.dspark_vocab_copies and model.mtp[0].attn.wo_a.weight.dtype == torch.float32
    assert model.mtp[0].main_proj.weight_scale is not None            # int8, held so
    prompt = prompts([20], CFG["vocab_size"], seed=5)[0]
    got = engine_block(model, prompt, 11)
    state = DecodeState(model, 1, 64, max_draft=6)
    features = model.forward_segments([Segment(torch.tensor([prompt]), torch.tensor([0]), state)])[0].features[0]
    dequantised = random_model(CFG, seed=4)
    modules = dict(dequantised.named_modules())

    def per_token_int8(module, args):
        q, scale = reference.quantize_per_token(args[0].reshape(-1, args[0].shape[-1]))
        return ((q.float() * scale).view_as(args[0]), *args[1:])

    for name, p in dequantised.named_parameters():
        prefix = name.rpartition(".")[0]
        if name.endswith(".weight") and name + "_scale" in tensors:
            p.copy_(tensors[name].float() * tensors[name + "_scale"])
            if not modules[prefix].float_only:
                modules[prefix].register_forward_pre_hook(per_token_int8)
        elif name in tensors:
            p.copy_(tensors[name].float())
    want = spec_block(dequantised, prompt, 11, tensors["mtp.0.embed.weight"].float(),
                      tensors["mtp.2.head.weight"].float(), features)
    for a, b in zip(got[:2], want[:2]):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    assert got[2] == want[2]


# ---- tensor parallelism ----------------------------------------------------------------------

def _block_on_rank(rank, world, port, path, out):
    from dsv4cli import parallel
    parallel.init_rank(rank, world, port, torch.device("cpu"))
    model = load_model(path, dtype=torch.float32)
    block = engine_block(model, prompts([30], CFG["vocab_size"], seed=8)[0], 42)
    if rank == 0:
        torch.save(block, out)
    parallel.leave()


def test_tp2_drafts_the_block_of_tp1(tmp_path):
    """Under --tp 2 the stages split their heads and experts as trunk layers do and the Markov tables
    split along the vocabulary: the block's logits, drafts and confidences are one process's."""
    import torch.multiprocessing as mp

    from dsv4cli import parallel
    write_checkpoint(tmp_path / "m", CFG, seed=6)
    store = parallel.rendezvous()
    mp.start_processes(_block_on_rank, args=(2, store.port, tmp_path / "m", tmp_path / "tp2.pt"),
                       nprocs=2, start_method="spawn")
    got = torch.load(tmp_path / "tp2.pt")
    want = engine_block(load_model(tmp_path / "m", dtype=torch.float32), prompts([30], CFG["vocab_size"], seed=8)[0],
                        42)
    for a, b in zip(got[:2], want[:2]):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    assert got[2] == want[2]
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)
