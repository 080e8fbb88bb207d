"""The block verification rule (`verify.verify_block`; Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025, Algorithm 2): the rule itself, worked exactly on a small vocabulary, is lossless and
never accepts fewer drafts in expectation than the token rule; the code draws what the rule says, on a block
worked by hand and on random ones; greedy rows match prefixes; a row's limit acts as a shorter block; and
the engine's sampled output with it is the model's (a chi-square test against no drafting, for both drafter
kinds; the test sees a temperature shift of 0.1)."""
import itertools
import math
import random
from fractions import Fraction

import pytest
import torch

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.engine.api import drafter_label
from dsv4cli.engine.verify import expected_accepted, verify, verify_block
from dsv4cli.model import load_model
from dsv4cli.tokenizer import Tokenizer

N_SEEDS = 200_000


def outcomes(probs, drafts, q=None, limit=None, rule=verify_block, n=N_SEEDS) -> dict[tuple, float]:
    """How often each committed sequence comes out of `rule` for one row over n seeds."""
    B = n
    tokens, n_acc = rule(probs.expand(B, -1, -1), drafts.expand(B, -1), torch.arange(B),
                         torch.zeros(B, dtype=torch.long), None if q is None else q.expand(B, -1, -1),
                         None if limit is None else torch.full((B,), limit))
    seen: dict[tuple, int] = {}
    for row, k in zip(tokens.tolist(), n_acc.tolist()):
        seen[tuple(row[:k + 1])] = seen.get(tuple(row[:k + 1]), 0) + 1
    return {k: v / n for k, v in seen.items()}


def close(got: dict, want: dict, n=N_SEEDS) -> bool:
    """Every outcome's frequency within 5 standard errors of its probability, and nothing else seen."""
    return set(got) <= {k for k, v in want.items() if v > 0} and all(
        abs(got.get(k, 0.0) - float(v)) <= 5 * math.sqrt(float(v) * (1 - float(v)) / n) + 1e-12
        for k, v in want.items())


# A block of two drafts (1, 2) over a vocabulary of three, with these target rows p1..p3 and draft rows q1, q2:
P = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.6, 0.2, 0.2]])
Q = torch.tensor([[0.2, 0.6, 0.2], [0.05, 0.15, 0.8]])
D = torch.tensor([1, 2])


def test_a_block_worked_by_hand():
    """w1 = min(1, .3/.6) = 1/2 and w2 = min(1, w1 .3/.8) = 3/16 (the mass each prefix carries). The residual
    after no draft is max(p1 - q1, 0) = (.3, 0, 0); after one, max(w1 p2 - q2, 0) = (.05, .1, 0), of mass .15,
    so prefix 1's test is .15 / (.15 + 1 - w1) = 3/13 and the whole block's w2 = 3/16. The longest prefix that
    passes: 2 w.p. 3/16, 1 w.p. 3/13 x 13/16 = 3/16, none w.p. 5/8; then the correction from that prefix's
    residual (token 0; tokens 0 and 1 as 1:2) or the bonus from p3. The token rule (accept w.p. 1/2, then 3/8;
    correct from max(p - q, 0)) commits the same block w.p. 3/16 but keeps one draft more often, for this block
    (over drafts drawn from q, the block rule accepts at least as many: the next test). A limit of one draft is
    a block of one, where the two rules agree."""
    want = {(0,): Fraction(5, 8), (1, 0): Fraction(1, 16), (1, 1): Fraction(1, 8),
            **{(1, 2, y): Fraction(3, 16) * Fraction(P[2, y].item()).limit_denominator(10) for y in range(3)}}
    assert sum(want.values()) == 1 and close(outcomes(P, D, Q), want)
    token = {(0,): Fraction(1, 2), (1, 0): Fraction(1, 2) * Fraction(5, 8) * Fraction(3, 10),
             (1, 1): Fraction(1, 2) * Fraction(5, 8) * Fraction(7, 10),
             **{(1, 2, y): Fraction(3, 16) * Fraction(P[2, y].item()).limit_denominator(10) for y in range(3)}}
    assert sum(token.values()) == 1 and close(outcomes(P, D, Q, rule=verify), token)
    one = {(0,): Fraction(1, 2), **{(1, y): Fraction(1, 2) * Fraction(P[1, y].item()).limit_denominator(10)
                                    for y in range(3)}}
    assert close(outcomes(P, D, Q, limit=1), one) and close(outcomes(P, D, Q, limit=1, rule=verify), one)


