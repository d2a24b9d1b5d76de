"""Routed experts as stacked weights, one grouped GEMM for all (local) experts.

Under expert parallelism the module holds only its shard: E/ep experts, ffn/etp of each
expert's width (w1, w3 sliced on their ffn rows, w2 on its ffn columns). SwiGLU is
elementwise over ffn, so each etp rank computes a partial w2 product that the
dispatcher sums (reduce-scatter). The weights may be plain tensors or DTensors.
"""

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_fold.common.fused import fused
from titan_fold.common.tensors import cast, local
from titan_fold.moe.fp8 import fp8_grouped_linear
from titan_fold.moe.quack import Gather, down_projection, offsets, up_projection, use_quack
from titan_fold.moe.wgrad import flush_at_input, split_grouped_linear


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The experts' dtype for rows x: autocast does not cover grouped GEMMs, so they cast
    rows and weights as it would a matmul."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _grouped_mm_ok(x: torch.Tensor, ffn_dim: int) -> bool:
    # CPU eager takes fp32 and bf16; compiled graphs, fake tensors (the dry run's step) and
    # CUDA take bf16 (the meta kernel's rule); rows must be 16-byte aligned
    if not hasattr(torch, "_grouped_mm") or (x.shape[-1] * x.element_size()) % 16 or (ffn_dim * x.element_size()) % 16:
        return False
    if x.dtype == torch.bfloat16:
        return True
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and not is_fake(x))


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, num_experts: int, fp8: bool = False, grouped_gemm: str = "auto"):
        super().__init__()
        self.fp8 = fp8  # forward and input-gradient GEMMs in FP8 (moe/fp8.py)
        self.grouped_gemm = grouped_gemm  # "torch" | "quack" | "auto" (moe/quack.py)
        # a WgradQueue: weight gradients computed apart from input gradients (moe/wgrad.py)
        self.wgrad = None
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))

    def fuses_gather(self, x: torch.Tensor) -> bool:
        """Whether forward() reads the routed rows from the tokens x (in the experts' dtype) in place."""
        return self.wgrad is None and not self.fp8 and use_quack(self.grouped_gemm, x, local(self.w1).shape[1])

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor | int, probs: torch.Tensor, prob_before_w2: bool,
        gather: Gather | None = None,
    ) -> torch.Tensor:
        """x [R, dim] rows grouped by local expert; probs [R] routing weight of each row.
        With gather (only where fuses_gather(x)): x [T, dim] tokens, row i reads x[gather.rows[i]].

        counts: [E_local] int tensor of rows per expert, summing to at most R, or an int C
        meaning R = E_local * C (padded, static shapes: batched GEMM). Rows past the last
        group are padding, never computed: torch._grouped_mm and QuACK leave their outputs
        and input gradients uninitialized, so a caller that passes such rows masks both
        (the dispatcher's static exchange).
        Returns [R, dim], already multiplied by probs. With etp > 1 it is a partial sum.
        """
        dtype = compute_dtype(x)
        x = x.to(dtype)
        w1, w2, w3 = (local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        p = probs.unsqueeze(-1)  # [R, 1], float32 (the router's)
        if self.wgrad is not None:
            return _swiglu_split_wgrad(self, x, counts, w1, w2, w3, p, prob_before_w2)
        if self.fp8:
            if isinstance(counts, int):
                counts = torch.full((w1.shape[0],), counts, device=x.device)
            return _swiglu_grouped(x, counts, w1, w2, w3, p, prob_before_w2, fp8_grouped_linear)
        if isinstance(counts, int):
            y = _swiglu_padded(x.view(w1.shape[0], counts, -1), w1, w2, w3, p.view(w1.shape[0], counts, 1), prob_before_w2)
            return y.flatten(0, 1)
        if gather is not None or use_quack(self.grouped_gemm, x, w1.shape[1]):
            offs = offsets(counts)
            a, b = up_projection(x, offs, w1, w3, gather)  # [R, ffn]
            return _apply(a, b, p, lambda h: down_projection(h, offs, w2), prob_before_w2)
        if _grouped_mm_ok(x, w1.shape[1]):
            return _swiglu_grouped(x, counts, w1, w2, w3, p, prob_before_w2)
        return _swiglu_loop(x, counts, w1, w2, w3, p, prob_before_w2)

    @torch.no_grad()
    def init_weights(self, init_std: float):
        for w in (self.w1, self.w2, self.w3):
            if isinstance(w, DTensor):
                # draw the full tensor and keep our slice: the same values as a one-rank
                # init whatever the (ep, etp) layout
                full = torch.empty(w.shape, dtype=w.dtype, device=w.to_local().device)
                nn.init.trunc_normal_(full, mean=0.0, std=init_std)
                w.to_local().copy_(distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None).to_local())
            else:
                nn.init.trunc_normal_(w, mean=0.0, std=init_std)


