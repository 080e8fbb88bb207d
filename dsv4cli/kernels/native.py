"""The CPU's few-row GEMMs (`cpu_gemm.c`), the indexer's scan (`cpu_indexer.c`), sparse attention
(`cpu_attention.c`), the compressors' pooling (`cpu_compress.c`), and the small ops torch runs as many: mHC
(`cpu_mhc.c`), RoPE (`cpu_rope.c`), per-token int8 quantisation (`cpu_quant.c`); built with the machine's C
compiler on first use; on CPUs without AVX-512 VNNI, the AVX2 ops built against torch's headers: the pair GEMMs
of the routed experts' stacks and int8 linears (`cpu_pairs.cpp`) and the float linears' few-row GEMM (`cpu_float.cpp`).

On the CPU a decode step's GEMMs have 1-16 rows against weights far larger than the caches: their
cost is one read of the weight. torch's kernels read it well for one or two rows only (MKL's fp32 GEMM;
oneDNN's prepacked int8 swings from run to run), so weights of 2 MiB and more are packed into these kernels'
layouts at load: 1-4 rows read near the streaming read, AMX (where the CPU has it) takes int8 GEMMs of
8 rows and more, prefill's included, and float weights whose values are bf16 are held in bf16 (half the
bytes, the same fp32 sums). benchmarks/README.md has the numbers (`benchmarks/cpu_gemm.py`).

Built once per source, compiler and flags into the user cache (`kernels/`), loaded with ctypes (a
call releases the GIL; inside a compiled graph the calls are custom ops). Where it can't be (no C
compiler, a CPU without AVX-512 VNNI, not x86-64 Linux, or `DSV4_NATIVE_KERNELS=0`), `available()` is
False and the CPU kernel module (`cpu.py`) keeps torch's kernels; `avx2_available()` likewise for the
AVX2 ops (no C++ compiler, no AVX2 and FMA).

The official release's FP8 and FP4 weights are multiplied as stored, read in place (`cpu_lowbit.c`, its own
library: `lowbit_library()`, `fp8_mm`, `fp4_mm`), built for AVX-512 or, on CPUs without it, AVX2; for a bf16
run's activations, on CPUs with AVX-512 VNNI and BF16, faster kernels beside them (`fp4_mm_q8`, `fp8_mm_bf16`).
"""
import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path

import torch

from dsv4cli.cache import user_cache_dir
from dsv4cli.platforms.cpu import weight_buffer

from .reference import AMAX_FLOOR

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemm.c", "cpu_indexer.c", "cpu_attention.c",
                                                                "cpu_compress.c", "cpu_mhc.c", "cpu_rope.c",
                                                                "cpu_quant.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_load.h", "cpu_exp.h")]   # included: part of a build
# -ffp-contract=off: no multiply-add fused behind our back, so the routed experts' arithmetic is the reference's
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
AMX_FLAGS = ["-mamx-tile", "-mamx-int8"]     # where the compiler knows them; the build goes on without
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
AVX2_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_pairs.cpp", "cpu_float.cpp")]
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
              "-w"]     # -w: torch's headers warn under C++17; -fopenmp: at::parallel_for's threads are OpenMP's
AVX2_CPU_FLAGS = ("avx2", "fma")
PAIRS_COLS = 16    # output columns per block of the pair GEMMs (cpu_pairs.cpp); an expert's width must be a multiple
BLOCK = 32         # output channels per packed block (cpu_gemm.c)
# int8 GEMMs with this many rows or more take AMX where the CPU has it: from 8 rows it reads the weight
# faster than VNNI, which is compute-bound there (benchmarks/README.md: `cpu_gemm.py`)
AMX_MIN_ROWS = 8


def constant_when_traced(fn):
    """`torch.compiler.assume_constant_result`'s mark, set without it: the public call imports torch._dynamo
    (a large part of every start-up, compiled or not: benchmarks/README.md, `startup.py`); the mark is the
    attribute dynamo reads while tracing."""
    fn._dynamo_marked_constant = True
    return fn


def _cpu_flags() -> set[str]:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return set()
    try:
        return set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


def _compiler(names=("cc", "gcc", "clang"), env: str = "CC") -> str | None:
    found = (shutil.which(c) for c in (os.environ.get(env), *names) if c)
    return next((path for path in found if path), None)


