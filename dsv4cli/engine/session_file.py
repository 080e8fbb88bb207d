"""A chat's decode state in a file, so a chat resumed from its transcript continues without prefilling the
conversation again.

The file is safetensors: the tokens the slot's state holds, every ring's trusted rows before the last
token's position P (at most a ring: enough for the next turn to resume anywhere a chat turn could) and
every block closed before P (`snapshot.py`). Its metadata names the format, the state's identity (model,
dtype, drafter: `snapshot.state_identity`) and whatever the front end adds (the model's name, the chat
encoding and settings), P and the tokens' sha256. A file whose identity or chat encoding is not this
engine's, or that is damaged (a tensor of another shape or dtype than the state's, NaN or infinity: checked
before anything is put in the slot), is refused with one line; the transcript does not depend on it.
"""
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dsv4cli.model import DecodeState

from .snapshot import layout, put_blocks, put_rows, take_blocks, take_rows

FORMAT = "dsv4cli chat state 1"
MATCHED = ("model_id", "dtype", "drafter", "encoding")      # a state is refused unless these equal the engine's


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()


def save(path: str | Path, state: DecodeState, slot: int, tokens: list[int], trusted_from: int,
         header: dict[str, str]) -> int:
    """Write slot `slot`'s state, which holds `tokens` with ring rows trusted from position `trusted_from`, with
    `header` in the metadata; whole or not at all (a temporary file renamed). Returns the positions saved
    (0: none, and nothing is written)."""
    pos = len(tokens) - 1        # the last token is committed, not yet run: the state ends before it
    if pos < 1:
        return 0
    tensors = take_rows(state, slot, pos, since=trusted_from) | take_blocks(state, slot, 0, pos)
    tensors = {k: t.cpu().contiguous() for k, t in tensors.items()} | {"tokens": torch.tensor(tokens)}
    meta = header | {"format": FORMAT, "position": str(pos), "tokens_sha256": tokens_digest(tokens)}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return pos


def load(path: str | Path, state: DecodeState, slot: int, header: dict[str, str]) -> tuple[list[int], int]:
    """Put the state in `path` into slot `slot`; returns its tokens and the first position whose ring rows it
    restored. ValueError (one line) when the file is not a chat state, was made for another model, dtype,
    drafter or encoding (`header`'s values), is longer than the slot, or is damaged: a tensor missing, of
    another shape or dtype than this state's, or holding NaN or infinity. Nothing is put before all is checked."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError("not a chat state written by /save")
            for key in MATCHED:
                if meta.get(key) != header.get(key):
                    raise ValueError(refusal(key, meta, header))
            pos = int(meta["position"]) if meta.get("position", "").isdecimal() else 0
            if pos < 1:
                raise ValueError("its header has no position (a damaged file)")
            if pos + 1 >= state.max_len:
                raise ValueError(f"it holds {pos + 1} tokens; max_seq_len is {state.max_len}")
            parts = layout(state, pos)
            if set(f.keys()) != set(parts) | {"tokens"}:
                raise ValueError("its tensors are not this model's state (a damaged file)")
            # every ring holds the same rows (those from where the saved state was trusted), at most `pos`
            rows = (f.get_slice("layers.0.win").get_shape() or [0])[0]
            if rows > pos:
                raise ValueError(f"layers.0.win: {rows} rows for {pos} positions (a damaged file)")
            tokens = _read(f, "tokens", [pos + 1], torch.int64).tolist()
            tensors = {name: _read(f, name, [rows if kind == "ring" else n, *t.shape[2:]], t.dtype)
                       for name, (kind, t, n) in parts.items()}
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read it: {e}") from None
    if tokens_digest(tokens) != meta.get("tokens_sha256"):
        raise ValueError("its tokens do not match its header (a damaged file)")
    put_blocks(state, slot, 0, tensors)
    put_rows(state, slot, pos, tensors)
    return tokens, pos - min(rows, state.ring)


def _read(f, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` of an open file, refused (ValueError) unless of `shape` (checked before it is read) and
    `dtype`, and finite."""
    if (found := f.get_slice(name).get_shape()) != shape:
        raise ValueError(f"{name}: shape {found}, this state needs {shape} (a damaged file)")
    t = f.get_tensor(name)
    if t.dtype != dtype:
        raise ValueError(f"{name}: {str(t.dtype).removeprefix('torch.')}, this state holds "
                         f"{str(dtype).removeprefix('torch.')} (a damaged file)")
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise ValueError(f"{name}: holds NaN or infinity (a damaged file)")
    return t


def refusal(key: str, meta: dict[str, str], header: dict[str, str]) -> str:
    """Why a state is refused, naming what made it and what runs now."""
    if key == "model_id":
        return f"made by another model ({meta.get('model', 'unknown')}; this chat runs {header.get('model')})"
    return f"made with {key} {meta.get(key, 'unknown')}; this chat runs {header.get(key)}"