# ---- the rule, exactly: Algorithm 2 in fractions ---------------------------------------------------------

def block_rule(p: list, q: list, block: tuple) -> dict[int, tuple[Fraction, list]]:
    """For target rows p[0..K] and draft rows q[0..K-1] (lists of Fractions) and the drafts `block`: each
    accepted length's probability and the distribution its last token is drawn from."""
    K, V = len(block), len(p[0])
    w = [Fraction(1)]
    for i, d in enumerate(block):
        w.append(min(Fraction(1), w[-1] * p[i][d] / q[i][d]))
    residual, test = [], []
    for i in range(K):
        r = [max(w[i] * p[i][x] - q[i][x], 0) for x in range(V)]
        residual.append(r)
        test.append(sum(r) / (sum(r) + 1 - w[i]) if sum(r) else Fraction(0))
    test.append(w[K])
    out = {}
    for n in range(K + 1):
        chance = (test[n] if n else Fraction(1)) * math.prod((1 - test[j] for j in range(n + 1, K + 1)), start=1)
        if chance:
            last = p[K] if n == K else [x / sum(residual[n]) for x in residual[n]]
            out[n] = (chance, last)
    return out


def token_rule(p: list, q: list, block: tuple) -> dict[int, tuple[Fraction, list]]:
    """The same for the token rule."""
    K, V, reach, out = len(block), len(p[0]), Fraction(1), {}
    for i, d in enumerate(block):
        accept = min(Fraction(1), p[i][d] / q[i][d])
        r = [max(p[i][x] - q[i][x], 0) for x in range(V)]
        if reach * (1 - accept):
            out[i] = (reach * (1 - accept), [x / sum(r) for x in r])
        reach *= accept
    out[K] = (reach, p[K])
    return out


def test_the_rule_is_lossless_and_accepts_at_least_as_much_as_the_token_rule():
    """Context-dependent target and draft models over 3 tokens, blocks of 2 drafted from the draft model: the
    first 3 tokens over as many steps as it takes are distributed as the target's, for both rules (exact
    arithmetic), and the block rule's expected accepted drafts per step is higher (the paper's two-token example
    too: 11/9 against 10/9)."""
    V, K, N = 3, 2, 3
    rng, rows = random.Random(0), {}

    def row(kind, prefix):
        if (kind, prefix) not in rows:
            weights = [rng.randint(1, 9) for _ in range(V)]
            rows[kind, prefix] = [Fraction(x, sum(weights)) for x in weights]
        return rows[kind, prefix]

    def step(rule, c):
        """{committed tokens: probability} of one step after context c."""
        out = {}
        for block in itertools.product(range(V), repeat=K):
            drawn = math.prod(row("q", c + block[:i])[block[i]] for i in range(K))
            p = [row("p", c + block[:i]) for i in range(K + 1)]
            q = [row("q", c + block[:i]) for i in range(K)]
            for n, (chance, last) in rule(p, q, block).items():
                for y in range(V):
                    key = block[:n] + (y,)
                    out[key] = out.get(key, 0) + drawn * chance * last[y]
        return out

    def first_tokens(rule):
        dist = {}

        def go(c, chance):
            if len(c) >= N:
                dist[c[:N]] = dist.get(c[:N], 0) + chance
                return
            for tokens, pr in step(rule, c).items():
                go(c + tokens, chance * pr)
        go((), Fraction(1))
        return dist

    target = {s: math.prod(row("p", s[:i])[s[i]] for i in range(N)) for s in itertools.product(range(V), repeat=N)}
    for rule in (block_rule, token_rule):
        assert first_tokens(rule) == target, rule.__name__
    accepted = {rule: sum(pr * (len(t) - 1) for t, pr in step(rule, ()).items()) for rule in (block_rule, token_rule)}
    assert accepted[block_rule] > accepted[token_rule]
    a, b = [Fraction(1, 3), Fraction(2, 3)], [Fraction(2, 3), Fraction(1, 3)]      # target, draft: no context
    two = {rule: sum(math.prod(b[t] for t in blk) * sum(n * c for n, (c, _) in rule([a] * 3, [b] * 2, blk).items())
                     for blk in itertools.product(range(2), repeat=2)) for rule in (block_rule, token_rule)}
    assert (two[block_rule], two[token_rule]) == (Fraction(11, 9), Fraction(10, 9))


