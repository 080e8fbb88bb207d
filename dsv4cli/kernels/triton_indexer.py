"""The lightning indexer's scan as one Triton kernel, for CUDA: score[t] = sum_h w[h] relu(q_h . k_t).

torch's scan (`reference.indexer_scores_bmm`) writes every query row's [heads x keys] products to
memory and reads them back for the relu and the weighted sum: with bf16 keys and fp32 products that
traffic is several times the keys' own bytes, where the scan should cost one read of the keys. Here a
program takes one query row and a tile of keys: the products come from one `tl.dot` (tensor cores
for bf16 / fp16, exact fp32 otherwise), stay in registers through the relu and the weighted sum,
and only the tile's scores are written. Under TRITON_INTERPRET=1 the kernel runs on the CPU, which
is how the tests check it.
"""
import torch
import triton
import triton.language as tl

KEYS_PER_TILE = 64
HALF = (torch.bfloat16, torch.float16)


@triton.jit
def _scan(q_ptr, k_ptr, w_ptr, out_ptr, S, T, stride_kb, stride_kt, H: tl.constexpr, D: tl.constexpr,
          HEADS: tl.constexpr, KEYS: tl.constexpr, FP32: tl.constexpr):
    row = tl.program_id(0)                       # b * S + s
    h = tl.arange(0, HEADS)                      # heads padded to a dot's minimum (16) with zero rows
    d = tl.arange(0, D)
    t = tl.program_id(1) * KEYS + tl.arange(0, KEYS)
    q = tl.load(q_ptr + row * H * D + h[:, None] * D + d[None, :], mask=h[:, None] < H, other=0.0)
    keys = k_ptr + (row // S).to(tl.int64) * stride_kb
    k = tl.load(keys + t[None, :].to(tl.int64) * stride_kt + d[:, None], mask=t[None, :] < T, other=0.0)
    if FP32:     # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        dots = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        dots = tl.dot(q, k)                      # bf16 / fp16 products are exact in the fp32 accumulator
    w = tl.load(w_ptr + row * H + h, mask=h < H, other=0.0)
    tl.store(out_ptr + row * T + t, tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0), mask=t < T)


def fits(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the kernel takes these: a power-of-two head dim of at least 16, up to 128 heads, float inputs."""
    D = q.shape[-1]
    return (D >= 16 and D & (D - 1) == 0 and q.shape[-2] <= 128
            and q.dtype in (torch.float32, *HALF) and keys.dtype in (torch.float32, *HALF))


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [B,S,H,D], keys [B,T,D] (read in place), weights [B,S,H] -> [B,S,T] fp32. Half-precision q and
    keys of one dtype multiply on tensor cores; anything else in fp32 (no TF32)."""
    B, S, H, D = q.shape
    T = keys.shape[1]
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    q, w = q.contiguous(), weights.float().contiguous()
    out = torch.empty(B, S, T, device=q.device, dtype=torch.float32)
    if out.numel():
        fp32 = not (q.dtype in HALF and keys.dtype == q.dtype)
        _scan[(B * S, triton.cdiv(T, KEYS_PER_TILE))](
            q, keys, w, out, S, T, keys.stride(0), keys.stride(1), H=H, D=D,
            HEADS=max(16, triton.next_power_of_2(H)), KEYS=KEYS_PER_TILE, FP32=fp32)
    return out
