"""The cached path: chunked prefill, batched sequences at different positions and rejected
speculative rows all give the logits of one full forward pass."""
import pytest
import torch
from tiny import chunk_logits, mtp_chunk_logits, tiny_config, write_checkpoint

from dsv4cli.model import DecodeState, Segment, load_model

CFG = tiny_config(index_topk=4)   # window 16, blocks of 4 and 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(path, CFG, seed=7)
    return load_model(path, dtype=torch.float32)


def run_chunks(model, ids, sizes):
    state = DecodeState(model, 1, 320, max_draft=8)
    out, pos = [], 0
    for n in sizes:
        logits, _ = chunk_logits(model, ids[:, pos:pos + n], torch.tensor([pos]), state)
        out.append(logits)
        pos += n
    return torch.cat(out, 1)


@torch.no_grad()
@pytest.mark.parametrize("sizes", [[300], [7, 13, 1, 100, 60, 119], [1] * 10 + [127, 1, 1, 161], [3, 5, 9] * 15 + [45]])
def test_chunked_prefill_equals_full(model, sizes):
    ids = torch.randint(0, 256, (1, sum(sizes)), generator=torch.Generator().manual_seed(8))
    full = model(ids)
    got = run_chunks(model, ids, sizes)
    assert (got - full).abs().max().item() < 1e-4 * full.abs().max().item()


