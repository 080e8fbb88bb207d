"""The fused decode step at DeepSeek V4 Flash's real widths, against the memory roofline.

    python benchmarks/real_width.py [--layers 4,128] [--experts 64] [--vocab 129280] [--threads 1]
        [--batches 1,8] [--depths 0,1] [--contexts 1024] [--reps 5] [--drafter mtp|dspark] [--prefill 256]
        [--out FILE.json]

The model has V4 Flash's widths (hidden 4096, 64 heads x 512, q/o rank 1024, 8 output groups,
experts of width 2048 with 6 routed per token, the indexer's 64 x 128 heads and top-512, vocabulary
129,280) and the layers given by `--layers` (compress ratios: 0 window-only, 4 CSA, 128 HCA) plus
the drafter: the preview's MTP layer, or (`--drafter dspark`) 0731's three DSpark stages with block 5,
Markov rank 256, the last three trunk layers as targets, sharing the trunk's embed and head (as the official
release does; W8A8's copies of them read the same bytes a step); random W8A8 weights built in memory (no
files). The decode state is filled
with random values, as if `--contexts` tokens had been prefilled, so long contexts cost no prefill.

The kernels' packed weights (W8A8's int8, packed float) sit on 2 MiB pages where Linux allows (`madvise`); the
release's weights, read in place, on 4 KiB pages unless `--huge-pages` (a checkpoint's mapping gets 2 MiB pages
where the page cache holds 2 MiB folios: ext4 and xfs on recent kernels). With `--prefill N`, a prompt's first
chunk of N tokens (trunk and head) is timed too: prefill's speed (alone with `--batches ''`).
Each (batch, depth, context) runs the engine's fused step (trunk, sampling, verification, drafting)
`--reps` times; the depth is the MTP chain's K or the DSpark drafts verified, L (the whole block of 5 runs
through the stages at any L, the head and Markov head for its first L slots). Its time is split into
attention, MoE, LM head, the drafter and the rest (mHC, norms, embedding, sampling). The bytes each part
must read are counted per call: the weights it uses (for the MoE: gate, shared expert and only the routed
experts), and the decode state a query reads (window, compressor rings, indexer keys, the CSA top-k or all
HCA blocks).
They are counted as the tensors are held in memory and as stored (int8, fp32 scales, bf16).
The bandwidth is measured in the same process, just before each timed step, by streaming reads of a
buffer at least 4x the last-level cache with the same thread count; roofline = (bytes / bandwidth) / time,
for the median step against its own reading. "bound_roofline" is the roofline model's whole bound, kernel
by kernel: each GEMM call (`wo_a`'s grouped projection included) and attention core at least its bytes /
bandwidth and its flops / the fp32 matmul peak measured in the same process, the rest of each part's bytes at
the bandwidth, summed ("part_bound_roofline": the same taken part by part, as older results stored it).
Each int8 GEMM call counts its multiply-adds against the CPU's own int8 GEMM peak, measured in the same
process on a weight that stays in cache (VNNI's at 48 verified rows is ~10x a small weight's bytes; on AVX2
without VNNI the pair GEMMs' `vpmaddwd` does 16 multiply-adds an instruction, the fp32 FMAs' rate, so from ~2
rows they are compute-bound); the part-wide bound counts them there only, as before. The 43-layer
estimate scales the measured CSA and HCA blocks to V4 Flash's 21 CSA + 22 others (the 2 window-only
layers counted as HCA, slightly over) and keeps the rest of the step (head, drafter, sampling) once.
With DSpark, each depth also gets the tokens a step yields at the acceptance peers measured on 0731
(per position 0.579, 0.447, 0.316, 0.237, 0.158: mean length 2.74) and the tokens/s that implies for
the 43 layers; "auto" is, for that profile and two others (agentic text, a poor drafter), the depth with the
most, which the engine's cost-based choice converges to, with every depth's ratio against plain.
"""
import argparse
import functools
import inspect
import json
import math
import os
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from meta import stamp
from torch import nn

import dsv4cli.kernels
from dsv4cli import platforms
from dsv4cli.engine import Engine, EngineOptions
from dsv4cli.model import DecodeState, ModelConfig, Segment, Transformer
from dsv4cli.model.loader import keep_fp32
from dsv4cli.model.model import Attention, Block, Gate, Linear, MoE, ParallelHead
from dsv4cli.platforms.cpu import weight_buffer

try:            # an older checkout has no DSpark drafter
    from dsv4cli.engine.dspark import DSparkDrafter
    from dsv4cli.engine.mtp import MTPDrafter
    from dsv4cli.model.model import DSparkAttention
except ImportError:
    DSparkDrafter = MTPDrafter = DSparkAttention = None
from dsv4cli.model.quant import FP32_TENSORS, is_w8a8_linear

try:            # an older checkout names no drafter kinds
    from dsv4cli.model.drafters import drafter_kind
except ImportError:
    drafter_kind = None

try:            # an older checkout holds no release formats
    from dsv4cli.model.quant import is_release_fp8
except ImportError:
    is_release_fp8 = None

V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_nextn_predict_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "num_hash_layers": 0, "swiglu_limit": 10.0, "hidden_act": "silu",
    "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
V4_FLASH_CSA, V4_FLASH_OTHER = 21, 22     # of its 43 layers: ratio 4, and ratio 128 or window-only
DSPARK = {"dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_markov_rank": 256}
DSPARK_ACCEPTANCE = (0.579, 0.447, 0.316, 0.237, 0.158)    # 0731 on prose, k=5 (vLLM PR #41834)
# per position, the share of steps that accept the draft there: peers' prose profile, then others auto must
# handle (agentic output accepts more, SGLang measured 3.4-4.0 of 5; a drafter far from the text, little)
PROFILES = {"0731 prose (peers)": DSPARK_ACCEPTANCE, "agentic": (0.85, 0.72, 0.6, 0.5, 0.4),
            "poor": (0.2, 0.05, 0.01, 0.0, 0.0)}
