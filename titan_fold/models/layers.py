"""Pieces the model files share: weight initialization and the rotary embedding."""

import torch
from torch import nn

from titan_fold.common.fused import fused


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


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """apply_rope of q and k ([b, s, heads, head_dim] each, their own head counts). Op by op
    that is a cast, a concatenation and fp32 products per tensor, each through memory; on
    plain tensors outside torch.compile (which fuses apply_rope itself) forward and backward
    are each one fused() call over both."""
    if (torch.compiler.is_compiling() or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or cos.requires_grad or sin.requires_grad):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return _RopeQK.apply(q, k, cos, sin)


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return fused(_rope_qk)(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        return *fused(_rope_qk_backward)(grad_q, grad_k, cos, sin), None, None


def _rope_qk(q, k, cos, sin):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _rope_qk_backward(grad_q, grad_k, cos, sin):
    return _rope_backward(grad_q, cos, sin), _rope_backward(grad_k, cos, sin)


def _rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of apply_rope's input from its output's: the transposed rotation, in fp32."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    gf = grad.float()
    g1, g2 = (gf * sin).chunk(2, dim=-1)
    return (gf * cos + torch.cat([g2, -g1], dim=-1)).type_as(grad)