def random_blocks(seed: int):
    """Blocks over small vocabularies: sampled drafts, argmax ones (q one-hot), limits below the block. Yields
    (p [K+1,V], q [K,V], drafts [K], limit or None, the verified part's p, q and drafts in Fractions)."""
    g = torch.Generator().manual_seed(seed)
    for K, V, limit, argmax in ((3, 4, None, False), (3, 4, 2, False), (2, 5, None, True), (4, 3, 3, False)):
        p = torch.softmax(torch.randn(K + 1, V, generator=g, dtype=torch.float64) * 1.2, -1)
        q = torch.softmax(torch.randn(K, V, generator=g, dtype=torch.float64) * 1.2, -1)
        drafts = torch.multinomial(q, 1, generator=g).squeeze(-1)
        if argmax:
            q = torch.nn.functional.one_hot(drafts, V).double()
        L = K if limit is None else limit
        yield p, q, drafts, limit, ([[Fraction(x) for x in r] for r in p[:L + 1].tolist()],
                                    [[Fraction(x) for x in r] for r in q[:L].tolist()], tuple(drafts[:L].tolist()))


def test_the_code_draws_what_the_rule_says():
    """`verify_block` against `block_rule` on random blocks (`random_blocks`), several rows at once."""
    for p, q, drafts, limit, exact in random_blocks(4):
        want = {}
        for n, (chance, last) in block_rule(*exact).items():
            for y, pr in enumerate(last):
                want[tuple(drafts[:n].tolist()) + (y,)] = float(chance * pr)
        got = outcomes(p.float(), drafts, q.float(), limit, n=100_000)
        assert close(got, want, n=100_000), (q, limit)


def test_expected_acceptance_is_the_rules_own():
    """`expected_accepted` (what `benchmarks/verify_rules.py` compares the rules by, on the same drafted blocks)
    gives each rule's mean accepted drafts for the drafts given, as the exact rules do: on the block worked by
    hand (block 3/16 x 2 + 3/16 = 9/16, token 1/2 + 3/16 = 11/16) and on random blocks."""
    got = [expected_accepted(P[None], D[None], Q[None], block=b).item() for b in (True, False)]
    assert got == pytest.approx([9 / 16, 11 / 16], abs=1e-6)
    for p, q, drafts, limit, exact in random_blocks(7):
        for rule, block in ((block_rule, True), (token_rule, False)):
            want = sum(n * c for n, (c, _) in rule(*exact).items())
            got = expected_accepted(p[None], drafts[None], q[None], None if limit is None else torch.tensor([limit]),
                                    block=block)
            assert got.item() == pytest.approx(float(want), abs=1e-9), (q, limit, rule.__name__)


def test_greedy_rows_match_prefixes():
    """One-hot target rows: the block rule keeps the drafts up to the first that differs from its row's argmax
    and then takes that argmax, as `verify_greedy` does, for drafts drawn from any q."""
    g = torch.Generator().manual_seed(5)
    B, K, V = 512, 4, 6
    targets = torch.randint(0, V, (B, K + 1), generator=g)
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, targets[:, :K], torch.randint(0, V, (B, K), generator=g))
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    one_hot = torch.nn.functional.one_hot(targets, V).float()
    for draws in (q, torch.nn.functional.one_hot(drafts, V).float()):
        tokens, n_acc = verify_block(one_hot, drafts, torch.arange(B), torch.zeros(B, dtype=torch.long), draws)
        matched = (drafts == targets[:, :K]).long().cumprod(-1).sum(-1)
        assert torch.equal(n_acc, matched)
        assert torch.equal(tokens.gather(1, n_acc[:, None]).squeeze(1), targets.gather(1, matched[:, None]).squeeze(1))
    assert set(matched.tolist()) == set(range(K + 1))


def test_a_limit_commits_what_a_shorter_block_commits():
    """A row that verifies L of K drafts commits, token for token, what a step of L drafts commits (same seeds,
    same positions), as the token rule does."""
    g = torch.Generator().manual_seed(6)
    B, K, V = 256, 5, 7
    probs = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    seed, pos = torch.arange(B) * 7, torch.randint(0, 100, (B,), generator=g)
    for L in range(K + 1):
        limited = verify_block(probs, drafts, seed, pos, q, torch.full((B,), L))
        if L:
            short = verify_block(probs[:, :L + 1], drafts[:, :L], seed, pos, q[:, :L])
        else:
            short = verify(probs[:, :1], drafts[:, :0], seed, pos)
        assert torch.equal(limited[1], short[1])
        assert all(a[:n + 1] == b[:n + 1] for a, b, n in zip(limited[0].tolist(), short[0].tolist(),
                                                                 short[1].tolist()))