# what block verification added to the mean acceptance length, sampled, as peers measured it: vLLM +0.05 and
# +0.08 (its DSpark recipe turns it on), SGLang +0.10 at temperature 1 (docs/peers-dec-2026.md)
BLOCK_GAINS = (0.05, 0.08, 0.10)
DEVICE = torch.device("cpu")
HUGE_PAGES = False      # --huge-pages
PARTS = ("attention", "moe", "head", "drafter", "other")


def decode_step(engine: Engine, batch: int, depth: int, bound: int):
    """(the slots' device state, a call of the engine's decode step for slots [0, batch) with greedy rows, as
    the engine runs them, its compile key, and its owner); an older checkout's engine was all of them."""
    if hasattr(engine, "runner"):
        from dsv4cli.engine import runner
        key = (runner.StepKey(batch=batch, context=bound, plan=runner.DraftPlan(drafts=depth))
               if hasattr(runner, "DraftPlan") else runner.StepKey((), batch, depth, bound, False, False, True))
        return engine.runner.state, lambda: engine.runner.step(key), key, engine.runner
    greedy = {"greedy": True} if "greedy" in inspect.signature(Engine._fused_decode).parameters else {}
    key = ("_fused_decode", batch, bound, False, False, *greedy.values())
    return engine.state, lambda: engine._fused_decode(batch, bound, sort=False, **greedy), key, engine


def kernel_module(model: Transformer):
    """The module whose ops the model calls: bound to it at prepare (an older checkout dispatched them all)."""
    return getattr(model.layers[0].attn, "ops", dsv4cli.kernels)


def clock() -> float:
    """Seconds, after the device has finished what was queued (accelerators run asynchronously)."""
    platforms.for_device(DEVICE).synchronize(DEVICE)
    return time.perf_counter()


def release_weight(name: str, shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights in the official release's format for the linear `name`: routed experts packed FP4 with an
    E8M0 scale per 32 inputs, other linears FP8 with an fp32 scale per 128 x 128 tile (as the loader holds them);
    values of ~1/sqrt(in)."""
    rows, cols = shape
    if ".experts." in name:
        packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8, device=DEVICE)
        exponent = round(math.log2(1 / (2.2 * math.sqrt(cols))))        # E2M1 codes uniform: std ~2.2
        scale = torch.full((rows, cols // 32), exponent + 127, dtype=torch.uint8, device=DEVICE)
        return packed.view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e8m0fnu)
    w = torch.empty(rows, cols, device=DEVICE).normal_(0, 64, generator=g).to(torch.float8_e4m3fn)
    scale = torch.full((-(-rows // 128), -(-cols // 128)), 1 / (64 * math.sqrt(cols)), device=DEVICE)
    return w, scale


def build_model(cfg: ModelConfig, dtype: torch.dtype, weights: str = "w8a8") -> Transformer:
    """V4-shaped model with random weights: the W8A8 recipe's linears int8 + per-channel scales (`weights`
    w8a8), or the release's FP8 linears and FP4 routed experts (native), the rest float (fp32 where the
    checkpoints keep fp32), materialised tensor by tensor."""
    kind = drafter_kind(cfg) if drafter_kind else getattr(cfg, "drafter", None) == "dspark"   # (an older checkout)
    with torch.device("meta"):
        model = Transformer(cfg)
    g = torch.Generator(DEVICE).manual_seed(0)
    for name, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{name}.{attr}"
            if (weights == "native" and isinstance(module, Linear) and attr == "weight" and is_release_fp8(name)
                    and (".experts." in name or module.holds_fp8)):
                w, scale = release_weight(name, p.shape, g)
                if HUGE_PAGES:      # as a file's mapping is where the page cache holds 2 MiB folios
                    w = weight_buffer(*w.shape, dtype=torch.uint8).copy_(w.view(torch.uint8)).view(w.dtype)
                module.weight = nn.Parameter(w, requires_grad=False)
                module.scale = nn.Parameter(scale, requires_grad=False)
                continue
            int8 = weights == "w8a8" and (is_w8a8_linear(name, kind) if kind else is_w8a8_linear(name))
            if isinstance(module, Linear) and attr == "weight" and int8 and not getattr(module, "float_only", False):
                module.weight = nn.Parameter(torch.randint(-127, 128, p.shape, generator=g, dtype=torch.int8,
                                                           device=DEVICE),
                                             requires_grad=False)
                # int8 uniform codes have std ~73: scale to ~1/sqrt(in) per weight
                scale = torch.full((p.shape[0], 1), 1 / (73 * math.sqrt(p.shape[1])), device=DEVICE)
                module.weight_scale = nn.Parameter(scale, requires_grad=False)
                continue
            t = torch.empty(p.shape, dtype=torch.float32 if keep_fp32(full) else dtype, device=DEVICE)
            if full.endswith(("norm.weight", "_scale")):
                t.fill_(1.0)
            elif full.endswith(("_base", ".ape", "attn_sink", "gate.bias")):
                t.zero_()
            else:
                t.normal_(0, 1 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 1.0, generator=g)
                if not keep_fp32(full):
                    t.copy_(t.bfloat16())      # the checkpoint stores these in bf16: their values are bf16
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)
    model.eval()
    return model.prepare() if hasattr(model, "prepare") else model    # (an older checkout, for before/after)


def twice_over(model: Transformer, cfg: ModelConfig) -> Transformer:
    """The model with its trunk's layers twice over (`cfg`: its config with them), each layer a second time
    after the others: the same modules and weights, so it takes no memory of its own (two W8A8 models of 64
    experts did not fit 24 GB). A weight read again a layer later has had the other layers' hundreds of MB
    read in between, so the caches hold none of it."""
    with torch.device("meta"):
        deeper = Transformer(cfg)
    n = len(model.layers)
    for name, child in model.named_children():
        setattr(deeper, name, nn.ModuleList(model.layers[i % n] for i in range(cfg.n_layers)) if name == "layers"
                else child)
    for name, p in model.named_parameters(recurse=False):
        setattr(deeper, name, p)
    deeper.ops = model.ops
    return deeper.eval()


def held_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stored_bytes(name: str, t: torch.Tensor) -> int:
    """Bytes in the checkpoint: int8, FP8 and FP4 weights and E8M0 scales as held, W8A8's fp32 scales and
    FP32_TENSORS, FP8's tile scales one byte (E8M0), other floats bf16."""
    if name.endswith(".scale") and t.dtype == torch.float32:
        return t.numel()
    if t.element_size() == 1 or name.endswith("weight_scale") or any(k in name for k in FP32_TENSORS):
        return held_bytes(t)
    return t.numel() * 2


