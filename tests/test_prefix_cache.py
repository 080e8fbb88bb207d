"""The prefix cache: a snapshot resumes a slot's state bit for bit; outputs with the store equal outputs
without it (greedy, both drafters, prompts just below, at and above the window, ratio-4 and ratio-128
boundaries, after eviction and spill); the store keeps within its budgets; prompts that arrive together
prefill their shared prefix once; a chat's state goes to a file and back; the front ends show the hits."""
import json
import math

import pytest
import torch
from tiny import chunk_logits, mtp_chunk_logits, prompts, tiny_dspark_config, write_checkpoint

from dsv4cli.config import BUNDLED_MODEL_DIR
from dsv4cli.encoding import encode_messages
from dsv4cli.engine import Engine, EngineOptions, SamplingParams
from dsv4cli.engine.prefix_store import BOUNDARY, PrefixStore
from dsv4cli.engine.scheduler import prefill_chunks
from dsv4cli.engine.snapshot import nbytes, put_blocks, put_rows, take_blocks, take_rows
from dsv4cli.model import DecodeState, load_model
from dsv4cli.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
STORE = (1 << 30, 0)


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    path = tmp_path_factory.mktemp("dspark")
    write_checkpoint(path, tiny_dspark_config(), seed=3)
    return load_model(path, dtype=torch.float32)


def boundary_prompts(vocab: int) -> list[list[int]]:
    """Prompts of one 400-token text, cut just below, at and above the window (16), ratio-4 and ratio-128
    boundaries past a snapshot boundary, and prompts that leave it right after one (window 16, ratios 4, 128)."""
    text, other = prompts([400, 140], vocab, seed=11)
    cuts = [127, 128, 129, 131, 132, 133, 143, 144, 145, 255, 256, 257, 260, 261, 272, 273, 383, 384, 385]
    return [text[:n] for n in cuts] + [text[:256] + other[:n] for n in (1, 3, 4, 5, 15, 16, 17, 127, 128, 129)]


# ---- the snapshot itself -----------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("pos", [128, 256, 130, 133, 200])
def test_a_snapshot_resumes_the_state_bit_for_bit(model, pos):
    """Slot 0 prefilled to `pos`; its snapshot goes into slot 1, whose every tensor holds garbage. Chunks that
    cross the window, ratio-4 and ratio-128 edges then give both slots the same trunk and MTP logits, bit for
    bit: the snapshot holds everything a later position reads (at 128k the store's; elsewhere a chat file's)."""
    ids = torch.tensor(prompts([pos + 300], model.cfg.vocab_size, seed=pos))
    state = DecodeState(model, 2, 1024, max_draft=4)
    for cache in state.layers + state.drafter:
        for t in cache.tensors():
            t[1].copy_(torch.randn(t[1].shape) * 3)
    slots = [state.view(0), state.view(1)]

    def run(slot, a, b):
        logits, hidden = chunk_logits(model, ids[:, a:b], torch.tensor([a]), slots[slot])
        mtp, _ = mtp_chunk_logits(model, hidden, ids[:, a + 1:b + 1], torch.tensor([a]), slots[slot])
        return logits, mtp

    for a in range(0, pos, 100):
        run(0, a, min(a + 100, pos))
    put_blocks(state, 1, 0, take_blocks(state, 0, 0, pos))
    put_rows(state, 1, pos, take_rows(state, 0, pos))
    a = pos
    for n in (1, 3, 4, 5, 15, 16, 17, 110, 128):
        for want, got in zip(run(0, a, a + n), run(1, a, a + n)):
            assert torch.equal(want, got), (pos, a, n)
        a += n