def _build(cc: str, flags: list[str], sources: list[Path] = SOURCES, libs: tuple[str, ...] = ()) -> Path | None:
    """The library built from `sources` with these flags, linked against `libs`, in the user cache (once per
    sources and the headers they include, compiler, flags and torch version), or None if the compiler fails."""
    text = b"".join(path.read_bytes() for path in [*sources, *HEADERS]) + torch.__version__.encode()
    digest = hashlib.sha256(text + cc.encode() + " ".join([*flags, *libs]).encode()).hexdigest()[:16]
    path = user_cache_dir() / "kernels" / f"{sources[0].stem}-{digest}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:    # built whole, then renamed in place
                part = Path(tmp) / path.name
                subprocess.run([cc, *flags, *map(str, sources), *libs, "-o", str(part)], check=True,
                               capture_output=True)
                os.replace(part, path)
        except (OSError, subprocess.CalledProcessError):
            return None
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they can't be built or run here. `library().amx`: whether
    int8 GEMMs may use AMX tiles in this process."""
    cpu = _cpu_flags()
    if os.environ.get("DSV4_NATIVE_KERNELS", "1") == "0" or not cpu.issuperset(CPU_FLAGS) or not (cc := _compiler()):
        return None
    path = _build(cc, FLAGS + AMX_FLAGS) or _build(cc, FLAGS)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int]
    lib.dsv4_int8_mm.argtypes = args + [ctypes.c_int]
    lib.dsv4_float_mm.argtypes = lib.dsv4_bf16_mm.argtypes = args
    lib.dsv4_int8_mm.restype = lib.dsv4_float_mm.restype = lib.dsv4_bf16_mm.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dsv4_routed_experts.argtypes = [p, p, i64, i64, p, p, i64, i64, ctypes.c_int, p, p, p, p, p, p, i64,
                                        ctypes.c_float, ctypes.c_int, p, ctypes.c_int, i64]
    lib.dsv4_routed_experts.restype = ctypes.c_int
    lib.dsv4_indexer_scores.argtypes = [p, p, i64, i64, i64, i64, p, i64, i64, ctypes.c_int, p, ctypes.c_int]
    lib.dsv4_indexer_scores.restype = None
    f32 = ctypes.c_float
    lib.dsv4_sparse_attention.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, f32, p, ctypes.c_int, p, p, p, p, p,
                                          p, p, p, p, p, ctypes.c_int]
    lib.dsv4_sparse_attention.restype = ctypes.c_int
    lib.dsv4_compress_blocks.argtypes = [p, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64, p, p, p, p, p, p,
                                         ctypes.c_int]
    lib.dsv4_compress_blocks.restype = None
    lib.dsv4_mhc_sinkhorn.argtypes = [p, i64, i64, f32, i64, p]
    lib.dsv4_mhc_pre_tail.argtypes = [p, ctypes.c_int, i64, i64, i64, p, p, p, f32, f32, p, p, p]
    lib.dsv4_mhc_post.argtypes = [p, p, ctypes.c_int, i64, i64, i64, p, p, p]
    lib.dsv4_mhc_sinkhorn.restype = lib.dsv4_mhc_pre_tail.restype = lib.dsv4_mhc_post.restype = None
    lib.dsv4_rope.argtypes, lib.dsv4_rope.restype = [p, ctypes.c_int, i64, i64, i64, p, p, i64, p], None
    lib.dsv4_quantize_rows.argtypes, lib.dsv4_quantize_rows.restype = [p, ctypes.c_int, i64, i64, f32, p, p], None
    lib.amx = "amx_int8" in cpu and lib.dsv4_amx_enable() == 1
    return lib


@constant_when_traced      # a graph asks it while tracing (`scannable`): a constant there
def available() -> bool:
    return library() is not None


@functools.cache
def avx2_library() -> Path | None:
    """The AVX2 ops, built and loaded: the pair GEMMs (`cpu_pairs.cpp`) `torch.ops.dsv4.expert_pairs_mm` (x int8
    [R, K], rows and group int64 [P], a `pack_pairs` stack -> y fp32 [P, N], y[p] = x[rows[p]] times expert
    group[p]'s weight, pairs sorted by expert) and `torch.ops.dsv4.pairs_linear` (x int8 [M, K], a weight
    packed as a one-expert stack -> fp32 [M, N]); the float GEMM (`cpu_float.cpp`) `torch.ops.dsv4.float_linear`
    (x fp32 [M, K], a `pack_float` weight -> fp32 [M, N]). None where they can't be built or run here."""
    if os.environ.get("DSV4_NATIVE_KERNELS", "1") == "0" or not _cpu_flags().issuperset(AVX2_CPU_FLAGS):
        return None
    from torch.utils import cpp_extension
    lib = Path(torch.__file__).parent / "lib"
    flags = [*AVX2_FLAGS, *(f"-I{p}" for p in cpp_extension.include_paths()),
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    libs = (f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10")
    cxx = _compiler(("c++", "g++", "clang++"), "CXX")
    if not cxx or not (path := _build(cxx, flags, AVX2_SOURCES, libs)):
        return None
    try:
        torch.ops.load_library(str(path))
    except OSError:            # built against another torch than this process runs
        return None
    torch.library.register_fake("dsv4::expert_pairs_mm")(
        lambda x, rows, group, packed: x.new_empty(rows.shape[0], packed.shape[1] * PAIRS_COLS, dtype=torch.float32))
    torch.library.register_fake("dsv4::pairs_linear")(
        lambda x, packed: x.new_empty(x.shape[0], packed.shape[1] * PAIRS_COLS, dtype=torch.float32))
    torch.library.register_fake("dsv4::float_linear")(
        lambda x, packed: x.new_empty(x.shape[0], packed.shape[0] * BLOCK, dtype=torch.float32))
    return path


@constant_when_traced
def avx2_available() -> bool:
    return avx2_library() is not None


def packable(weight: torch.Tensor) -> bool:
    out, k = weight.shape
    return out % BLOCK == 0 and k % 4 == 0 and available()


def float_packable(weight: torch.Tensor, groups: int = 1) -> bool:
    """Whether `float_mm` can read this float weight packed (`groups` projections of their own, each in whole
    blocks): the native kernels', or else the AVX2 op's."""
    return (weight.shape[0] // groups) % BLOCK == 0 and (available() or avx2_available())


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> uint8 [N/32, K/4, 32, 4] holding w + 128."""
    n, k = weight.shape
    # one pass into the new layout, then w + 128 as a flip of the sign bit in place: no full-size
    # temporaries at load (they stayed in the process's heap and raised its peak)
    out = weight_buffer(n // BLOCK, k // 4, BLOCK, 4, dtype=torch.uint8)
    out.copy_(weight.view(torch.uint8).view(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3))
    return out.bitwise_xor_(0x80)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    nb, k4, _, _ = packed.shape
    return (packed.permute(0, 2, 1, 3).reshape(nb * BLOCK, k4 * 4).to(torch.int16) - 128).to(torch.int8)


def pack_float(weight: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """float [N, K] -> [N/32, K, 32] in `dtype`: fp32, or bf16 for a weight whose values are bf16. bf16 for
    the native kernels is [N/32, K, 16, 2]: each k step's channels j and 16 + j side by side (`cpu_gemm.c`);
    the AVX2 op reads [N/32, K, 32]."""
    n, k = weight.shape
    blocks = weight.view(n // BLOCK, BLOCK, k)
    if dtype == torch.bfloat16 and available():
        out = weight_buffer(n // BLOCK, k, BLOCK // 2, 2, dtype=dtype)
        return out.copy_(blocks.view(n // BLOCK, 2, BLOCK // 2, k).permute(0, 3, 2, 1))
    out = weight_buffer(n // BLOCK, k, BLOCK, dtype=dtype)
    return out.copy_(blocks.transpose(1, 2))       # converted and laid out in one pass


def unpack_float(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] back."""
    nb, k = packed.shape[:2]
    if packed.dim() == 4:           # bf16, channels j and 16 + j side by side
        packed = packed.transpose(2, 3).reshape(nb, k, BLOCK)
    return packed.transpose(1, 2).reshape(nb * BLOCK, k).float()


def int8_mm(q: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums of q [M, K] int8 times a `pack_int8` weight, as fp32 [M, N]."""
    q = q.contiguous()
    (m, k), lib = q.shape, library()
    y = torch.empty(m, packed.shape[0] * BLOCK)
    if m == 0:
        return y
    amx = lib.amx and m >= AMX_MIN_ROWS and k % 64 == 0
    lib.dsv4_int8_mm(q.data_ptr(), m, k, packed.data_ptr(), y.shape[1], y.data_ptr(), torch.get_num_threads(), amx)
    return y


def float_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] (as fp32) times a `pack_float` weight, summed in fp32: [M, N]. Without the native kernels,
    the AVX2 op's."""
    if not available():
        avx2_library()          # loaded once: the op's registration
        return torch.ops.dsv4.float_linear(x.float(), packed)
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], packed.shape[0] * BLOCK)
    if x.shape[0] == 0:
        return y
    lib = library()
    gemm = lib.dsv4_bf16_mm if packed.dtype == torch.bfloat16 else lib.dsv4_float_mm
    gemm(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), y.shape[1], y.data_ptr(), torch.get_num_threads())
    return y


class ExpertTable:
    """A MoE layer's experts for one native call (`routed_experts`, `fp4_routed_experts`): their weights' and
    scales' addresses, held with the tensors (which it keeps alive). weights, scales: (w1, w3, w2) per routed
    expert, then the shared expert's with `shared`: W8A8's `pack_int8` weights and channel scales (`format`
    "int8"), or the release's packed FP4 and E8M0 scales ("fp4": routed experts only; its shared expert is
    FP8).

    A table is found again by its first weight (`find`) while it lives: a compiled graph's host-experts
    op gets the experts' tensors, not the table, and building one again at every call would add its cost to
    every step (docs/decisions.md: Routed experts in one native call per layer)."""
    _live: "weakref.WeakValueDictionary[tuple[int, int], ExpertTable]" = weakref.WeakValueDictionary()

    def __init__(self, weights: list[tuple], scales: list[tuple], shared: bool):
        self.format = self.format_of(weights[0][0])
        fp4 = self.format == "fp4"
        weights = [[t.contiguous() for t in ws] for ws in weights]
        scales = [[t.contiguous() if fp4 else t.float().contiguous() for t in ss] for ss in scales]
        self.tensors = (weights, scales)
        array = ctypes.c_void_p * len(weights)
        self.w1, self.w3, self.w2 = (array(*(ws[j].data_ptr() for ws in weights)) for j in range(3))
        self.s1, self.s3, self.s2 = (array(*(ss[j].data_ptr() for ss in scales)) for j in range(3))
        self.routed = len(weights) - shared
        self.shared = shared
        rows, cols = weights[0][0].shape[:2]
        self.inter, self.dim = (rows, 2 * cols) if fp4 else (rows * BLOCK, cols * 4)
        ExpertTable._live[(self.w1[0], self.routed)] = self

    @staticmethod
    def format_of(weight: torch.Tensor) -> str | None:
        """The table format an expert weight is held in, or None where no table reads it."""
        return {torch.uint8: "int8", torch.float4_e2m1fn_x2: "fp4"}.get(weight.dtype)

    @staticmethod
    def find(first: torch.Tensor, routed: int) -> "ExpertTable | None":
        """The live table whose first expert's w1 is `first`, with `routed` routed experts (a live table
        holds its tensors, so no other tensor can have that address meanwhile)."""
        return ExpertTable._live.get((first.data_ptr(), routed))

    @staticmethod
    def usable(weights: list[tuple], scales: list[tuple], shared: bool = False) -> bool:
        """Whether these experts can be run in one call: one format and one shape per projection; int8:
        every weight `pack_int8`-packed, float scales (read as fp32, as the reference reads them); fp4: routed
        experts only, E8M0 scales, widths in groups of 32, on a CPU with the fast kernels."""
        fmt = ExpertTable.format_of(weights[0][0])
        if fmt is None or len({tuple(t.shape for t in ws) for ws in weights}) != 1:
            return False
        if fmt == "fp4":
            return (not shared and lowbit_fast_available()
                    and all(w.dtype == torch.float4_e2m1fn_x2 and w.shape[1] % 16 == 0 for ws in weights for w in ws)
                    and all(s is not None and s.dtype == torch.float8_e8m0fnu for ss in scales for s in ss))
        return (available() and all(w.dtype == torch.uint8 for ws in weights for w in ws)
                and all(s is not None and s.is_floating_point() for ss in scales for s in ss))


def routed_experts(q: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, local: torch.Tensor,
                   table: ExpertTable, limit: float, dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """The routed experts' outputs summed per row, then the shared expert's with `shared` (the table
    must hold it), fp32 [T, dim]. q, xs: the rows quantised per token; weights, local [T, k]: routing
    weights and local expert indices; dtype: the activations' (fp32 or bf16), whose roundings the
    reference's casts make."""
    q, xs = q.contiguous(), xs.float().contiguous()
    weights, local = weights.float().contiguous(), local.to(torch.int64).contiguous()
    y = torch.zeros(q.shape[0], table.dim)
    if q.shape[0] == 0:
        return y
    lib = library()
    ran = lib.dsv4_routed_experts(
        q.data_ptr(), xs.data_ptr(), q.shape[0], table.dim, local.data_ptr(), weights.data_ptr(), local.shape[1],
        table.routed, shared and table.shared, table.w1, table.w3, table.w2, table.s1, table.s3, table.s2,
        table.inter, limit, dtype == torch.bfloat16, y.data_ptr(), torch.get_num_threads(),
        AMX_MIN_ROWS if lib.amx else 0)
    if ran < 0:
        raise MemoryError(f"no memory for the routed experts' scratch ({q.shape[0]} rows)")
    return y


def fp4_routed_experts(x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, table: ExpertTable,
                       limit: float) -> torch.Tensor:
    """A bf16 run's routed FP4 experts (an "fp4" table) in one call: `reference.routed_experts` with each
    projection through `fp4_mm_q8`, the same bits; x [T, dim] bf16, weights and local [T, k] as
    `routed_experts` takes them. Returns fp32 [T, dim]."""
    x = x.bfloat16().contiguous()
    weights, local = weights.float().contiguous(), local.to(torch.int64).contiguous()
    y = torch.zeros(x.shape[0], table.dim)
    if x.shape[0] and _fast(None).dsv4_fp4_routed_experts(
            x.data_ptr(), x.shape[0], table.dim, local.data_ptr(), weights.data_ptr(), local.shape[1], table.routed,
            table.w1, table.w3, table.w2, table.s1, table.s3, table.s2, table.inter, limit, AMAX_FLOOR, y.data_ptr(),
            torch.get_num_threads()) < 0:
        raise MemoryError(f"no memory for the routed experts' scratch ({x.shape[0]} rows)")
    return y


def scannable(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `indexer_scores` takes these: 16 to 64 heads in whole vectors, fp32 or bf16 keys."""
    heads = q.shape[-2]
    return heads % 16 == 0 and heads <= 64 and keys.dtype in (torch.float32, torch.bfloat16) and available()


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`reference.indexer_scores` in one pass over the keys, read in place: q [B,S,H,D], keys [B,T,D],
    weights [B,S,H] -> [B,S,T] fp32. The same sums in another order (within a few fp32 ulps of torch's)."""
    B, S, H, D = q.shape
    T = keys.shape[1]
    if keys.stride(-1) != 1 or keys.stride(1) != D:
        keys = keys.contiguous()
    qt = q.float().transpose(-1, -2).contiguous()          # [B,S,D,H]: a row's heads across the lanes
    w = weights.float().contiguous()
    out = torch.empty(B, S, T)
    if out.numel():
        library().dsv4_indexer_scores(qt.data_ptr(), w.data_ptr(), B, S, H, D, keys.data_ptr(), keys.stride(0), T,
                                      keys.dtype == torch.bfloat16, out.data_ptr(), torch.get_num_threads())
    return out


def attention_fits(q: torch.Tensor, sources) -> bool:
    """Whether `sparse_attention` takes these: fp32 or bf16 queries and rows, dims in whole AVX-512 vectors."""
    floats = (torch.float32, torch.bfloat16)
    return (q.dtype in floats and q.shape[-1] % 16 == 0 and len(sources) <= 8 and available()
            and all(kv.dtype in floats and mask.dtype == torch.bool for kv, mask, _ in sources))


def sparse_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """`reference.sparse_attention` in one pass, every source's rows read in place (an index's rows too, never
    gathered): q [B,S,H,D]; each source (kv [B,N,D], mask broadcasting to [B,S,M], idx [B,S,M] or None). The same
    sums in another order (within a few fp32 ulps of torch's), each query row's alone."""
    B, S, H, D = q.shape
    q = q.contiguous()
    # `keep`: the tensors whose addresses the call gets (copies and expansions among them), alive until it returns
    keep, ptrs = [], {name: [] for name in ("kv", "bf16", "batch", "rows", "mask", "idx", "m", "ms", "is")}
    for kv, mask, idx in sources:
        if kv.stride(-1) != 1 or kv.stride(1) != D:
            kv = kv.contiguous()
        m = kv.shape[1] if idx is None else idx.shape[-1]
        mask = mask.expand(B, S, m)
        if idx is not None:
            idx = idx.long().expand(B, S, m)
        keep += [kv, mask, idx]
        ptrs["kv"].append(kv.data_ptr())
        ptrs["bf16"].append(int(kv.dtype == torch.bfloat16))
        ptrs["batch"].append(kv.stride(0))
        ptrs["rows"].append(kv.shape[1])
        ptrs["mask"].append(mask.data_ptr())
        ptrs["idx"].append(0 if idx is None else idx.data_ptr())
        ptrs["m"].append(m)
        ptrs["ms"] += mask.stride()
        ptrs["is"] += (0, 0, 0) if idx is None else idx.stride()
    n = len(sources)
    arrays = {k: (ctypes.c_int * n if k == "bf16" else ctypes.c_void_p * n if k in ("kv", "mask", "idx")
                  else ctypes.c_int64 * len(v))(*v) for k, v in ptrs.items()}
    sink = sink.float().contiguous()
    out = torch.empty(B, S, H, D)
    if out.numel() and library().dsv4_sparse_attention(
            q.data_ptr(), int(q.dtype == torch.bfloat16), B, S, H, D, scale, sink.data_ptr(), n, arrays["kv"],
            arrays["bf16"], arrays["batch"], arrays["rows"], arrays["mask"], arrays["idx"], arrays["m"], arrays["ms"],
            arrays["is"], out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"no memory for sparse attention's scratch ({B * S} rows)")
    return out.to(q.dtype)


def _rows_apart(t: torch.Tensor) -> torch.Tensor:
    """t [B, N, C] with its rows C apart (a batch stride of its own)."""
    return t if t.stride(-1) == 1 and t.stride(1) == t.shape[-1] else t.contiguous()


def compress_fits(ring_kv, ring_gate, kv, gate, plan) -> bool:
    """Whether `compress_blocks` takes these: fp32 rows, an overlapping block's half of the channels in whole
    AVX-512 vectors, at most 1,024 candidates a block."""
    return (all(t.dtype == torch.float32 for t in (ring_kv, ring_gate, kv, gate)) and kv.shape[-1] % 32 == 0
            and plan.cand_valid.shape[-1] <= 1024 and available())


def compress_blocks(ring_kv, ring_gate, kv, gate, plan, ratio: int) -> torch.Tensor:
    """`reference.compress_blocks` for the blocks a call closes, their candidates read in place (the other slots:
    zeros, as they go to the sink slot): ring_kv, ring_gate [B,R,C], kv, gate [B,S,C] fp32 -> [B,n,C/span]."""
    B, n, c = plan.cand_valid.shape
    C = kv.shape[-1]
    span = c // ratio
    ring_kv, ring_gate, kv, gate = (_rows_apart(t) for t in (ring_kv, ring_gate, kv, gate))
    if ring_kv.stride(0) != ring_gate.stride(0):
        ring_kv, ring_gate = ring_kv.contiguous(), ring_gate.contiguous()
    if kv.stride(0) != gate.stride(0):
        kv, gate = kv.contiguous(), gate.contiguous()
    plan_rows = [t.reshape(B, n * c).contiguous() for t in (plan.from_ring, plan.ring_row, plan.chunk_row,
                                                            plan.cand_valid)]
    closes = plan.closes.contiguous()
    out = torch.empty(B, n, C // span)
    if out.numel():
        library().dsv4_compress_blocks(ring_kv.data_ptr(), ring_gate.data_ptr(), ring_kv.stride(0), kv.data_ptr(),
                                       gate.data_ptr(), kv.stride(0), B, n, c, C, C // span, ratio,
                                       closes.data_ptr(), *(t.data_ptr() for t in plan_rows), out.data_ptr(),
                                       torch.get_num_threads())
    return out


def mhc_fits(h: torch.Tensor) -> bool:
    """Whether the mHC calls (`cpu_mhc.c`) take streams h [..., n, D]: fp32 or bf16, n <= 8, D in whole
    AVX-512 vectors."""
    return h.dtype in (torch.float32, torch.bfloat16) and h.shape[-2] <= 8 and h.shape[-1] % 16 == 0 and available()


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float):
    """`reference.mhc_pre`: its mixing GEMM in torch, the rest in one call."""
    h = h.contiguous()
    *lead, n, D = h.shape
    mix = torch.nn.functional.linear(h.flatten(-2).float(), fn.float())
    x, post, comb = torch.empty(*lead, D), torch.empty(*lead, n), torch.empty(*lead, n, n)
    if x.numel():
        library().dsv4_mhc_pre_tail(h.data_ptr(), h.dtype == torch.bfloat16, x.numel() // D, n, D, mix.data_ptr(),
                                    scale.float().contiguous().data_ptr(), base.float().contiguous().data_ptr(),
                                    norm_eps, hc_eps, x.data_ptr(), post.data_ptr(), comb.data_ptr())
    return x.to(h.dtype), post, comb


def sinkhorn_fits(logits: torch.Tensor) -> bool:
    """Whether `mhc_sinkhorn` takes these comb logits [..., n, n]: fp32, n <= 8 (`cpu_mhc.c`'s MAX_N)."""
    return logits.dtype == torch.float32 and logits.shape[-1] <= 8 and available()


def mhc_sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """`reference.mhc_sinkhorn` in one call: logits [..., n, n] fp32 (n <= 8) -> the same shape."""
    x = logits.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    if out.numel():
        library().dsv4_mhc_sinkhorn(x.data_ptr(), x.numel() // (n * n), n, eps, iters, out.data_ptr())
    return out


def mhc_post(x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`reference.mhc_post` in one call: x [..., D] and res [..., n, D] of one dtype."""
    x, res = x.contiguous(), res.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    *lead, n, D = res.shape
    out = torch.empty(*lead, n, D)
    if out.numel():
        library().dsv4_mhc_post(x.data_ptr(), res.data_ptr(), x.dtype == torch.bfloat16, out.numel() // (n * D), n, D,
                                post.data_ptr(), comb.data_ptr(), out.data_ptr())
    return out.to(x.dtype)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int | None:
    """The heads per table row where `rope` takes x with these tables: x fp32 or bf16 [..., H, D] with cos and
    sin fp32 [..., 1, half] (every head of a row one table row), or x [..., D] with them [..., half]; else None."""
    if (x.dtype not in (torch.float32, torch.bfloat16) or any(t.dtype != torch.float32 for t in (cos, sin))
            or sin.shape != cos.shape or x.dim() != cos.dim() or not available()):
        return None
    if cos.shape[:-1] == x.shape[:-1]:
        return 1
    if x.dim() >= 2 and cos.shape[-2] == 1 and cos.shape[:-2] == x.shape[:-2]:
        return x.shape[-2]
    return None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`reference.rope` in one pass, for the tables `rope_rows` takes."""
    x = x.contiguous()
    half, D = cos.shape[-1], x.shape[-1]
    heads = rope_rows(x, cos, sin)
    rows = x.numel() // (heads * D) if x.numel() else 0
    cos, sin = cos.reshape(rows, half).contiguous(), sin.reshape(rows, half).contiguous()
    out = torch.empty_like(x)
    if rows:
        library().dsv4_rope(x.data_ptr(), x.dtype == torch.bfloat16, rows, heads, D, cos.data_ptr(), sin.data_ptr(),
                            half, out.data_ptr())
    return out


def quantize_fits(x: torch.Tensor) -> bool:
    """Whether `quantize_per_token` takes rows x [..., D]: fp32 or bf16, D in whole AVX-512 vectors."""
    return x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % 16 == 0 and available()


def quantize_per_token(x: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_per_token` in one pass (its bits): x [..., D] -> (int8 [..., D], fp32 scales [..., 1])."""
    x = x.contiguous()
    q, scale = torch.empty(x.shape, dtype=torch.int8), torch.empty(*x.shape[:-1], 1)
    if x.numel():
        library().dsv4_quantize_rows(x.data_ptr(), x.dtype == torch.bfloat16, x.numel() // x.shape[-1], x.shape[-1],
                                     floor, q.data_ptr(), scale.data_ptr())
    return q, scale


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """An int8 expert stack [E, N, K] as the pair GEMMs read it: [E, N/16, K/2, 16, 2]."""
    e, n, k = weight.shape
    out = weight_buffer(e, n // PAIRS_COLS, k // 2, PAIRS_COLS, 2, dtype=weight.dtype)
    return out.copy_(weight.view(e, n // PAIRS_COLS, PAIRS_COLS, k // 2, 2).transpose(2, 3))


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    e, nb, k2 = packed.shape[:3]
    return packed.transpose(2, 3).reshape(e, nb * PAIRS_COLS, k2 * 2)


# ---- the release's FP8 / FP4 weights, read as stored (cpu_lowbit.c) --------------------------------------

LOWBIT_SOURCE = Path(__file__).with_name("cpu_lowbit.c")
# one source, two builds: AVX-512 where the CPU has it, else AVX2 (DSV4_LOWBIT_ISA=avx2 forces it, for tests)
LOWBIT_FLAGS = {"avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mf16c", "-mfma", "-fopenmp", "-shared", "-fPIC"],
                "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]}
LOWBIT_CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "f16c", "fma"), "avx2": ("avx2", "fma", "f16c")}
# the AVX-512 build's fast kernels, where the CPU has these too; they quantise x with cpu_quant.c's quantiser
LOWBIT_FAST_FLAGS = ["-mavx512vl", "-mavx512vnni", "-mavx512bf16"]
LOWBIT_FAST_CPU_FLAGS = ("avx512_vnni", "avx512_bf16", "avx512vl")     # VL: every CPU with the other two has it
QUANT_SOURCE = Path(__file__).with_name("cpu_quant.c")


@functools.cache
def lowbit_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The FP8 and FP4 GEMMs built for `isa` ("avx512" or "avx2"; by default DSV4_LOWBIT_ISA, else the widest this
    CPU runs), or None where they can't be built or run here (`DSV4_NATIVE_KERNELS=0`, no C compiler, a CPU
    without the ISA, not x86-64 Linux). `lowbit_library().isa` says which build it is; `.fast` whether it has
    the fast kernels (the AVX-512 build on a CPU with AVX-512 VNNI and BF16)."""
    cpu, cc = _cpu_flags(), _compiler()
    if os.environ.get("DSV4_NATIVE_KERNELS", "1") == "0" or not cc:
        return None
    isa = isa or os.environ.get("DSV4_LOWBIT_ISA") or next(
        (name for name, flags in LOWBIT_CPU_FLAGS.items() if cpu.issuperset(flags)), None)
    if isa not in LOWBIT_FLAGS or not cpu.issuperset(LOWBIT_CPU_FLAGS[isa]):
        return None
    fast = isa == "avx512" and cpu.issuperset(LOWBIT_FAST_CPU_FLAGS)
    path = (_build(cc, LOWBIT_FLAGS[isa] + LOWBIT_FAST_FLAGS, [LOWBIT_SOURCE, QUANT_SOURCE]) if fast
            else _build(cc, LOWBIT_FLAGS[isa], [LOWBIT_SOURCE]))
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dsv4_fp8_mm.argtypes = [p, i64, i64, p, i64, i64, p, i64, c_int, c_int, p, c_int]
    lib.dsv4_fp4_mm.argtypes = [p, i64, i64, p, i64, i64, p, i64, p, c_int]
    lib.dsv4_fp8_mm.restype = lib.dsv4_fp4_mm.restype = c_int
    if fast:
        lib.dsv4_fp8_mm_bf16.argtypes = [p, i64, i64, p, i64, i64, p, i64, c_int, c_int, p, c_int]
        lib.dsv4_fp4_mm_q8.argtypes = [p, c_int, i64, i64, p, i64, i64, p, i64, ctypes.c_float, p, c_int]
        lib.dsv4_fp8_mm_bf16.restype = lib.dsv4_fp4_mm_q8.restype = c_int
        lib.dsv4_fp8_mm_bf16_groups.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64, c_int, c_int, p, c_int]
        lib.dsv4_fp8_mm_bf16_groups.restype = c_int
        lib.dsv4_fp4_routed_experts.argtypes = [p, i64, i64, p, p, i64, i64, p, p, p, p, p, p, i64, ctypes.c_float,
                                                ctypes.c_float, p, c_int]
        lib.dsv4_fp4_routed_experts.restype = c_int
    lib.isa, lib.fast = isa, fast
    return lib


@constant_when_traced
def lowbit_available() -> bool:
    return lowbit_library() is not None


@constant_when_traced
def lowbit_fast_available() -> bool:
    """Whether `fp4_mm_q8` and `fp8_mm_bf16` run here."""
    return lowbit_library() is not None and lowbit_library().fast


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} inputs where the weight has {k}")
    return x.reshape(math.prod(x.shape[:-1]), k).float().contiguous()


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with contiguous rows, not {tuple(t.shape)} with strides {t.stride()}")


def _fp8_checked(weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int]) -> torch.Tensor:
    """The scale grid as fp32, once the weight, its grid and the offset are what the FP8 kernels read."""
    _check_rows(weight, "weight")
    (n, k), (row0, col0) = weight.shape, offset
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn, not {weight.dtype}")
    if not (0 <= row0 < 128 and 0 <= col0 < 128):
        raise ValueError(f"offset {offset} must lie in [0, 128)")
    grid = (-(-(row0 + n) // 128), -(-(col0 + k) // 128))
    if scale.dim() != 2 or scale.shape[0] < grid[0] or scale.shape[1] < grid[1]:
        raise ValueError(f"scale {tuple(scale.shape)} must cover a grid of {grid} tiles")
    scale = scale.float()
    _check_rows(scale, "scale")
    return scale


def _fp4_checked(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The weight's inputs K, once it and its scales are what the FP4 kernels read."""
    _check_rows(weight, "weight")
    _check_rows(scale, "scale")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if weight.dtype not in (torch.float4_e2m1fn_x2, torch.uint8) or scale.dtype not in (torch.float8_e8m0fnu,
                                                                                        torch.uint8):
        raise ValueError(f"weight must be float4_e2m1fn_x2 and scale float8_e8m0fnu (or their bytes), not "
                         f"{weight.dtype} and {scale.dtype}")
    if k % 32 or tuple(scale.shape) != (n, k // 32):
        raise ValueError(f"a weight of {k} inputs (a multiple of 32) needs scales [{n}, {k // 32}], not "
                         f"{tuple(scale.shape)}")
    return k


def fp8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int] = (0, 0),
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`reference.fp8_linear` in fp32 sums, the weight read in place: x [..., K] (as fp32) times the E4M3 weight
    [N, K] (rows contiguous, any row stride: a column slice too) with its grid of fp32 (or E8M0) tile scales,
    tile (0, 0) starting `offset` = (rows, columns), both in [0, 128), before the weight's first element. Returns
    fp32 [..., N]. lib: a `lowbit_library` build (default: this CPU's)."""
    scale = _fp8_checked(weight, scale, offset)
    (n, k), (row0, col0) = weight.shape, offset
    rows = _rows(x, k)
    y = torch.zeros(rows.shape[0], n) if k == 0 else torch.empty(rows.shape[0], n)
    if y.numel() and k:
        lib = lib or lowbit_library()
        if lib.dsv4_fp8_mm(rows.data_ptr(), rows.shape[0], k, weight.data_ptr(), n, weight.stride(0),
                           scale.data_ptr(), scale.stride(0), row0, col0, y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"no memory for the FP8 GEMM's scratch ({rows.shape[0]} x {k})")
    return y.view(*x.shape[:-1], n)


def fp4_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`reference.fp4_linear` in fp32 sums, the weight read in place: x [..., K] (as fp32) times the packed E2M1
    weight [N, K/2] (float4_e2m1fn_x2 or uint8: low nibble input 2j, high nibble 2j+1; rows contiguous, any row
    stride) with its E8M0 scales [N, K/32] (float8_e8m0fnu or uint8), K a multiple of 32. E8M0's 2^-127 (e = 0)
    is read as 0. Returns fp32 [..., N]. lib: a `lowbit_library` build (default: this CPU's)."""
    n, k = weight.shape[0], _fp4_checked(weight, scale)
    rows = _rows(x, k)
    y = torch.zeros(rows.shape[0], n) if k == 0 else torch.empty(rows.shape[0], n)
    if y.numel() and k:
        lib = lib or lowbit_library()
        if lib.dsv4_fp4_mm(rows.data_ptr(), rows.shape[0], k, weight.data_ptr(), n, weight.stride(0),
                           scale.data_ptr(), scale.stride(0), y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"no memory for the FP4 GEMM's scratch ({rows.shape[0]} x {k})")
    return y.view(*x.shape[:-1], n)


def _fast(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or lowbit_library()
    if lib is None or not lib.fast:
        raise RuntimeError("the fast FP8/FP4 kernels need the AVX-512 build on a CPU with AVX-512 VNNI and BF16")
    return lib


def fp4_mm_q8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`fp4_mm` for a bf16 run: x [..., K] (any float dtype) quantised per row to int8 as W8A8 quantises it (the
    bits of `reference.quantize_per_token`: q, sx), times the FP4 weight in exact int32 sums per group of 32, each
    times its scale into fp32 sums: y = sx * sum_g 2^(e_g - 127) * sum_{k in g} q[k] e2m1[k]. Returns fp32
    [..., N]. lib: a `lowbit_library` build with the fast kernels (default: this CPU's)."""
    n, k = weight.shape[0], _fp4_checked(weight, scale)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} inputs where the weight has {k}")
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    rows = (rows if rows.dtype == torch.bfloat16 else rows.float()).contiguous()     # bf16 read as it is
    y = torch.zeros(rows.shape[0], n) if k == 0 else torch.empty(rows.shape[0], n)
    if y.numel() and k and _fast(lib).dsv4_fp4_mm_q8(
            rows.data_ptr(), rows.dtype == torch.bfloat16, rows.shape[0], k, weight.data_ptr(), n, weight.stride(0),
            scale.data_ptr(), scale.stride(0), AMAX_FLOOR, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"no memory for the FP4 GEMM's scratch ({rows.shape[0]} x {k})")
    return y.view(*x.shape[:-1], n)


def fp8_mm_bf16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int] = (0, 0),
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`fp8_mm` for a bf16 run: x [..., K] as bf16 times the FP8 weight, pairs of products summed in fp32
    (vdpbf16ps) per 128-input tile, times the tile's scale: `reference.fp8_linear(x.bfloat16(), ...)` in fp32 sums,
    but for the weight's E4M3 subnormals (|e4m3| < 2^-6), which count as 0 (vdpbf16ps reads subnormals as 0). x
    below 2^64, and products |x e4m3| from 2^-70 up: smaller ones are lost as fp32 subnormals. Returns fp32
    [..., N]. lib: a `lowbit_library` build with the fast kernels (default: this CPU's)."""
    scale = _fp8_checked(weight, scale, offset)
    (n, k), (row0, col0) = weight.shape, offset
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} inputs where the weight has {k}")
    rows = x.reshape(math.prod(x.shape[:-1]), k).bfloat16().contiguous()
    y = torch.zeros(rows.shape[0], n) if k == 0 else torch.empty(rows.shape[0], n)
    if y.numel() and k and _fast(lib).dsv4_fp8_mm_bf16(
            rows.data_ptr(), rows.shape[0], k, weight.data_ptr(), n, weight.stride(0), scale.data_ptr(),
            scale.stride(0), row0, col0, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"no memory for the FP8 GEMM's scratch ({rows.shape[0]} x {k})")
    return y.view(*x.shape[:-1], n)


def fp8_mm_bf16_groups(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, int],
                       groups: int) -> torch.Tensor:
    """x [..., G, K] through the G projections the FP8 weight's rows hold (attention's wo_a), in one call: group
    g's outputs [..., g, :] are `fp8_mm_bf16`'s for x[..., g, :] and its rows alone. Returns fp32 [..., G, N/G]."""
    scale = _fp8_checked(weight, scale, offset)
    (n, k), (row0, col0) = weight.shape, offset
    if x.shape[-2:] != (groups, k) or n % groups:
        raise ValueError(f"x {tuple(x.shape)} must end in ({groups}, {k}), and {n} rows split into {groups} groups")
    rows = x.reshape(-1, groups, k).bfloat16().contiguous()
    y = torch.empty(rows.shape[0], groups, n // groups)
    if y.numel() and k and _fast(None).dsv4_fp8_mm_bf16_groups(
            rows.data_ptr(), rows.shape[0], groups, k, weight.data_ptr(), n // groups, weight.stride(0),
            scale.data_ptr(), scale.stride(0), row0, col0, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"no memory for the FP8 GEMM's scratch ({rows.shape[0]} x {k})")
    return y.view(*x.shape[:-1], n // groups)
