"""Triton kernels of the FP8 experts' quantization (moe/fp8.py), CUDA only.

quantize_rows: t [..., K] contiguous -> q [..., K] float8_e4m3fn, s [...] fp32, one scale per
row (amax over K / 448). One program per row: the amax pass reads the row, the second pass
reads it again (from L2) and writes q.
quantize_columns: w [E, N, K] contiguous -> (q [E, K, N], s [E, K]): the rowwise
quantization of w.transpose(1, 2), one scale per (expert, column k) over N, written in the
transposed layout. One program per (expert, block of columns): tiles [BLOCK_N, BLOCK_K] read
along K, stored transposed.
"""

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _rows_kernel(t_ptr, q_ptr, s_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    base = row * n_cols
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        v = tl.load(t_ptr + base + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, 0), 1e-12) / FP8_MAX
    tl.store(s_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        v = tl.load(t_ptr + base + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(v / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + base + start + cols, q.to(tl.float8e4nv), mask=mask)


@triton.jit
def _columns_kernel(w_ptr, q_ptr, s_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.arange(0, BLOCK_N)
    w_base = w_ptr + e * N * K
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        mask = ((start + n)[:, None] < N) & (k[None, :] < K)
        v = tl.load(w_base + (start + n)[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), 0))
    scale = tl.maximum(amax, 1e-12) / FP8_MAX
    tl.store(s_ptr + e * K + k, scale, mask=k < K)
    q_base = q_ptr + e * K * N
    for start in range(0, N, BLOCK_N):
        mask = ((start + n)[:, None] < N) & (k[None, :] < K)
        v = tl.load(w_base + (start + n)[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(v / scale[None, :], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        tl.store(q_base + k[:, None] * N + (start + n)[None, :], tl.trans(q), mask=tl.trans(mask))


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = t.shape[-1]
    q = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device)
    s = torch.empty(t.shape[:-1], dtype=torch.float32, device=t.device)
    rows = t.numel() // max(k, 1)
    if rows:
        _rows_kernel[(rows,)](t, q, s, k, BLOCK=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q, s


def quantize_columns(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    q = torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(e, k, dtype=torch.float32, device=w.device)
    block_k = 64
    _columns_kernel[(e, triton.cdiv(k, block_k))](w, q, s, n, k, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)
    return q, s
