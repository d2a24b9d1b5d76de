"""SwiGLU, silu(gate) * up, as one generated kernel each way (common/fused.py).

Two layouts: gate and up as two tensors (the dense FFN and the shared expert, whose w1 and w3
are two Linear layers), or as one tensor of alternating (gate, up) pairs (the routed experts'
w13 product, moe/experts.py). The routed experts' form also takes the routing weight p.
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


def _swiglu_math(a, b, p, g=None):
    """The forward (g None) or backward (g the gradient of the output) of silu(a) * b (* p),
    computed in float32 at least (p's dtype when given) and rounded once to a's dtype.
    Backward returns the gradients of a, b and p (None without p)."""
    dtype = a.dtype
    compute = torch.promote_types(dtype, torch.float32) if p is None else p.dtype
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


def _unpack(ab):  # [R, 2 * ffn] -> gate, up [R, ffn] (strided views)
    return ab[:, 0::2], ab[:, 1::2]


def _pack(grad_a, grad_b):  # -> [R, 2 * ffn], pairs alternating as in ab
    return torch.stack((grad_a, grad_b), -1).flatten(-2)


# one function per call pattern: torch.compile keeps its cache per function, so calls with and
# without p through one function would count as a recompile
def _swiglu_forward(a, b):
    return _swiglu_math(a, b, None)


def _swiglu_backward(g, a, b):
    return _swiglu_math(a, b, None, g)[:2]


def _pairs_forward(ab):
    return _swiglu_math(*_unpack(ab), None)


def _pairs_backward(g, ab):
    return _pack(*_swiglu_math(*_unpack(ab), None, g)[:2])


def _pairs_prob_forward(ab, p):
    return _swiglu_math(*_unpack(ab), p)


def _pairs_prob_backward(g, ab, p):
    grad_a, grad_b, grad_p = _swiglu_math(*_unpack(ab), p, g)
    return _pack(grad_a, grad_b), grad_p


def swiglu_pairs_forward(ab: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """swiglu_pairs without autograd, on rows: ab [R, 2 * ffn], p [R, 1] float32 or None."""
    return fused(_pairs_forward)(ab) if p is None else fused(_pairs_prob_forward)(ab, p)


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
        return swiglu_pairs_forward(ab, p)

    @staticmethod
    def backward(ctx, grad):
        ab, p = ctx.saved_tensors
        if p is None:
            return fused(_pairs_backward)(grad.contiguous(), ab), None
        return fused(_pairs_prob_backward)(grad.contiguous(), ab, p)