# ---- the engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(BUNDLED_MODEL_DIR)


def test_the_block_rule_is_the_default_and_the_label_names_the_other(tok):
    """Engines verify sampled drafts by the block rule unless told otherwise (as the settings do), and the front
    ends' drafter label names the rule only where it is the token rule."""
    model = load_model(BUNDLED_MODEL_DIR, dtype=torch.float32)
    labels = {rule: drafter_label(Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=64, drafts=3,
                                                                     **({} if rule is None else {"verify": rule}))))
              for rule in (None, "block", "token")}
    assert labels == {None: "DSpark 3 of 5", "block": "DSpark 3 of 5", "token": "DSpark 3 of 5, token verify"}


@torch.no_grad()
def sampled(model, tok, drafts, verify_rule, temperature, seeds) -> list[tuple[int, ...]]:
    """Each seed's tokens 2-4 (those verified against drafts) of a story prompt, with top-p and a repetition
    penalty on."""
    prompt = tok.encode("User: Tell me a story about a fox.\nAssistant:")
    eng = Engine(model, tok, EngineOptions(max_batch=16, max_seq_len=128, drafts=drafts, verify=verify_rule))
    params = [SamplingParams(temperature=temperature, top_p=0.9, repetition_penalty=1.3, seed=s, max_tokens=4,
                             ignore_eos=True) for s in seeds]
    seqs = [eng.submit(prompt, p) for p in params]
    while eng.has_work():
        eng.step()
    if drafts:
        assert eng.totals.accepted_tokens > len(seeds) // 4      # drafts were accepted, and rejected
        assert eng.totals.draft_tokens > eng.totals.accepted_tokens
    return [tuple(s.output_ids[1:4]) for s in seqs]


def homogeneity(a: list, b: list) -> tuple[float, float]:
    """Two-sample chi-square over each position's tokens (bins expected 5 or more in both, the rest pooled):
    the statistic and about its 99.9% quantile."""
    stat, dof = 0.0, 0
    for i in range(3):
        ca, cb = torch.bincount(torch.tensor([x[i] for x in a])), torch.bincount(torch.tensor([x[i] for x in b]))
        n = max(len(ca), len(cb))
        ca, cb = (torch.nn.functional.pad(c, (0, n - len(c))).double() for c in (ca, cb))
        total = ca + cb
        ea, eb = total * len(a) / (len(a) + len(b)), total * len(b) / (len(a) + len(b))
        big = (ea >= 5) & (eb >= 5)
        ca = torch.cat([ca[big], ca[~big].sum()[None]])
        cb = torch.cat([cb[big], cb[~big].sum()[None]])
        ea = torch.cat([ea[big], ea[~big].sum()[None]]).clamp(min=1e-9)
        eb = torch.cat([eb[big], eb[~big].sum()[None]]).clamp(min=1e-9)
        stat += (((ca - ea) ** 2 / ea) + ((cb - eb) ** 2 / eb)).sum().item()
        dof += int(big.sum())
    return stat, dof + 3.3 * math.sqrt(2 * dof)


@pytest.fixture(scope="module")
def undrafted(tok):
    """Tokens 2-4 of 1,000 seeds without drafting at temperature 1, and of 1,000 others at 1.1: both bundled
    models have the same trunk, so these serve both."""
    model = load_model(BUNDLED_MODEL_DIR, dtype=torch.float32)
    return (sampled(model, tok, 0, "token", 1.0, range(10_000, 11_000)),
            sampled(model, tok, 0, "token", 1.1, range(20_000, 21_000)))


def test_the_chi_square_test_sees_a_small_temperature_shift(undrafted):
    plain, shifted = undrafted
    stat, limit = homogeneity(shifted, plain)
    assert stat > limit, (stat, limit)


@pytest.mark.parametrize("kind", ["dspark", "mtp"])
def test_block_verified_sampling_is_the_models(tok, kind, undrafted):
    """1,000 seeded requests with block-verified drafts (DSpark's block, the MTP chain at 3) against 1,000 other
    seeds without drafting: the same distribution of tokens 2-4, with top-p and a repetition penalty on."""
    model = load_model(BUNDLED_MODEL_DIR if kind == "dspark" else BUNDLED_MODEL_DIR.with_name("dsv4-tiny-mtp"),
                       dtype=torch.float32)
    block = sampled(model, tok, 5 if kind == "dspark" else 3, "block", 1.0, range(1000))
    stat, limit = homogeneity(block, undrafted[0])
    assert stat < limit, (stat, limit)
