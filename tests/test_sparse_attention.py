"""Sparse attention: the CSA reads its indexer's top-k blocks by index, HCA its closed blocks in place,
with the documented tie policy, equal to dense masked attention, and without copying any cache."""
import pytest
import torch
from tiny import chunk_logits, random_model, tiny_config

from dsv4cli.kernels import reference
from dsv4cli.model import DecodeState


def dense_attention(q, kv, bias, sink, scale):
    """The former op: one softmax over concatenated KV with a 0/-inf bias [B,S,N]."""
    s = torch.einsum("bshd,bnd->bshn", q.float(), kv.float()) * scale + bias.unsqueeze(2)
    sink = sink.float().view(1, 1, -1, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink)
    p = torch.exp(s - m)
    p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))
    return torch.einsum("bshn,bnd->bshd", p, kv.float())


def test_sparse_attention_equals_dense_masked_attention():
    g = torch.Generator().manual_seed(0)
    B, S, H, D, R, T, k = 2, 3, 4, 16, 6, 20, 5
    q = torch.randn(B, S, H, D, generator=g)
    ring, chunk, blocks = (torch.randn(B, n, D, generator=g) for n in (R, S, T))
    ring_mask = torch.rand(B, S, R, generator=g) > 0.3
    chunk_mask = torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
    idx = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(B * S)]).view(B, S, k)
    valid = torch.rand(B, S, k, generator=g) > 0.2
    sink = torch.randn(H, generator=g)
    got = reference.sparse_attention(q, [(ring, ring_mask, None), (chunk, chunk_mask, None), (blocks, valid, idx)],
                                     sink, 0.25)
    chosen = torch.zeros(B, S, T, dtype=torch.bool)
    chosen.scatter_(-1, idx, valid)                       # the same blocks as a dense mask
    mask = torch.cat([ring_mask, chunk_mask, chosen], -1)
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    want = dense_attention(q, torch.cat([ring, chunk, blocks], 1), bias, sink, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_topk_blocks_ties_go_to_the_lower_block():
    """The policy of a stable descending sort: equal scores (relu-zero heads, -0.0 and +0.0 alike)
    keep block order; blocks not yet closed never beat closed ones."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(-3, 4, (2, 5, 40), generator=g).float() / 2        # many exact ties
    scores[0, 0, :10] = -0.0
    closed = torch.tensor([[40, 33, 7, 1, 0], [12, 40, 39, 2, 25]])
    for k in (1, 8, 40):
        masked = scores.masked_fill(torch.arange(40) >= closed[..., None], float("-inf"))
        want = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        assert torch.equal(reference.topk_blocks(scores, closed, k), want)


def test_indexer_scores_in_slices():
    g = torch.Generator().manual_seed(2)
    q, keys, w = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 50, 8, generator=g), torch.randn(2, 3, 4)
    want = (torch.einsum("bshd,btd->bsht", q, keys).relu() * w[..., None]).sum(2)
    # B x S x H = 24: 7 blocks a slice, 8 slices, one partial
    torch.testing.assert_close(reference.indexer_scores(q, keys, w, 7 * 24), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
@torch.no_grad()
def test_decode_reads_caches_in_place(rows, monkeypatch):
    """No step copies a cache (nothing joined by torch.cat shares storage with the decode state), and
    no attention mask is as long as the context: CSA reads its top-k blocks by index, HCA its closed
    blocks (context / 128), the window its ring."""
    model = random_model(tiny_config(index_topk=4))
    context = 2000
    state = DecodeState(model, 2, context + 16, max_draft=2)
    cache_storage = {t.untyped_storage().data_ptr() for c in state.layers + state.drafter for t in c.tensors()}
    joined, masks = [], []
    cat, attend = torch.cat, reference.sparse_attention

    def spy_cat(tensors, *a, **kw):
        joined.extend(t.untyped_storage().data_ptr() for t in tensors)
        return cat(tensors, *a, **kw)

    def spy_attention(q, sources, sink, scale):
        masks.append([(mask.shape[-1], idx is not None) for _, mask, idx in sources])
        return attend(q, sources, sink, scale)

    monkeypatch.setattr(torch, "cat", spy_cat)
    monkeypatch.setattr(reference, "sparse_attention", spy_attention)
    tokens = torch.randint(0, 256, (2, rows))
    start = torch.tensor([context - 1, context - 40])
    chunk_logits(model, tokens, start, state, context=context + rows)
    assert not cache_storage & set(joined)
    ratios = model.cfg.compress_ratios[: model.cfg.n_layers]
    assert len(masks) == len(ratios)
    for r, sources in zip(ratios, masks):
        assert max(n for n, _ in sources) <= max(state.ring, context // 128)
        assert [indexed for _, indexed in sources] == [False, False] + ([True] if r == 4 else [False] if r else [])
        if r == 4:
            assert sources[-1][0] == 4          # index_topk blocks per query
