"""Pieces the model files share: weight initialization and the rotary embedding."""

import torch
from torch import nn


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
