"""A slot's decode state at a position P as plain tensors, and back into a slot.

The state is position-addressed (ring slot p % R, compressed block (p+1)//r - 1) and every read is masked by
position, so what a call starting at P reads of the positions before it is a fixed set of rows
(`LayerCache.carried`): each ring's last rows before P and every compressed block closed before P. Those,
copied out and written back at the same positions, resume P exactly, in any slot and with any ring length;
the rest of the slot holds positions a later call writes before it reads them.

Tensors are named `layers.N.<field>` and `mtp.N.<field>` after the LayerCache fields; the `mtp.N` caches
are the drafter's state (the MTP layer's window, or DSpark's per-stage rings of committed rows).
"""
import ctypes
import hashlib

import torch

from dsv4cli.model import DecodeState, Transformer
from dsv4cli.model.model import RMSNorm


def _carried(state: DecodeState, pos: int, kind: str):
    """(name, tensor [B, ...], ratio, lo, hi) of every `kind` ("ring" or "blocks") tensor at position `pos`."""
    caches = [(f"layers.{i}", c) for i, c in enumerate(state.layers)] + [(f"mtp.{i}", c) for i, c in
                                                                          enumerate(state.drafter)]
    for prefix, cache in caches:
        for field, (k, lo, hi) in cache.carried(pos, state.window).items():
            if k == kind:
                yield f"{prefix}.{field}", getattr(cache, field), cache.ratio, lo, hi


def take_rows(state: DecodeState, slot: int, pos: int, since: int | None = None) -> dict[str, torch.Tensor]:
    """Copies of each ring's rows that a call starting at `pos` reads, positions [lo, pos) in order; with
    `since`, positions [since, pos) of every ring instead (at most a ring's length)."""
    rows = {}
    for name, t, _, lo, hi in _carried(state, pos, "ring"):
        lo = lo if since is None else max(since, hi - t.shape[1], 0)
        rows[name] = t[slot].index_select(0, torch.arange(lo, hi, device=t.device) % t.shape[1])
    return rows


def take_blocks(state: DecodeState, slot: int, since: int, pos: int) -> dict[str, torch.Tensor]:
    """Copies of the compressed blocks (and indexer keys) that positions [since, pos) closed; `since` is 0 or
    ends a block of every ratio (a multiple of 128)."""
    return {name: t[slot, since // r: n].clone() for name, t, r, _, n in _carried(state, pos, "blocks")}


def put_rows(state: DecodeState, slot: int, pos: int, parts: dict[str, torch.Tensor]) -> None:
    """The ring rows among `parts` (taken at `pos`) into slot `slot`, each at its position's ring slot."""
    for name, t, _, _, _ in _carried(state, pos, "ring"):
        if name in parts:
            x, ring = parts[name][-t.shape[1]:], t[slot]         # a shorter ring holds the latest rows
            ring.index_copy_(0, torch.arange(pos - x.shape[0], pos, device=t.device) % ring.shape[0], x.to(t.device))


def put_blocks(state: DecodeState, slot: int, since: int, parts: dict[str, torch.Tensor]) -> None:
    """The blocks among `parts` (taken from position `since`) into slot `slot`."""
    for name, t, r, _, _ in _carried(state, since, "blocks"):
        if name in parts:
            t[slot, since // r: since // r + parts[name].shape[0]].copy_(parts[name])


def layout(state: DecodeState, pos: int) -> dict[str, tuple[str, torch.Tensor, int]]:
    """Every tensor a snapshot at `pos` holds: its kind ("ring" or "blocks"), the state's tensor [B, ...] it goes
    into, and its rows: a ring's at most (the positions before `pos`), the blocks' exactly (those closed before)."""
    return {name: (kind, t, hi) for kind in ("ring", "blocks") for name, t, _, _, hi in _carried(state, pos, kind)}


def nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


def state_identity(model: Transformer, drafter: bool) -> dict[str, str]:
    """What a snapshot's tensors are valid for: the model (a digest of its config and of a sample of its
    weights: the first embedding rows and every norm's weight), its dtype, and the drafter whose state it
    holds ("none" for plain decoding, which writes none)."""
    digest = hashlib.sha256(repr(model.cfg).encode())
    sample = [model.embed.weight[:4]] + [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    for t in sample:       # the bytes as they are held (ctypes: numpy is not a dependency)
        raw = t.detach().contiguous().view(torch.uint8).cpu()
        digest.update(ctypes.string_at(raw.data_ptr(), raw.numel()))
    return {"model_id": digest.hexdigest()[:32], "dtype": str(model.dtype).removeprefix("torch."),
            "drafter": (model.cfg.drafter or "none") if drafter else "none"}