@torch.no_grad()
def test_padded_chunks_equal_the_full_forward(model):
    """Chunks padded to a bucket (as a compiled prefill chunk is) with random tokens, their real rows
    given by `length`: the real rows' logits are the full pass's, and the padding writes nothing a
    later call reads. Chunk ends cross ratio-4 and ratio-128 edges; buckets of 200 and 256 rows are
    longer than the ring (137 rows), with fewer real rows than it (47) and more (150); the MTP layer's
    window ring takes the same writes."""
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 256, (1, 300), generator=g)
    full, hidden = model(ids, return_hidden=True)
    full_mtp = model.mtp_forward(hidden, ids.roll(-1, 1))
    state = DecodeState(model, 1, 320, max_draft=8)
    pos = 0
    for real, bucket in [(30, 64), (150, 256), (1, 16), (47, 200), (10, 10)]:
        chunk = torch.cat([ids[:, pos:pos + real], torch.randint(0, 256, (1, bucket - real), generator=g)], 1)
        start, length = torch.tensor([pos]), torch.tensor([real])
        logits, h = chunk_logits(model, chunk, start, state, context=pos + real, length=length)
        assert torch.allclose(logits[0, :real], full[0, pos:pos + real], atol=1e-4, rtol=1e-4)
        nxt = torch.cat([ids[:, pos + 1:pos + real + 1], chunk[:, real:]], 1)
        mtp, _ = mtp_chunk_logits(model, h, nxt, start, state, length=length)
        assert torch.allclose(mtp[0, real - 1], full_mtp[0, pos + real - 1], atol=1e-4, rtol=1e-4)
        pos += real
    logits, h = chunk_logits(model, ids[:, pos:pos + 40], torch.tensor([pos]), state)      # reads their state
    assert torch.allclose(logits[0], full[0, pos:pos + 40], atol=1e-4, rtol=1e-4)
    mtp, _ = mtp_chunk_logits(model, h, ids[:, pos + 1:pos + 41], torch.tensor([pos]), state)
    assert torch.allclose(mtp[0], full_mtp[0, pos:pos + 40], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_batched_sequences_at_different_positions(model):
    g = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, 256, (1, 270), generator=g), torch.randint(0, 256, (1, 140), generator=g)
    state = DecodeState(model, 2, 320, max_draft=8)
    # prefill each sequence alone in its slot, then decode both together with 3 rows per call
    chunk_logits(model, a[:, :261], torch.tensor([0]), state)
    state_b = DecodeState(model, 1, 320, max_draft=8)
    chunk_logits(model, b[:, :131], torch.tensor([0]), state_b)
    for cache, cache_b in zip(state.layers, state_b.layers):
        for name, t in vars(cache).items():
            if isinstance(t, torch.Tensor):
                t[1].copy_(getattr(cache_b, name)[0])
    outs = []
    for i in range(3):
        rows = torch.cat([a[:, 261 + 3 * i: 264 + 3 * i], b[:, 131 + 3 * i: 134 + 3 * i]])
        logits, _ = chunk_logits(model, rows, torch.tensor([261 + 3 * i, 131 + 3 * i]), state)
        outs.append(logits)
    got = torch.cat(outs, 1)
    full_a, full_b = model(a), model(b)
    assert torch.allclose(got[0], full_a[0, 261:270], atol=1e-4, rtol=1e-4)
    assert torch.allclose(got[1], full_b[0, 131:140], atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("start", [100, 126, 127, 255, 131])
def test_rejected_rows_leave_no_trace(model, start):
    """Rows written past the committed position (rejected drafts), including rows that close a
    ratio-4 or ratio-128 block, are invisible once the true tokens are processed."""
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 256, (1, 300), generator=g)
    full = model(ids)
    state = DecodeState(model, 1, 320, max_draft=8)
    chunk_logits(model, ids[:, :start], torch.tensor([0]), state)
    junk = torch.randint(0, 256, (1, 9), generator=g)
    chunk_logits(model, junk, torch.tensor([start]), state)                  # 9 speculative rows, all rejected
    logits, _ = chunk_logits(model, ids[:, start:start + 5], torch.tensor([start]), state)
    assert torch.allclose(logits[0], full[0, start:start + 5], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_reused_slot_starts_clean(model):
    g = torch.Generator().manual_seed(11)
    state = DecodeState(model, 1, 320, max_draft=8)
    chunk_logits(model, torch.randint(0, 256, (1, 250), generator=g), torch.tensor([0]), state)
    ids = torch.randint(0, 256, (1, 3), generator=g)               # shorter than a ratio-4 block
    logits, _ = chunk_logits(model, ids, torch.tensor([0]), state)
    assert torch.allclose(logits, model(ids), atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("prefill_first", [True, False])
def test_a_prefill_chunk_and_decode_rows_in_one_pass(model, prefill_first):
    """One pass over a prefill chunk of slot 0 (positions 30..149: across the window, ratio-4 edges and
    position 128) and the decode rows of slots 0 and 1 gives each what it gets alone, the chunk first:
    slot 0 is still prefilling, so its decode rows are garbage at 150..151 (past the chunk), and their
    ring slots alias positions 19..20, which the chunk reads. Run before the chunk, they are read as the
    prompt's (the wrong order: its logits change); after it, they fall out of every window."""
    g = torch.Generator().manual_seed(12)
    a, b = torch.randint(0, 256, (1, 160), generator=g), torch.randint(0, 256, (1, 50), generator=g)
    full_a, full_b = model(a), model(b)
    state = DecodeState(model, 2, 320, max_draft=2)
    chunk_logits(model, a[:, :30], torch.tensor([0]), state.view(0))
    chunk_logits(model, b[:, :40], torch.tensor([0]), state.view(1))
    chunk = Segment(a[:, 30:150], torch.tensor([30]), state.view(0), 150)
    rows = torch.cat([torch.randint(0, 256, (1, 2), generator=g), b[:, 40:42]])
    decode = Segment(rows, torch.tensor([150, 40]), state, 320)
    if prefill_first:
        (chunk_hidden, _), (hidden, _) = model.forward_segments([chunk, decode])
    else:
        (hidden, _), (chunk_hidden, _) = model.forward_segments([decode, chunk])
    logits, last = model.logits(hidden), model.logits(chunk_hidden[:, -1:])
    assert torch.allclose(logits[1], full_b[0, 40:42], atol=1e-4, rtol=1e-4)
    right = torch.allclose(last[0], full_a[0, 149:150], atol=1e-4, rtol=1e-4)
    assert right == prefill_first
    if prefill_first:       # and the next chunk reads what the chunk wrote
        logits, _ = chunk_logits(model, a[:, 150:160], torch.tensor([150]), state.view(0))
        assert torch.allclose(logits[0], full_a[0, 150:160], atol=1e-4, rtol=1e-4)