@torch.no_grad()
def test_dsparks_rings_come_back_with_the_snapshot(dspark, tok):
    """One slot, so a resumed prompt's chunks and steps are the first run's: the replies, their acceptance at
    every position and the stages' rings after them equal the first run's, bit for bit."""
    eng = Engine(dspark, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=5, prefix_cache=STORE))
    for prompt in boundary_prompts(dspark.cfg.vocab_size)[9:14]:
        first = eng.generate([prompt], GREEDY)[0]
        rings = [c.win.clone() for c in eng.runner.state.cache.drafter]
        again = eng.generate([prompt], GREEDY)[0]
        assert again.metrics.cached_tokens == (len(prompt) - 1) // BOUNDARY * BOUNDARY > 0
        assert again.output_ids == first.output_ids
        assert again.metrics.accepted_per_position == first.metrics.accepted_per_position
        end = len(prompt) + len(first.output_ids) - 1        # positions committed
        for ring, cache in zip(rings, eng.runner.state.cache.drafter):
            rows = torch.arange(end - 16, end) % ring.shape[1]
            assert torch.equal(ring[0, rows], cache.win[0, rows])


# ---- outputs with the store equal outputs without it ----------------------------------------------------------

def greedy_equal_with_and_without(model, tok, mtp, cache=STORE, batch=4, rounds=2) -> Engine:
    ps = boundary_prompts(model.cfg.vocab_size)
    plain = [s.output_ids for s in Engine(model, tok, EngineOptions(max_batch=batch, max_seq_len=1024, drafts=0))
             .generate(ps, GREEDY)]
    eng = Engine(model, tok, EngineOptions(max_batch=batch, max_seq_len=1024, drafts=mtp, prefix_cache=cache,
                                           isolate_failures=False))
    eng.pace.share = math.inf     # the token budget alone: what each round stores, spills and evicts is counted
    for r in range(rounds):       # the first round stores (and shares what prompts arriving together share)
        seqs = eng.generate(ps, GREEDY)
        assert [s.output_ids for s in seqs] == plain, (mtp, r)
        assert eng.totals.draft_tokens > 0
    return eng, seqs


@torch.no_grad()
@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_the_store_equals_without_mtp(model, tok, k):
    _, seqs = greedy_equal_with_and_without(model, tok, k)
    assert [s.metrics.cached_tokens for s in seqs] == [(len(s.prompt_ids) - 1) // BOUNDARY * BOUNDARY for s in seqs]


@torch.no_grad()
@pytest.mark.parametrize("k", [5, "auto"])
def test_greedy_with_the_store_equals_without_dspark(dspark, tok, k):
    greedy_equal_with_and_without(dspark, tok, k)


@torch.no_grad()
def test_greedy_after_eviction_and_spill(model, dspark, tok):
    """Budgets of two snapshots a tier: nodes spill to the host tier and are evicted while the prompts come
    round again; the outputs stay those of an engine without the store."""
    for m, k in ((model, 1), (dspark, 5)):
        state = Engine(m, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=k)).runner.state.cache
        size = nbytes(take_rows(state, 0, 256)) + nbytes(take_blocks(state, 0, 128, 256))   # a node's bytes
        eng, _ = greedy_equal_with_and_without(m, tok, k, cache=(2 * size, 2 * size), rounds=3)
        store = eng.prefixes.store
        boundaries = {key for p in boundary_prompts(m.cfg.vocab_size) for key in store.keys(p)}
        assert store.held[True] > 0 and len(store.nodes) < len(boundaries)      # spilled, and evicted
        assert store.held[False] <= 2 * size and store.held[True] <= 2 * size


@torch.no_grad()
def test_bundled_models_answer_the_same_with_the_store():
    """dsv4-tiny (DSpark) and dsv4-tiny-mtp (the MTP layer), window 64: questions after a shared system prompt
    of ~330 tokens, greedy, with and without the store."""
    for name in ("dsv4-tiny", "dsv4-tiny-mtp"):
        path = BUNDLED_MODEL_DIR.parent / name
        tok, model = Tokenizer.from_dir(path), load_model(path, dtype=torch.float32)
        system = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(40))
        ps = [tok.encode(encode_messages([{"role": "system", "content": system}, {"role": "user", "content": q}]))
              for q in ("What is the capital of France?", "What is 7 plus 8?", "Hi!", "What colour is snow?")]
        plain = [s.output_ids for s in Engine(model, tok, EngineOptions(max_batch=4, drafts=0)).generate(ps, GREEDY)]
        eng = Engine(model, tok, EngineOptions(max_batch=4, drafts="auto", prefix_cache=STORE))
        seqs = eng.generate(ps, GREEDY) + eng.generate(ps, GREEDY)
        assert [s.output_ids for s in seqs] == plain + plain, name
        assert sum(s.metrics.cached_tokens > 0 for s in seqs) == 7, name     # all but the first


