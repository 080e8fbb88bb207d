"""The engine API the front ends (chat, batch, generate, bench) use: `Engine` in one process and
`parallel.Leader` for --tp both provide it, and the front ends are typed against it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from dsv4cli.model.drafters import drafter_kind, drafter_named
from dsv4cli.model.model import RELEASE_FORMATS

if TYPE_CHECKING:
    from dsv4cli.model import Transformer
    from dsv4cli.tokenizer import Tokenizer

    from .request import Event, Metrics, Sequence
    from .sampling import SamplingParams


@dataclass(frozen=True)
class EngineOptions:
    """What an engine is built with: once, from the run's settings (`loading.build_engine`); replaced, not
    re-listed, by a resize (`Engine.resized`), and sent whole to the other ranks of --tp."""
    max_batch: int = 8
    max_seq_len: int = 4096
    # drafts verified per step (0: plain decoding), or "auto": a DSpark drafter's block, each step verifying as
    # many as pay off (`draft_length.py`); the MTP layer drafts 1
    drafts: int | str = 1
    verify: str = "block"           # how sampled drafts are verified: "block" or "token" (`verify.py`)
    prefill_chunk: int = 256        # a prompt's rows in one chunk at most
    prefill_budget: int = 160       # prefill tokens per step: running streams wait at most this much between tokens
    graphs: bool = True             # decode-only steps captured as graphs where the platform can
    reuse_prefix: bool = False      # a new prompt starts where a free slot's state stops matching it (chat turns)
    prefix_cache: tuple[int, int] = (0, 0)  # the prefix store's device and host bytes (`prefix_store.py`; 0: none)
    # steps compiled per key; in the background (a process of its own, given the engine's `reload`), a saved
    # step swapping in when the engine idles (`swap` "idle": a stream never waits for it) or at once ("ready":
    # a job that never idles)
    compile: bool = False
    compile_in_background: bool = False
    swap: str = "idle"
    # a step that raises fails the requests in it and the engine goes on; off, it raises (the ranks of --tp
    # must all take the same steps)
    isolate_failures: bool = True


@dataclass(frozen=True)
class EngineStatus:
    """How the engine's steps run now, as the front ends show it (`EngineAPI.status`)."""
    compile: str | None = None      # how decode steps run under compile ("eager, compiling", ...); None: off
    recompiles: int | None = None   # compiled steps whose guards failed (must stay 0); None: compile off
    decode_code: tuple[tuple[str, ...], ...] = ()   # each compiled decode step's generated wrapper code
    draft_lengths: dict | None = None   # auto drafting's cost model and choices (`DraftLength.report`)


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model is, as a front end shows it."""
    parameters: int     # those this process holds (a rank's slice under --tp), weight scales not counted
    weights: str        # how the linears are held: "fp8+fp4" (the release's bytes), "w8a8" (int8) or "float"
    dtype: str          # the float weights' dtype, e.g. "float32"
    device: str
    layers: int
    drafter_layers: int     # the drafter's layers: the MTP layer, or DSpark's stages
    vocab_size: int
    drafter: str | None     # its kind's name (`drafters.drafter_named`): "dspark" (0731), "mtp" (the preview) or None
    block_size: int         # the most drafts a step can draft: one pass's block, DSpark's (0: no bound, or no drafter)

    @classmethod
    def of(cls, model: Transformer) -> ModelInfo:
        cfg, weight, kind = model.cfg, model.embed.weight, drafter_kind(model.cfg)
        held = {p.dtype for p in model.parameters()}
        weights = "fp8+fp4" if held & set(RELEASE_FORMATS) else "w8a8" if torch.int8 in held else "float"
        return cls(parameters=held_parameters(model), weights=weights,
                   dtype=str(weight.dtype).removeprefix("torch."), device=str(weight.device), layers=cfg.n_layers,
                   drafter_layers=cfg.n_mtp_layers, vocab_size=cfg.vocab_size, drafter=cfg.drafter,
                   block_size=(kind.max_depth(cfg) if kind else None) or 0)


def held_parameters(model: Transformer) -> int:
    """The parameters a model holds, as its checkpoint's config counts them: no scales, packed FP4 two a byte."""
    return sum(p.numel() * (2 if p.dtype == torch.float4_e2m1fn_x2 else 1) for name, p in model.named_parameters()
               if not name.endswith(("weight_scale", ".scale")))


@runtime_checkable
class EngineAPI(Protocol):
    """Requests in, events out: `submit` queues a request, each `step` admits waiting requests and decodes
    one step for every running one, `cancel` ends one early. A Sequence holds a request's output so far."""
    tok: Tokenizer
    device: torch.device
    max_batch: int
    max_seq_len: int
    drafts: int | str      # the drafts-per-step setting: K, or "auto"
    draft_depth: int      # tokens drafted per step, and verified at most (0 = plain decoding)
    verify: str         # how sampled drafts are verified: "token" or "block"
    totals: Metrics     # of every finished request

    @property
    def model_info(self) -> ModelInfo: ...

    def status(self) -> EngineStatus:
        """How its steps run now (cheap: a chat's status bar asks at every redraw)."""
        ...

    def on_compile(self, note) -> None:
        """Call `note(decode, how)` before a step shape builds (`how`: "compiling" or "loading"; `decode`: a
        decode step, else a prefill chunk), where compile is on."""
        ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence: ...

    def step(self) -> list[Event]: ...

    def cancel(self, seq: Sequence) -> None: ...

    def has_work(self) -> bool: ...

    def save_state(self, path: str, header: dict[str, str]) -> int:
        """Write a chat's decode state (a one-slot engine's) and its tokens to `path`, with `header` (strings)
        in its metadata; returns the positions saved (0: none yet, nothing written). ValueError where the
        engine can't."""
        ...

    def load_state(self, path: str, header: dict[str, str]) -> int:
        """Read a state `save_state` wrote into a one-slot engine, whose next prompt resumes it (no prefill of
        what it holds); returns its positions. ValueError (one line) for a state of another model, dtype,
        drafter or `header` (the chat encoding), or one the engine can't hold."""
        ...

    def close(self) -> None:
        """Stop what runs beside the engine (a compile, other ranks)."""
        ...

    def resized(self, max_batch: int, drafts: int, compile: bool | None = None, verify: str | None = None
                ) -> EngineAPI:
        """The same loaded model with another batch size or drafts setting (and compiled step or not, verify
        rule; None: as this one)."""
        ...


def drafter_label(engine: EngineAPI) -> str:
    """How the engine drafts, as the front ends name it: "DSpark auto (block 5)", "DSpark 3 of 5", "MTP 2" or
    "off", and ", token verify" where sampled drafts are verified one by one (the block rule is the default)."""
    info = engine.model_info
    if not engine.draft_depth:
        return "off"
    label = drafter_named(info.drafter).label
    rule = ", token verify" if engine.verify == "token" else ""
    if info.block_size:
        return (f"{label} auto (block {info.block_size})" if engine.drafts == "auto" else
                f"{label} {engine.drafts} of {info.block_size}") + rule
    return f"{label} {engine.draft_depth}{rule}"


def acceptance_text(m: Metrics) -> str:
    """A request's (or a run's) acceptance in one phrase: rate, mean acceptance length (accepted + bonus per
    drafting step) and each position's rate; "" without drafts."""
    if not m.drafts:
        return ""
    per = " ".join(f"{p:.2f}" for p in m.per_position)
    return f"accept {100 * m.acceptance_rate:.1f}% · mean length {m.mean_acceptance_length:.2f} · per position {per}"
