"""Pieces the model files share: weight initialization and the rotary embedding."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_fold.common.fused import fused
from titan_fold.compat.ops import has_hooks


def trunc_normal_(weight: torch.Tensor, std: float):
    # truncated at 3 standard deviations: no rare huge weights at start
    nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std)


def rope_cos_sin(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, [max_seq_len, head_dim], float32.

    Half-split layout (HF Qwen2 / Mixtral): dimension i pairs with i + head_dim/2, so
    checkpoints converted from HF need no permutation of wq / wk.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # [max_seq_len, head_dim]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [b, s, heads, head_dim]; cos, sin [s, head_dim] or [b, s, head_dim]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    xf = x.float()  # rotate in float32: bf16 angles lose precision at long positions
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


def apply_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: nn.RMSNorm | None = None,
    k_norm: nn.RMSNorm | None = None,
):
    """apply_rope of q and k ([b, s, heads, head_dim] each, their own head counts), after
    q_norm and k_norm where given (Qwen3: one RMSNorm over head_dim for every query head, one
    for every key head). Op by op that is a cast, a concatenation and fp32 products per tensor,
    and the norms' own passes, each through memory; on plain tensors outside torch.compile
    (which fuses these itself) forward and backward are each one fused() call over both."""
    norms: tuple[nn.RMSNorm, ...] = ()
    if q_norm is not None:
        assert k_norm is not None, "q_norm and k_norm come together"
        norms = (q_norm, k_norm)
    if (
        torch.compiler.is_compiling()
        or type(q) is not torch.Tensor
        or type(k) is not torch.Tensor
        or cos.requires_grad
        or sin.requires_grad
        or any(
            type(norm) is not nn.RMSNorm or norm.weight is None or isinstance(norm.weight, DTensor) or _hooked(norm)
            for norm in norms
        )
    ):
        if norms:
            q, k = norms[0](q), norms[1](k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if not norms:
        return _RopeQK.apply(q, k, cos, sin)
    eps = [torch.finfo(q.dtype).eps if norm.eps is None else norm.eps for norm in norms]
    return _NormRopeQK.apply(q, k, norms[0].weight, norms[1].weight, cos, sin, *eps)


def _hooked(module: nn.Module) -> bool:
    """Whether a call of module runs hooks registered on it (a parallel plan's, a dry run's): it
    is then called, not bypassed by reading its weight."""
    return has_hooks(module)


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return fused(_rope_qk)(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        return *fused(_rope_qk_backward)(grad_q, grad_k, cos, sin), None, None


class _NormRopeQK(torch.autograd.Function):
    """RMSNorm then RoPE of q and k; saves what the norms alone would (q, k, their weights)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, q_eps: float, k_eps: float):
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps = q_eps, k_eps
        return fused(_norm_rope_qk)(q, k, q_weight, k_weight, cos, sin, *ctx.eps)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        grads = fused(_norm_rope_qk_backward)(grad_q, grad_k, *ctx.saved_tensors, *ctx.eps)
        return *grads, None, None, None, None


def _rope_qk(q, k, cos, sin):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _rope_qk_backward(grad_q, grad_k, cos, sin):
    return _rope_backward(grad_q, cos, sin), _rope_backward(grad_k, cos, sin)


def _norm_rope_qk(q, k, q_weight, k_weight, cos, sin, q_eps: float, k_eps: float):
    q = F.rms_norm(q, q.shape[-1:], q_weight, q_eps)
    k = F.rms_norm(k, k.shape[-1:], k_weight, k_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _norm_rope_qk_backward(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, q_eps: float, k_eps: float):
    """-> the gradients of q, k, q_weight, k_weight."""
    grad_q, grad_q_weight = _rms_norm_backward(_rope_backward(grad_q, cos, sin), q, q_weight, q_eps)
    grad_k, grad_k_weight = _rms_norm_backward(_rope_backward(grad_k, cos, sin), k, k_weight, k_eps)
    return grad_q, grad_k, grad_q_weight, grad_k_weight


def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The gradients of x [..., d] and weight [d] of F.rms_norm(x, (d,), weight, eps) from its
    output's, in fp32: with x^ = x / rms(x), dx = (g - x^ mean(g x^)) / rms(x) for g = grad * weight."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * rstd
    grad = grad.float()
    g = grad * weight.float()
    grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    grad_weight = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.type_as(x), grad_weight.type_as(weight)


def _rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of apply_rope's input from its output's: the transposed rotation, in fp32."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    gf = grad.float()
    g1, g2 = (gf * sin).chunk(2, dim=-1)
    return (gf * cos + torch.cat([g2, -g1], dim=-1)).type_as(grad)


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight is the scale's offset from 1: x / rms(x) * (1 + weight), in float32
    (Qwen3-Next's and Qwen3.5's norms; weight decay pulls the scale towards 1, not 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