# ---- the store ----------------------------------------------------------------------------------------------

@torch.no_grad()
def test_the_store_never_holds_more_than_its_budgets(model, tok):
    """After every step each tier holds at most its budget, and what it counts is what its nodes hold."""
    state = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=1)).runner.state.cache
    size = nbytes(take_rows(state, 0, 256)) + nbytes(take_blocks(state, 0, 128, 256))
    for budget in ((2 * size, 0), (size // 2, 0), (2 * size, 3 * size), (5 * size, size)):
        eng = Engine(model, tok, EngineOptions(max_batch=3, max_seq_len=1024, drafts=1, prefix_cache=budget))
        store = eng.prefixes.store
        for p in boundary_prompts(model.cfg.vocab_size) + prompts([300, 500, 700], model.cfg.vocab_size, seed=5):
            eng.submit(p, GREEDY)
        while eng.has_work():
            eng.step()
            held = {False: 0, True: 0}
            for node in store.nodes.values():
                held[node.on_host] += node.nbytes()
            assert held == store.held and held[False] <= budget[0] and held[True] <= budget[1], budget


def test_eviction_takes_rows_least_recently_resumed_first():
    """A node keeps the blocks every longer prefix reads; its rows go first, and a node with neither rows nor
    children goes with them."""
    cfg = tiny_dspark_config()
    from tiny import random_model
    model = random_model(cfg)
    state = DecodeState(model, 1, 1024, max_draft=3)
    store = PrefixStore(state, 1 << 30)
    a, b = prompts([600, 600], cfg["vocab_size"], seed=2)
    b = a[:256] + b[256:]                         # shares two blocks with a
    ka, kb = store.keys(a), store.keys(b)
    assert ka[:1] == kb[:1] and ka[1] != kb[1]    # boundary 256's key holds token 256
    for pos in (128, 256, 384, 512):
        store.store(ka, 0, pos)
    store.store(kb, 0, 384)                        # its parent: the node at 128 (b's 256 differs in token 256)
    assert store.nodes[kb[2]].parent is store.nodes[ka[0]] and store.nodes[ka[0]].children == 2
    assert store.longest(kb) is store.nodes[kb[2]] and store.longest(kb[:2]) is store.nodes[ka[0]]
    store.restore(store.nodes[ka[1]], 0)           # resumed: its rows are kept longest
    names = {ka[0]: "128", ka[1]: "a256", ka[2]: "a384", ka[3]: "a512", kb[2]: "b384"}
    evicted, left = [], []
    while store.nodes:
        rows = {k for k, n in store.nodes.items() if n.rows is not None}
        store._evict(list(store.nodes.values()))
        evicted += [names[k] for k in rows - {k for k, n in store.nodes.items() if n.rows is not None}]
        left.append(sorted(names[k] for k in store.nodes))
    assert evicted == ["128", "a384", "a512", "b384", "a256"]
    assert left == [["128", "a256", "a384", "a512", "b384"], ["128", "a256", "a384", "a512", "b384"],
                    ["128", "a256", "b384"], ["128", "a256"], []]


def test_chunks_end_at_snapshot_boundaries():
    """With a boundary, a chunk that would run past one (before its prompt's last token) ends there and is
    its request's last of the step; without, chunks are cut by the budget alone."""
    from dsv4cli.engine.request import Sequence
    long, short = Sequence("a", list(range(1000)), GREEDY, 0), Sequence("b", list(range(150)), GREEDY, 0)
    assert [(s.id, a, b) for s, a, b in prefill_chunks([long, short], 160, 256)] == [("a", 0, 160)]
    assert [(s.id, a, b) for s, a, b in prefill_chunks([long, short], 160, 256, 128)] == [("a", 0, 128),
                                                                                           ("b", 0, 32)]
    long.prefilled, short.prefilled = 896, 128
    assert [(a, b) for _, a, b in prefill_chunks([long, short], 300, 64, 128)] == [(896, 960), (960, 1000), (128, 150)]
    last = Sequence("c", list(range(256)), GREEDY, 0)
    last.prefilled = 128
    assert [(a, b) for _, a, b in prefill_chunks([last], 160, 256, 128)] == [(128, 256)]


@torch.no_grad()
def test_prompts_that_arrive_together_prefill_their_prefix_once(model, tok):
    """Four prompts sharing 700 tokens, four free slots: the first prefills the shared part, the others wait
    for its snapshot at 640 and prefill only their own tails."""
    shared, *tails = prompts([700, 20, 30, 40, 50], model.cfg.vocab_size, seed=3)
    ps = [shared + t for t in tails]
    eng = Engine(model, tok, EngineOptions(max_batch=4, max_seq_len=1024, drafts=1, prefix_cache=STORE))
    seqs = eng.generate(ps, GREEDY)
    assert sorted(s.metrics.cached_tokens for s in seqs) == [0, 640, 640, 640]
    plain = Engine(model, tok, EngineOptions(max_batch=4, max_seq_len=1024, drafts=0)).generate(ps, GREEDY)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]


@torch.no_grad()
def test_a_chat_resumes_its_own_slot_after_a_store_hit(model, tok):
    """A chat engine has both: a conversation resumed from the store (its slot held another) goes on
    resuming its own slot the next turn, reply included, and answers as a fresh engine does."""
    x, y, user = prompts([300, 200, 9], model.cfg.vocab_size, seed=8)
    eng = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=1, reuse_prefix=True,
                                           prefix_cache=STORE))
    fresh = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=1))
    eng.generate([x], GREEDY)
    eng.generate([y], GREEDY)
    again = eng.generate([x], GREEDY)[0]
    assert again.metrics.cached_tokens == 256                   # from the store: the slot held y
    turn = x + again.output_ids + user
    seq = eng.generate([turn], GREEDY)[0]
    assert seq.metrics.cached_tokens == len(x) + len(again.output_ids) - 1      # its own slot, reply included
    assert seq.output_ids == fresh.generate([turn], GREEDY)[0].output_ids


