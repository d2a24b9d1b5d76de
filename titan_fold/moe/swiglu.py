"""SwiGLU, silu(gate) * up, as one generated kernel each way (common/fused.py).

Two layouts: gate and up as two tensors (the dense FFN and the shared expert, whose w1 and w3
are two Linear layers), or as one tensor of alternating (gate, up) pairs (the routed experts'
w13 product, moe/experts.py). The routed experts' form also takes the routing weight p, and
reads and writes bf16 pairs as one 32-bit word each.
"""

import torch

from titan_fold.common.fused import fused
from titan_fold.common.tensors import cast


def _rows(t):  # [R, n]: R is the one size the fused kernels take as dynamic
    return None if t is None else t.reshape(-1, t.shape[-1])


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b: a, b [..., ffn] -> [..., ffn] in a's dtype (the dense FFN and the shared
    expert). One pass over [R, ffn] each way instead of silu, the product and their backwards
    (five passes in eager), and only a and b saved for backward."""
    return _SwiGLU.apply(_rows(a), _rows(b)).view(a.shape)


def swiglu_pairs(ab: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' SwiGLU: ab [..., 2 * ffn] (gate, up) pairs -> silu(gate) * up [...,
    ffn] in ab's dtype, times the routing weight p [..., 1] when given. Its backward writes
    the pairs' gradient as one [..., 2 * ffn] tensor, the operand of the one input-gradient
    and one weight-gradient GEMM of w13."""
    out = _SwiGLUPairs.apply(_rows(ab), _rows(p))
    return out.view(*ab.shape[:-1], ab.shape[-1] // 2)


def _swiglu_math(a, b, p, g=None, dtype=None):
    """The forward (g None) or backward (g the gradient of the output) of silu(a) * b (* p),
    computed in float32 at least (p's dtype when given) and rounded once to dtype (a's when
    None). Backward returns the gradients of a, b and p (None without p)."""
    dtype = a.dtype if dtype is None else dtype
    compute = torch.promote_types(a.dtype, torch.float32) if p is None else p.dtype
    a, b = a.to(compute), b.to(compute)
    sig = torch.sigmoid(a)
    silu = a * sig
    if g is None:
        h = silu * b
        return cast(h if p is None else h * p, dtype)
    g = g.to(compute)
    gh = g if p is None else g * p
    grad_a = gh * b * sig * (1 + a * (1 - sig))
    grad_p = None if p is None else (g * silu * b).sum(-1, keepdim=True)
    return cast(grad_a, dtype), cast(gh * silu, dtype), grad_p


# bf16 pairs go to the kernels as one int32 each: one aligned 4-byte load or store per pair,
# where the two halves' strided 2-byte accesses ran the routed experts' SwiGLU at half the
# speed (docs/benchmarks.md). x86, Arm and CUDA memory is little-endian, so the gate (the even
# element) is a word's low half; a bf16's bits are the high half of its float32's.
def _as_bits(ab):  # [R, 2 * ffn] -> what the pair kernels take: [R, ffn] int32 for bf16
    return ab.contiguous().view(torch.int32) if ab.dtype == torch.bfloat16 else ab


def _unpack(ab):  # -> gate, up [R, ffn] and the dtype of the pairs
    if ab.dtype == torch.int32:
        return (ab << 16).view(torch.float32), (ab & -65536).view(torch.float32), torch.bfloat16
    return ab[:, 0::2], ab[:, 1::2], ab.dtype


def _pack(grad_a, grad_b, words):  # -> the pairs' gradient, as words where the pairs came as words
    if words:
        low = grad_a.view(torch.int16).to(torch.int32) & 0xFFFF
        return low | (grad_b.view(torch.int16).to(torch.int32) << 16)
    return torch.stack((grad_a, grad_b), -1).flatten(-2)


def _from_bits(t):  # _pack's result -> [R, 2 * ffn]
    return t.view(torch.bfloat16) if t.dtype == torch.int32 else t


# one function per call pattern: torch.compile keeps its cache per function, so calls with and
# without p through one function would count as a recompile
def _swiglu_forward(a, b):
    return _swiglu_math(a, b, None)


def _swiglu_backward(g, a, b):
    return _swiglu_math(a, b, None, g)[:2]


def _pairs_forward(ab):
    a, b, dtype = _unpack(ab)
    return _swiglu_math(a, b, None, dtype=dtype)


def _pairs_backward(g, ab):
    a, b, dtype = _unpack(ab)
    grad_a, grad_b, _ = _swiglu_math(a, b, None, g, dtype)
    return _pack(grad_a, grad_b, ab.dtype == torch.int32)


def _pairs_prob_forward(ab, p):
    a, b, dtype = _unpack(ab)
    return _swiglu_math(a, b, p, dtype=dtype)


def _pairs_prob_backward(g, ab, p):
    a, b, dtype = _unpack(ab)
    grad_a, grad_b, grad_p = _swiglu_math(a, b, p, g, dtype)
    return _pack(grad_a, grad_b, ab.dtype == torch.int32), grad_p


class _SwiGLU(torch.autograd.Function):
    """swiglu() on rows: a, b [R, ffn]; each way one generated kernel on CUDA."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return fused(_swiglu_forward)(a, b)

    @staticmethod
    def backward(ctx, grad):
        return fused(_swiglu_backward)(grad.contiguous(), *ctx.saved_tensors)


class _SwiGLUPairs(torch.autograd.Function):
    """swiglu_pairs() on rows: ab [R, 2 * ffn], p [R, 1] or None; each way one generated kernel on CUDA."""

    @staticmethod
    def forward(ctx, ab, p):
        if p is not None:
            p = p.to(torch.promote_types(p.dtype, torch.float32))
        ctx.save_for_backward(ab, p)
        bits = _as_bits(ab)
        return fused(_pairs_forward)(bits) if p is None else fused(_pairs_prob_forward)(bits, p)

    @staticmethod
    def backward(ctx, grad):
        ab, p = ctx.saved_tensors
        ab = _as_bits(ab)
        if p is None:
            return _from_bits(fused(_pairs_backward)(grad.contiguous(), ab)), None
        grad_ab, grad_p = fused(_pairs_prob_backward)(grad.contiguous(), ab, p)
        return _from_bits(grad_ab), grad_p