def weight_bytes(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> tuple[int, int]:
    """(held, stored) bytes of a module's parameters, leaving out those of the `skip` submodules; a weight
    packed for the CPU kernels counts as its packed copy is held (a bf16-held float weight: 2 bytes)."""
    skipped = {id(p) for m in skip if m is not None for p in m.parameters()}
    params = [(n, p) for n, p in module.named_parameters() if id(p) not in skipped]
    packed = {id(m.weight): m.packed for m in module.modules() if getattr(m, "packed", None) is not None}
    return sum(held_bytes(packed.get(id(p), p)) for _, p in params), sum(stored_bytes(n, p) for n, p in params)


class StreamRead:
    """Streaming reads of a buffer >= 4x the last-level cache (and >= 1 GiB): a call returns the best
    bytes/s of `tries` reads by each of four plain reductions."""

    def __init__(self):
        llc = 32 << 20
        for index in range(5, -1, -1):
            path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
            if path.exists():
                text = path.read_text().strip()
                llc = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
                break
        self.n = max(4 * llc, 1 << 30)
        buf = torch.ones(self.n, dtype=torch.int8, device=DEVICE)
        rows, vec = buf.view(torch.float32).view(-1, 1024), torch.ones(1024, device=DEVICE)
        self.reads = (lambda: buf.amax(), lambda: buf.view(torch.float64).sum(), lambda: buf.view(torch.int64).sum(),
                      lambda: torch.mv(rows, vec))

    def __call__(self, tries: int = 5) -> float:
        best = 0.0
        for read in self.reads:
            read()
            for _ in range(tries):
                t = clock()
                read()
                best = max(best, self.n / (clock() - t))
        return best


class StepProfile:
    """Wraps the model's attention, MoE, head and blocks to time each call and count what it must read."""

    def __init__(self, model: Transformer, cfg: ModelConfig):
        self.cfg, self.model = cfg, model
        self.time = defaultdict(float)
        self.bytes = defaultdict(lambda: [0, 0])        # part -> [held, stored]
        self.block_time = defaultdict(list)             # layer kind -> seconds per trunk block call
        self.block_bytes = defaultdict(list)
        self.core_time = defaultdict(float)             # attention kind -> seconds in its core kernels
        self.core_bytes = defaultdict(int)
        self.core_flops = defaultdict(int)
        self.flops = defaultdict(int)                   # part -> float GEMM flops
        self.int8_ops = defaultdict(int)                # part -> int8 GEMM ops (2 a multiply-add)
        self.gemms = defaultdict(list)                  # part -> (weight bytes, ops, int8) per GEMM call
        self._part = "other"
        self.batch_rows, self.query_rows, self.context, self._kind = 1, 1, 0, None
        self._drafting = False     # within the drafter: what its parts read is the drafter's
        self._patches = []
        moe = model.layers[0].ffn
        self.expert = weight_bytes(moe.experts[moe.first])
        self.kind = {id(b): ("csa" if r == 4 else "hca" if r == 128 else "swa")
                     for b, r in zip(model.layers, cfg.compress_ratios)}

    def _wrap(self, cls, fn, method="forward"):
        orig = getattr(cls, method)

        def forward(module, *args, **kw):
            return fn(module, orig, args, kw)

        setattr(cls, method, forward)
        self._patches.append((cls, orig, method))

    def _wrap_kernel(self, name):
        kernels = kernel_module(self.model)
        orig = getattr(kernels, name)

        def kernel(*args, **kw):
            t = clock()
            out = orig(*args, **kw)
            self.core_time[self._kind] += clock() - t
            return out

        setattr(kernels, name, kernel)
        self._patches.append((kernels, orig, name))

    def _count_gemm(self, name, counts):
        kernels = kernel_module(self.model)
        orig = getattr(kernels, name)
        signature, int8 = inspect.signature(orig), name == "w8a8_linear"

        def kernel(x, *args, **kw):
            out = orig(x, *args, **kw)
            part, ops = "drafter" if self._drafting else self._part, 2 * x.numel() * out.shape[-1]
            counts[part] += ops
            call = signature.bind(x, *args, **kw).arguments      # the weight as it is read: packed where it is
            weight = call.get("packed") if isinstance(call.get("packed"), torch.Tensor) else call["weight"]
            self.gemms[part].append((held_bytes(weight), ops, int8))
            return out

        setattr(kernels, name, kernel)
        self._patches.append((kernels, orig, name))

    def _within(self, part, orig, module, args, kw):
        """orig(module, ...) with its float GEMMs counted to `part`."""
        outer, self._part = self._part, part
        try:
            return orig(module, *args, **kw)
        finally:
            self._part = outer

    def _wrap_drafter(self):
        prof = self

        def propose(drafter, orig, args, kw):
            prof._drafting = True
            t = clock()
            try:
                return orig(drafter, *args, **kw)
            finally:
                prof._drafting = False
                prof.time["drafter"] += clock() - t

        def context(model, orig, args, kw):        # DSpark's projection of the target features
            first = model.mtp[0]
            prof._add("drafter", 0.0, [a + b for a, b in zip(weight_bytes(first.main_proj),
                                                              weight_bytes(first.main_norm))])
            return orig(model, *args, **kw)

        def block(module, orig, args, kw):         # a DSpark stage's attention: its weights and its ring
            (B, size), ring = args[0].shape[:2], args[2].win
            state = held_bytes(ring[:B])
            prof._kind = "dspark"            # its attention core: over the ring and the block
            prof.core_bytes["dspark"] += state
            cfg = prof.cfg          # scores and values of every head of the block's rows over ring and block
            prof.core_flops["dspark"] += 2 * 2 * B * size * cfg.n_heads * cfg.head_dim * (ring.shape[1] + size)
            prof._add("drafter", 0.0, weight_bytes(module), (state, state // ring.element_size() * 2))
            return orig(module, *args, **kw)

        for cls in (MTPDrafter, DSparkDrafter):
            self._wrap(cls, propose, "propose")
        self._wrap(Transformer, context, "dspark_context")
        self._wrap(DSparkAttention, block, "block")

    def __enter__(self):
        prof = self

        def attention(module, orig, args, kw):
            prof._kind = {4: "csa", 128: "hca"}.get(module.ratio, "swa")
            state = prof._state_bytes(module)
            prof.core_bytes[prof._kind] += state[0]
            prof.core_flops[prof._kind] += prof._core_flops(module)
            t = clock()
            out = prof._within("attention", orig, module, args, kw)
            prof._add("attention", clock() - t, weight_bytes(module), state)
            return out

        def moe(module, orig, args, kw):
            prof._routed = set()
            t = clock()
            out = prof._within("moe", orig, module, args, kw)
            held, stored = weight_bytes(module, skip=tuple(module.experts))
            n = len(prof._routed)
            prof._add("moe", clock() - t, (held + n * prof.expert[0], stored + n * prof.expert[1]))
            return out

        def gate(module, orig, args, kw):
            weights, idx = orig(module, *args, **kw)
            prof._routed |= set(idx.flatten().tolist())
            return weights, idx

        def head(module, orig, args, kw):
            t = clock()
            out = prof._within("head", orig, module, args, kw)
            prof._add("head", clock() - t, weight_bytes(module))
            return out

        def block(module, orig, args, kw):
            before = {k: list(v) for k, v in prof.bytes.items()}
            t = clock()
            out = orig(module, *args, **kw)
            dt = clock() - t
            # a DSpark stage's vocabulary tables, heads and target projection are counted where they are used
            used_apart = [getattr(module, n, None) for n in ("embed", "head", "markov_head", "confidence_head",
                                                             "main_proj", "main_norm")]
            prof._add("other", 0.0, weight_bytes(module, skip=(module.attn, module.ffn, *used_apart)))
            if id(module) in prof.kind:      # trunk blocks: kept per kind for the 43-layer estimate
                grown = [sum(prof.bytes[k][i] - before.get(k, [0, 0])[i] for k in prof.bytes) for i in (0, 1)]
                prof.block_time[prof.kind[id(module)]].append(dt)
                prof.block_bytes[prof.kind[id(module)]].append(grown)
            return out

        self._wrap(Attention, attention)
        self._wrap(MoE, moe)
        self._wrap(Gate, gate)
        self._wrap(ParallelHead, head)
        self._wrap(Block, block)
        if DSparkDrafter is not None:
            self._wrap_drafter()
        # the attention core: indexer scan and top-k, attention over the gathered / visible blocks
        for name in ("indexer_scores", "topk_blocks", "sparse_attention", "attention"):
            if hasattr(kernel_module(self.model), name):     # "attention": the dense op of older checkouts
                self._wrap_kernel(name)
        for name in ("linear_fp32", "linear", "grouped_projection",     # wo_a's groups: one call, one weight
                     "fp8_linear", "fp4_linear"):                        # the release's bytes, fp32 math
            if hasattr(kernel_module(self.model), name):
                self._count_gemm(name, self.flops)
        self._count_gemm("w8a8_linear", self.int8_ops)
        return self

    def __exit__(self, *exc):
        for owner, orig, name in reversed(self._patches):
            setattr(owner, name, orig)
        self._patches.clear()

    def _add(self, part, seconds, weights, state=(0, 0)):
        if self._drafting:          # the drafter's time is its whole call's
            part, seconds = "drafter", 0.0
        self.time[part] += seconds
        self.bytes[part][0] += weights[0] + state[0]
        self.bytes[part][1] += weights[1] + state[1]

    def _state_bytes(self, attn: Attention) -> tuple[int, int]:
        """Decode state one call must read, per sequence: the window and the compressed blocks it
        attends to (the indexer's top-k for CSA, plus the indexer's keys of every visible block;
        every visible block for HCA). The compressor's ring rows, read when a block closes, are
        left out (under 1% of this)."""
        c, held_el = self.cfg, self.model.dtype.itemsize
        ctx, r = self.context, attn.ratio
        values = c.window_size * c.head_dim
        if r == 4:
            values += min(c.index_topk, ctx // 4) * c.head_dim + ctx // 4 * c.index_head_dim
        elif r == 128:
            values += ctx // 128 * c.head_dim
        return self.batch_rows * values * held_el, self.batch_rows * values * 2

    def _core_flops(self, attn: Attention) -> int:
        """Multiply-adds x 2 of the attention core for every query row: the indexer's scan of every
        closed block (all its heads), then scores and values over the window and the blocks read."""
        c, ctx, r = self.cfg, self.context, attn.ratio
        keys = c.window_size
        scan = 0
        if r == 4:
            keys += min(c.index_topk, ctx // 4)
            scan = 2 * c.index_n_heads * c.index_head_dim * (ctx // 4)
        elif r == 128:
            keys += ctx // 128
        return self.query_rows * (scan + 2 * 2 * c.n_heads * c.head_dim * keys)

    def reset(self):
        self.gemms.clear()
        self.core_flops.clear()
        self.flops.clear()
        self.int8_ops.clear()
        self.core_time.clear()
        self.core_bytes.clear()
        self.time.clear()
        self.bytes.clear()
        self.block_time.clear()
        self.block_bytes.clear()


def compiled_step_times(engine, batch, depth, context_bound, reps) -> tuple[list[float], float, int]:
    """The same step compiled (torch.compile, as `--compile on` runs it): rep times, compile time and
    kernel calls. Parts are not timed: the compiled graph has no module boundaries left."""
    from dsv4cli.bench import kernel_calls
    from dsv4cli.engine.compiled import CompiledSteps
    _, _, key, owner = decode_step(engine, batch, depth, context_bound)
    step = CompiledSteps(owner, DEVICE)
    times = []
    for _ in range(reps + 1):                          # the first compiles
        t = clock()
        with torch.no_grad():
            step(key)
        times.append(clock() - t)
    return times[1:], times[0], kernel_calls(step.sources[key])


class FilledStep:
    """An engine for `model` and its decode step for slots [0, batch) verifying `depth` drafts, the decode state
    filled with random values as if `context` tokens had been prefilled; `refill()` puts positions, last tokens
    and drafts back before a step."""

    def __init__(self, model: Transformer, batch: int, depth: int, context: int):
        self.engine = Engine(model, None, EngineOptions(max_batch=batch, max_seq_len=context + 64, drafts=depth,
                                                        graphs=False))
        self.batch, self.depth, self.context = batch, depth, context
        self.context_bound = -(-(context + depth + 1) // 512) * 512
        self.state, self.step, self.key, self.owner = decode_step(self.engine, batch, depth, self.context_bound)
        self.vocab = model.cfg.vocab_size
        self.g = torch.Generator(DEVICE).manual_seed(1)
        for cache in self.state.cache.layers + self.state.cache.drafter:
            for t in cache.tensors():
                t.normal_(0, 1, generator=self.g)

    def refill(self):
        self.state.pos.fill_(self.context - 1)
        self.state.last.copy_(torch.randint(0, self.vocab, (self.batch,), generator=self.g, device=DEVICE))
        self.state.drafts.copy_(torch.randint(0, self.vocab, self.state.drafts.shape, generator=self.g,
                                              device=DEVICE))


def layer_scaling(steps: list[FilledStep], layers: list[int], reps: int, stream: StreamRead, compiled: bool,
                  bytes_43: int) -> dict:
    """The same decode step of models that differ only in their trunk's layer count (`layers`), eager and, where
    asked, compiled, the models and modes in turn rep by rep (this machine's speed drifts): each one's median
    step, and the 43-layer step as the shallowest one's plus the measured cost per layer. The compiled graph has
    no module boundaries left to time, so this is how the compiled step scales; eager, it checks the
    block-by-block estimate. Roofline: `bytes_43` (the block-by-block count) over the median bandwidth read."""
    from dsv4cli.engine.compiled import CompiledSteps
    calls = {("eager", i): f.step for i, f in enumerate(steps)}
    for i, f in enumerate(steps if compiled else ()):
        calls["compiled", i] = functools.partial(CompiledSteps(f.owner, DEVICE), f.key)
    times, reads = defaultdict(list), []
    for rep in range(reps + 1):                          # the first warms up (and compiles)
        for (mode, i), call in calls.items():
            steps[i].refill()
            t = clock()
            with torch.no_grad():
                call()
            if rep:
                times[mode, i].append(clock() - t)
        if rep:
            reads.append(stream(tries=2))
    bw = statistics.median(reads)
    out = {"layers": layers, "stream_read_gb_s": round(bw / 1e9, 3), "v4_flash_43_layers": {}}
    for mode in sorted({m for m, _ in calls}):
        t = [statistics.median(times[mode, i]) for i in range(len(steps))]
        per_layer = (t[-1] - t[0]) / (layers[-1] - layers[0])
        t43 = t[0] + per_layer * (V4_FLASH_CSA + V4_FLASH_OTHER - layers[0])
        out[f"{mode}_ms"] = [round(x * 1e3, 2) for x in t]
        out["v4_flash_43_layers"][mode] = {"step_ms": round(t43 * 1e3, 1), "ms_per_layer": round(per_layer * 1e3, 2),
                                           "roofline": round(bytes_43 / bw / t43, 3)}
    return out


def run(model, cfg, batch, depth, context, reps, stream: StreamRead, peak, int8_peak, compile_too=False) -> dict:
    filled = FilledStep(model, batch, depth, context)
    engine, context_bound, step = filled.engine, filled.context_bound, filled.step
    steps, profiled, parts, reads = [], [], [], []
    prof = StepProfile(model, cfg)
    prof.batch_rows, prof.query_rows, prof.context = batch, batch * (depth + 1), context
    for rep in range(reps + 1):                      # the first is a warm-up
        # each step against a bandwidth reading taken just before it: this shared machine's
        # bandwidth drifts by 1.5x within a run, which moved whole-run fractions by as much
        bw = stream(tries=2)
        filled.refill()
        t = clock()
        with torch.no_grad():
            step()
        dt = clock() - t
        # then the same step split into parts: the profile's hooks (Python on every module and GEMM call) add
        # ~3 ms a layer, so the step's time and roofline are the step's without them
        filled.refill()
        prof.reset()
        with prof:
            t = clock()
            with torch.no_grad():
                step()
            dt_profiled = clock() - t
        if rep:
            steps.append(dt)
            reads.append(bw)
            profiled.append(dt_profiled)
            parts.append((dict(prof.time), {k: list(v) for k, v in prof.bytes.items()},
                          {k: list(v) for k, v in prof.block_time.items()},
                          {k: list(v) for k, v in prof.block_bytes.items()},
                          dict(prof.core_time), dict(prof.core_bytes), dict(prof.core_flops), dict(prof.flops),
                          dict(prof.int8_ops), {k: list(v) for k, v in prof.gemms.items()}))
    mid = steps.index(sorted(steps)[len(steps) // 2])       # the median rep, whose bandwidth reading is used
    median, bw = steps[mid], reads[mid]
    mid_profiled = profiled.index(sorted(profiled)[len(profiled) // 2])      # and the one whose parts are reported
    median_profiled = profiled[mid_profiled]
    times, nbytes, block_time, block_bytes, core_time, core_bytes, core_flops, flops, int8_ops, gemms = \
        parts[mid_profiled]
    times["other"] = median_profiled - sum(v for k, v in times.items() if k != "other")
    total = [sum(v[i] for v in nbytes.values()) for i in (0, 1)]

    core_part = {"dspark": "drafter"}       # the attention cores' flops: the trunk's attention, the drafter's
    work = {p: flops.get(p, 0) + sum(f for k, f in core_flops.items() if core_part.get(k, "attention") == p)
            for p in PARTS}
    # the part-wide bound as before: int8 ops counted on the AVX2 pairs only
    from dsv4cli.kernels import cpu
    part_int8 = int8_peak if DEVICE.type == "cpu" and cpu.slow_int8() else None
    int8_s = {p: int8_ops.get(p, 0) / part_int8 if part_int8 else 0.0 for p in PARTS}
    part_bound = {p: max(nbytes.get(p, [0, 0])[0] / bw, work[p] / peak + int8_s[p]) for p in PARTS}

    # the roofline kernel by kernel: each GEMM call and attention core at least its bytes over the bandwidth
    # and its ops over its peak, the part's other bytes (experts, norms, tables) at the bandwidth. One core
    # runs its kernels one after another, so a compute-bound GEMM (the head over a block's rows) can't hide
    # the next kernel's memory read, which the part-wide bound above assumes.
    def kernel_s(nb, ops, int8):
        return max(nb / bw, (ops / int8_peak if int8_peak else 0.0) if int8 else ops / peak)
    kernels = {p: list(gemms.get(p, [])) for p in PARTS}
    for k in core_flops:
        kernels[core_part.get(k, "attention")].append((core_bytes.get(k, 0), core_flops[k], False))
    bound = {p: max(nbytes.get(p, [0, 0])[0] / bw, sum(kernel_s(*c) for c in kernels[p])
                    + max(0, nbytes.get(p, [0, 0])[0] - sum(c[0] for c in kernels[p])) / bw) for p in PARTS}

    def roof(b, t):
        return round(b / bw / t, 3) if t > 0 else None

    result = {
        "batch": batch, "mtp": depth, "context": context, "rows_per_step": batch * (depth + 1),
        "step_ms": {"min": round(min(steps) * 1e3, 2), "median": round(median * 1e3, 2)},
        # the step with the profile's hooks, whose parts are below: their times include the hooks'
        "profiled_step_ms": round(median_profiled * 1e3, 2),
        "stream_read_gb_s": round(bw / 1e9, 3),
        "bytes_held": total[0], "bytes_stored": total[1], "roofline": roof(total[0], median),
        "parts": {p: {"ms": round(times.get(p, 0.0) * 1e3, 2), "bytes_held": nbytes.get(p, [0, 0])[0],
                      "bytes_stored": nbytes.get(p, [0, 0])[1], "roofline": roof(nbytes.get(p, [0, 0])[0],
                                                                                  times.get(p, 0.0)),
                      "flops": work[p], "int8_ops": int8_ops.get(p, 0), "bound_ms": round(bound[p] * 1e3, 2),
                      "bound_roofline": round(bound[p] / times[p], 3) if times.get(p, 0.0) > 0 else None}
                  for p in PARTS},
        # the roofline model's bound, kernel by kernel (above): int8 GEMMs count their ops against the int8
        # peak where that is measured, else memory-bound; at 40-48 verified rows the LM head's product is
        # compute-bound on a CPU core, where the memory roofline alone would call it slow
        "bound_ms": round(sum(bound.values()) * 1e3, 2), "bound_roofline": round(sum(bound.values()) / median, 3),
        # the same bound taken part by part (each part's bytes or its ops, whichever is longer), kept to
        # compare with results stored before the kernel-by-kernel bound
        "part_bound_roofline": round(sum(part_bound.values()) / median, 3),
        # per attention kind, weights excluded: indexer scan + top-k + attention, against the state
        # bytes it must read (window, indexer keys, top-k blocks for CSA; closed blocks for HCA)
        # and against the compute peak: the indexer's scan does 2 x 64 heads flops per key byte in
        # fp32 (32 flop/byte), compute-bound on a CPU core, memory-bound on a GPU
        "attention_core": {k: {"ms": round(core_time[k] * 1e3, 3), "bytes_held": core_bytes.get(k, 0),
                               "roofline": roof(core_bytes.get(k, 0), core_time[k]), "flops": core_flops.get(k, 0),
                               "compute_roofline": round(core_flops.get(k, 0) / peak / core_time[k], 3)}
                           for k in sorted(core_time)},
    }
    if compile_too:
        times, compile_s, calls = compiled_step_times(engine, batch, depth, context_bound, reps)
        t = sorted(times)[len(times) // 2]
        # the same bound: the work is the eager step's, kernel for kernel
        result["compiled"] = {"step_ms": {"min": round(min(times) * 1e3, 2), "median": round(t * 1e3, 2)},
                              "roofline": roof(total[0], t), "bound_roofline": round(sum(bound.values()) / t, 3),
                              "compile_s": round(compile_s, 1),
                              "kernel_calls": calls}
    if "csa" in block_time and "hca" in block_time:
        rest_t = median_profiled - sum(sum(v) for v in block_time.values())
        rest_b = total[0] - sum(b[0] for v in block_bytes.values() for b in v)
        # the profiled blocks scaled, then brought to the step without the hooks (their share taken evenly;
        # --deeper measures the 43-layer step from a layer's cost without any)
        t43 = (V4_FLASH_CSA * block_time["csa"][0] + V4_FLASH_OTHER * block_time["hca"][0] + rest_t) \
            * median / median_profiled
        b43 = V4_FLASH_CSA * block_bytes["csa"][0][0] + V4_FLASH_OTHER * block_bytes["hca"][0][0] + rest_b
        result["v4_flash_43_layers"] = {"step_ms": round(t43 * 1e3, 1), "bytes_held": b43, "roofline": roof(b43, t43),
                                        "tokens_per_s": round(batch * (depth + 1) / t43, 2) if depth == 0 else None}
        if getattr(model.cfg, "drafter", None) == "dspark":
            tokens = 1 + sum(DSPARK_ACCEPTANCE[:depth])
            result["v4_flash_43_layers"].update(tokens_per_step=round(tokens, 3),
                                                tokens_per_s=round(batch * tokens / t43, 3))
    return result


def prefill(model: Transformer, tokens: int, reps: int) -> dict:
    """A prompt's first chunk of `tokens` through the trunk (the cached path a step's prefill segment takes) and
    the head on its last row: min and median seconds over `reps` after a warm-up, and tokens/s at the median."""
    state = DecodeState(model, 1, tokens + 64)
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    times = []
    for rep in range(reps + 1):
        t = clock()
        with torch.no_grad():
            (rows,) = model.forward_segments([Segment(ids.to(DEVICE), torch.tensor([0], device=DEVICE), state)])
            model.logits(rows.hidden[:, -1:])
        if rep:
            times.append(clock() - t)
    median = sorted(times)[len(times) // 2]
    return {"tokens": tokens, "s": {"min": round(min(times), 4), "median": round(median, 4)},
            "tokens_per_s": round(tokens / median, 2)}


def int8_gemm_peak() -> float | None:
    """Best ops/s (2 a multiply-add) of the CPU's exact int8 GEMM as the step runs it, 48 rows against a weight
    that stays in cache: the native kernels' (VNNI, or AMX where it takes 48 rows) or, where exact int8 GEMMs
    are slow (`cpu.slow_int8`: AVX2 without VNNI), the AVX2 pair GEMM's. None elsewhere (accelerators; a CPU
    with neither: int8 GEMMs there count by their bytes)."""
    from dsv4cli.kernels import cpu, native
    if DEVICE.type != "cpu":
        return None
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (512, 1024), generator=g, dtype=torch.int8)
    q = torch.randint(-127, 128, (48, 1024), generator=g, dtype=torch.int8)
    if native.available():
        packed = native.pack_int8(w)

        def gemm():
            native.int8_mm(q, packed)
    elif cpu.slow_int8() and native.avx2_available():
        packed = native.pack_pairs(w[None])

        def gemm():
            torch.ops.dsv4.pairs_linear(q, packed)
    else:
        return None
    best = 0.0
    for _ in range(20):
        t = clock()
        gemm()
        best = max(best, 2 * 48 * 512 * 1024 / (clock() - t))
    return best


def matmul_peak() -> float:
    """Best flop/s of a square fp32 matrix product (the model's dtype on the CPU) on this device."""
    n = 2048
    a = torch.randn(n, n, device=DEVICE)
    best = 0.0
    for _ in range(4):
        t = clock()
        a @ a
        best = max(best, 2 * n ** 3 / (clock() - t))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="4,128", help="compress ratios of the trunk layers")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,8", help="'' for none: with --prefill, prefill alone")
    ap.add_argument("--depths", default="0,1")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true", help="also time the compiled step (torch.compile)")
    ap.add_argument("--weights", default="w8a8", choices=["w8a8", "native"],
                    help="the W8A8 recipe's int8 linears, or the official release's FP8 linears and FP4 experts")
    ap.add_argument("--huge-pages", action="store_true",
                    help="native: the release's weights on 2 MiB pages (the packed W8A8 weights always are)")
    ap.add_argument("--deeper", action="store_true",
                    help="also time the step of the model with its layers twice over (`twice_over`), the two in "
                         "turn (eager, and compiled with --compile): the 43-layer step from the cost of a layer")
    ap.add_argument("--prefill", default="", help="also time a prompt's first chunk of these lengths, e.g. 256,1024")
    ap.add_argument("--drafter", default="mtp", choices=["mtp", "dspark"],
                    help="the preview's MTP layer, or 0731's DSpark stages (depths: the drafts verified, 0-5)")
    a = ap.parse_args()
    global DEVICE, HUGE_PAGES
    DEVICE, HUGE_PAGES = torch.device(a.device), a.huge_pages
    torch.set_num_threads(a.threads)
    ratios = [int(r) for r in a.layers.split(",")]

    def flash_config(trunk: list[int]) -> ModelConfig:
        cfg = {**V4_FLASH, "num_hidden_layers": len(trunk), "compress_ratios": trunk + [0],
               "n_routed_experts": a.experts, "vocab_size": a.vocab}
        if a.drafter == "dspark":       # the last three trunk layers as targets (as many as --layers has)
            cfg.update(DSPARK, compress_ratios=trunk + [0, 0, 0],
                       dspark_noise_token_id=min(DSPARK["dspark_noise_token_id"], a.vocab - 1),
                       dspark_target_layer_ids=list(range(len(trunk)))[-min(3, len(ratios)):])
        return ModelConfig.from_dict(cfg)

    t = clock()
    model = build_model(flash_config(ratios), getattr(torch, a.dtype), a.weights)
    built = clock() - t
    # --deeper: the same model with the layers twice over, to measure what a layer costs in the whole step
    deeper = twice_over(model, flash_config(ratios * 2)) if a.deeper else None
    stream = StreamRead()
    first_bw, peak, int8_peak = stream(), matmul_peak(), int8_gemm_peak()
    int8_note = f", int8 GEMM {int8_peak / 1e9:.0f} GOP/s" if int8_peak else ""
    print(f"model built in {built:.1f} s; stream read {first_bw / 1e9:.2f} GB/s, fp32 matmul {peak / 1e9:.0f} GFLOP/s"
          f"{int8_note} "
          f"with {a.threads} thread(s)")
    results, auto = [], []
    for context in [int(c) for c in a.contexts.split(",")]:
        for batch in [int(b) for b in a.batches.split(",") if b]:
            for depth in [int(d) for d in a.depths.split(",")]:
                r = run(model, model.cfg, batch, depth, context, a.reps, stream, peak, int8_peak, a.compile)
                if deeper is not None and "v4_flash_43_layers" in r:
                    r["layer_scaling"] = layer_scaling(
                        [FilledStep(m, batch, depth, context) for m in (model, deeper)], [len(ratios), 2 * len(ratios)],
                        a.reps, stream, a.compile, r["v4_flash_43_layers"]["bytes_held"])
                parts = "  ".join(f"{p} {v['ms']} ms ({v['roofline']})" for p, v in r["parts"].items())
                core = "  ".join(f"{k} {v['ms']} ms ({v['roofline']}, compute {v['compute_roofline']})"
                         for k, v in r["attention_core"].items())
                print(f"ctx {context} batch {batch} depth {depth}: step {r['step_ms']['median']} ms, roofline "
                      f"{r['roofline']} (with compute: {r['bound_roofline']})  |  {parts}  |  core: {core}  |  "
                      f"43 layers: {r.get('v4_flash_43_layers')}  |  compiled: {r.get('compiled')}"
                      + (f"  |  43 layers by layer count: {r['layer_scaling']}" if "layer_scaling" in r else ""))
                results.append(r)
            if a.drafter == "dspark":
                # the 43-layer step time of each depth, and what it yields at each acceptance profile: auto
                # verifies the depth with the most tokens per second (plain, depth 0, among them)
                steps = {r["mtp"]: r["v4_flash_43_layers"]["step_ms"] for r in results
                         if r["batch"] == batch and r["context"] == context and "v4_flash_43_layers" in r}
                for name, profile in PROFILES.items() if steps else ():
                    rates = {d: batch * (1 + sum(profile[:d])) / (ms / 1e3) for d, ms in steps.items()}
                    best = max(rates, key=rates.get)
                    # the block rule's longer mean length at the same step time, where it drafts
                    block = {gain: round((1 + sum(profile[:best]) + gain) / (1 + sum(profile[:best])), 3)
                             for gain in BLOCK_GAINS} if best else None
                    auto.append({"batch": batch, "context": context, "profile": name, "depth": best,
                                 "tokens_per_s": round(rates[best], 3),
                                 "vs_plain": {d: round(v / rates[0], 3) for d, v in rates.items()} if 0 in rates
                                 else None, "block_verify_vs_token": block})
                    print(f"ctx {context} batch {batch} {name}: auto verifies {best}, {rates[best]:.3f} tok/s "
                          f"(43 layers); vs plain by depth {auto[-1]['vs_plain']}; block verification at peers' "
                          f"+{'/+'.join(map(str, BLOCK_GAINS))} mean length: {block}")
    prefills = [prefill(model, int(n), a.reps) for n in a.prefill.split(",") if n]
    for r in prefills:
        print(f"prefill {r['tokens']} tokens: {r['s']['median']} s, {r['tokens_per_s']} tok/s")
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else None
    report = {"benchmark": "real_width", "device": gpu or a.device,
              "machine": {"cpu": platform.processor() or platform.machine(),
                                                     "cores": os.cpu_count(), "threads": a.threads},
              "stream_read_gb_s": round(first_bw / 1e9, 3), "fp32_matmul_gflop_s": round(peak / 1e9, 1),
              "int8_gemm_gop_s": round(int8_peak / 1e9, 1) if int8_peak else None,
              "dtype": a.dtype, "weights": a.weights, "layers": ratios,
              "experts": a.experts, "vocab": a.vocab, "drafter": a.drafter, "results": results}
    if auto:
        report["auto"] = auto
    if prefills:
        report["prefill"] = prefills
    report["meta"] = stamp(vars(a))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