# ---- a chat's state in a file ----------------------------------------------------------------------------------

def chat_turns(eng: Engine, conversation: list[int], users: list[list[int]]) -> list:
    seqs = []
    for user in users:
        seq = eng.generate([conversation], GREEDY)[0]
        seqs.append(seq)
        conversation = conversation + seq.output_ids + user
    return seqs, conversation


@torch.no_grad()
@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_a_saved_chat_state_resumes_as_the_chat_would_have(model, dspark, tok, tmp_path, drafter):
    """Turns on one engine; its state saved after the second; a new engine loads it and answers the third as
    the first engine does, resuming at the same position with the same acceptance at every draft position."""
    m, k = (model, 1) if drafter == "mtp" else (dspark, 5)
    start, *users = prompts([150, 20, 200, 7], m.cfg.vocab_size, seed=4)
    header = {"model": "tiny", "encoding": "0731"}
    eng = Engine(m, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=k, reuse_prefix=True, prefix_cache=STORE))
    _, conversation = chat_turns(eng, start, users[:2])
    path = tmp_path / "chat.safetensors"
    saved = eng.save_state(str(path), header)
    assert saved == len(eng.prefixes.history[0].tokens) - 1 > 180
    want = eng.generate([conversation], GREEDY)[0]
    resumed = Engine(m, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=k, reuse_prefix=True,
                                           prefix_cache=STORE))
    assert resumed.load_state(str(path), header) == saved
    got = resumed.generate([conversation], GREEDY)[0]
    assert got.output_ids == want.output_ids
    assert got.metrics.cached_tokens == want.metrics.cached_tokens >= saved - 1
    assert got.metrics.accepted_per_position == want.metrics.accepted_per_position