def _apply(a, b, p, y_fn, prob_before_w2):
    """a = x @ w1.T, b = x @ w3.T [R, ffn]; p [R, 1] -> y_fn(h) with h = silu(a) * b, the
    probability applied before w2 (the router's gradient then needs only a and b, saved
    anyway) or after it."""
    if prob_before_w2:
        return y_fn(swiglu(a, b, p))
    return y_fn(swiglu(a, b)) * p.to(a.dtype)


def swiglu(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a) * b, times the routing weight p [..., 1] when given: a, b [..., ffn] -> [..., ffn]
    in a's dtype. One pass over [R, ffn] each way instead of silu, the products and their
    backwards (five passes in eager), and only a, b (and p) saved for backward."""
    def rows(t):  # [R, ffn]: R is the one size the fused kernels take as dynamic
        return None if t is None else t.reshape(-1, t.shape[-1])

    return _SwiGLU.apply(rows(a), rows(b), rows(p)).view(a.shape)


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


# one function per call pattern: torch.compile keeps its cache per function, so calls with and
# without p through one function would count as a recompile
def _swiglu_forward(a, b):
    return _swiglu_math(a, b, None)


def _swiglu_backward(g, a, b):
    return _swiglu_math(a, b, None, g)[:2]


def _swiglu_prob_forward(a, b, p):
    return _swiglu_math(a, b, p)


def _swiglu_prob_backward(g, a, b, p):
    return _swiglu_math(a, b, p, g)


class _SwiGLU(torch.autograd.Function):
    """swiglu() on rows: a, b [R, ffn], p [R, 1] or None; each way one generated kernel on CUDA."""

    @staticmethod
    def forward(ctx, a, b, p):
        if p is None:
            ctx.save_for_backward(a, b)
            return fused(_swiglu_forward)(a, b)
        p = p.to(torch.promote_types(p.dtype, torch.float32))
        ctx.save_for_backward(a, b, p)
        return fused(_swiglu_prob_forward)(a, b, p)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        if len(saved) == 2:
            return *fused(_swiglu_backward)(grad.contiguous(), *saved), None
        return fused(_swiglu_prob_backward)(grad.contiguous(), *saved)


def _swiglu_padded(x, w1, w2, w3, p, prob_before_w2):
    # x [E, C, dim], p [E, C, 1]
    a, b = torch.bmm(x, w1.transpose(1, 2)), torch.bmm(x, w3.transpose(1, 2))  # [E, C, ffn]
    return _apply(a, b, p, lambda h: torch.bmm(h, w2.transpose(1, 2)), prob_before_w2)  # [E, C, dim]


def _bf16_grouped_linear(x, w, offs):
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def _swiglu_grouped(x, counts, w1, w2, w3, p, prob_before_w2, linear=_bf16_grouped_linear):
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert
    a = linear(x, w1, offs)  # [R, ffn]
    b = linear(x, w3, offs)
    return _apply(a, b, p, lambda h: linear(h, w2, offs), prob_before_w2)


def _swiglu_split_wgrad(experts, x, counts, w1, w2, w3, p, prob_before_w2):
    if isinstance(counts, int):  # padded: groups of C rows
        counts = torch.full((w1.shape[0],), counts, device=x.device)
    if isinstance(experts, FSDPModule):
        # FSDP2 reduce-scatters the unit's gradients when they reach its input
        x, p = flush_at_input(x, experts.wgrad), flush_at_input(p, experts.wgrad)
    quack = not experts.fp8 and use_quack(experts.grouped_gemm, x, w1.shape[1])
    return _swiglu_grouped(x, counts, w1, w2, w3, p, prob_before_w2,
                           split_grouped_linear(experts.wgrad, experts.fp8, quack))


def _swiglu_loop(x, counts, w1, w2, w3, p, prob_before_w2):
    # fallback (float64 tests, no _grouped_mm): one GEMM chain per expert
    sizes = counts.tolist()
    padding = x.shape[0] - sum(sizes)  # rows past the last group: zeros, not computed
    xs, ps = x.split(sizes + [padding]), p.split(sizes + [padding])
    ys = [_apply(xs[e] @ w1[e].T, xs[e] @ w3[e].T, ps[e], lambda h: h @ w2[e].T, prob_before_w2)  # [n_e, dim]
          for e in range(len(sizes))]
    return torch.cat(ys + [x.new_zeros(padding, w2.shape[1])])