@torch.no_grad()
def test_a_state_of_another_model_drafter_or_encoding_is_refused_in_one_line(model, dspark, tok, tmp_path):
    header = {"model": "tiny", "encoding": "0731"}
    eng = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=1, reuse_prefix=True))
    chat_turns(eng, prompts([150], model.cfg.vocab_size)[0], [[5]])
    path = tmp_path / "chat.safetensors"
    eng.save_state(str(path), header)

    def refusal(engine, **changes) -> str:
        with pytest.raises(ValueError) as e:
            engine.load_state(str(path), header | changes)
        assert "\n" not in str(e.value)
        return str(e.value)

    other = Engine(dspark, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=0, reuse_prefix=True))
    assert "another model (tiny; this chat runs other)" in refusal(other, model="other")
    plain = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=0, reuse_prefix=True))
    assert "drafter mtp; this chat runs none" in refusal(plain)
    same = Engine(model, tok, EngineOptions(max_batch=1, max_seq_len=1024, drafts=1, reuse_prefix=True))
    assert "encoding 0731; this chat runs preview" in refusal(same, encoding="preview")
    assert "one free slot" in refusal(Engine(model, tok,
                                             EngineOptions(max_batch=2, max_seq_len=1024, drafts=1, reuse_prefix=True)))
    path.write_bytes(path.read_bytes()[:-100])
    assert refusal(same).startswith("cannot read it")
    assert same.generate([[5, 6, 7]], GREEDY)[0].metrics.cached_tokens == 0    # nothing was put in its slot


# ---- what the front ends show ----------------------------------------------------------------------------------

def test_batch_shares_a_system_prompt_and_says_so(tiny_model_dir, tmp_path):
    """Eight requests after one long system prompt: the same answers as without the store, all but the first
    served from its snapshots (usage's cached_tokens), and the summary line gives the hit rate."""
    from test_batch import dsv4, read_jsonl, write_jsonl
    system = " ".join(f"Rule {i}: be brief." for i in range(60))
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": f"Question {i}: say something."}],
                       "max_completion_tokens": 6, "ignore_eos": True}} for i in range(8)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    runs = {}
    for cache in ("0", str(1 << 30)):
        out = tmp_path / f"out-{cache}.jsonl"
        r = dsv4("batch", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--max-batch", "4",
                 "--temperature", "0", "--seed", "1", "--prefix-cache-bytes", cache)
        assert r.returncode == 0, r.stderr
        runs[cache] = {rec["custom_id"]: rec["response"]["body"] for rec in read_jsonl(out)}
        summary = r.stderr.strip().splitlines()[-1]
    off, on = runs["0"], runs[str(1 << 30)]
    assert {k: b["choices"] for k, b in on.items()} == {k: b["choices"] for k, b in off.items()}
    prompt = [b["usage"]["prompt_tokens"] for b in on.values()]
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in on.values()]
    assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for b in off.values())
    assert min(prompt) > 256 and sorted(cached)[0] == 0 and all(c >= 256 for c in sorted(cached)[1:])
    assert f"prefix cache {sum(cached) / sum(prompt):.0%} of prompt tokens ({sum(cached)} of {sum(prompt)})" in summary


def test_serve_reports_prefix_cache_hits(tmp_path):
    """A repeated long prompt: the second reply's usage counts its cached tokens, and /metrics the hits, the
    queries and the hit rate in tokens."""
    from test_serve import Server
    server = Server(tmp_path)
    try:
        client = server.client(key=None)
        system = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(40))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is 7 plus 8?"}]
        first, second = (client.chat.completions.create(model="dsv4-tiny", messages=messages, max_tokens=4,
                                                        temperature=0) for _ in range(2))
        assert first.choices[0].message.content == second.choices[0].message.content
        prompt = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // BOUNDARY * BOUNDARY > 0
        metrics = server.get("/metrics")
        hits = second.usage.prompt_tokens_details.cached_tokens
        assert f"dsv4:prefix_cache_queries_total {2 * prompt}" in metrics
        assert f"dsv4:prefix_cache_hits_total {hits}" in metrics
        assert f"dsv4:prefix_cache_hit_rate {hits / (2 * prompt)}" in metrics
    finally:
        server.stop()


def test_generate_json_stats_name_the_reused_tokens(tiny_model_dir):
    from test_batch import dsv4
    r = dsv4("generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["cached_tokens"] == 0 and stats["prefix_hit_rate"] == 0.0
