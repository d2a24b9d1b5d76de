"""Multi-head latent attention (DeepSeek-V2/V3) and YaRN RoPE tables.

    q        = wq(x)                      or  wq_b(q_a_norm(wq_a(x)))       [b, s, heads, nope + rope]
    k_nope,v = wkv_b(kv_a_norm(wkv_a(x)))                                   [b, s, heads, nope | v_dim]
    k_rope   = wk_rope(x)                 one rope part shared by every head [b, s, 1, rope]
    out      = wo(softmax(q k^T * scale + causal) v)

Keys and values are built from a small latent (kv_lora_rank) and a decoupled rotary part
(qk_rope_head_dim) that every head shares; only the rotary parts of q and k see RoPE. HF's
fused kv_a_proj_with_mqa is kept as two linears here, wkv_a (the latent rows) and wk_rope
(the rotary rows): their gradients differ under tensor parallelism (the latent feeds the
head-sharded wkv_b; the rotary part is summed over this rank's heads only), so the placement
plan gives them different styles (parallel/placement.py). DeepSeek stores the rotary dims
as interleaved pairs (x0, x1), (x2, x3), ...: `rope_interleave` reorders them to the
half-split layout `apply_rope` rotates (evens, then odds), as transformers does, for q and k
alike, so scores are unchanged.

The softmax scale is qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 under
YaRN; q is multiplied by scale * sqrt(qk_head_dim) so that the inner attention (SDPA, or the
context-parallel one) keeps its default 1/sqrt(head_dim).
"""

import math

import torch
from torch import nn

from titan_fold.models.documents import DocumentMask
from titan_fold.models.layers import apply_rope_qk, trunc_normal_
from titan_fold.models.transformer import CausalSelfAttention

# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_max_seq_len: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
    device=None,
) -> torch.Tensor:
    """YaRN's blend of interpolated (low-frequency) and original (high-frequency) inverse
    frequencies [dim / 2], with a linear ramp between the dims that turn beta_fast and
    beta_slow times over the original context."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    freq = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency
    return (1.0 / (factor * freq)) * (1 - extrapolation) + (1.0 / freq) * extrapolation


def yarn_cos_sin(args, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, qk_rope_head_dim] (half-split layout), float32, of a
    DeepSeekV3Args with rope_type "default" or "yarn"; YaRN scales both by its attention factor."""
    dim = args.qk_rope_head_dim
    if args.rope_type == "yarn":
        inv_freq = yarn_inv_freq(
            dim,
            args.rope_theta,
            args.rope_factor,
            args.original_max_seq_len,
            args.beta_fast,
            args.beta_slow,
            args.rope_truncate,
            device,
        )
        attention_factor = args.yarn_attention_factor()
    else:
        inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        attention_factor = 1.0
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    # pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the half-split layout
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.interleaved = args.rope_interleave
        heads = args.n_heads
        # the query's projection: one matrix, or (q_lora_rank) down to a latent and up
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_a_norm: nn.RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank is None:
            self.wq = nn.Linear(args.dim, heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank, bias=False)
        self.wk_rope = nn.Linear(args.dim, self.rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        # the inner attention applies 1/sqrt(qk_head_dim); q carries the rest of the scale
        self.q_scale = args.softmax_scale() * math.sqrt(self.qk_head_dim)
        self.inner_attention = CausalSelfAttention()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            assert self.wq_a is not None and self.q_a_norm is not None and self.wq_b is not None  # q_lora_rank
            q = self.wq_b(self.q_a_norm(self.wq_a(x)))
        # -1: the heads this rank holds (all of them without tensor parallelism)
        q = q.view(b, s, -1, self.qk_head_dim)  # [b, s, heads, nope + rope]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(self.wkv_a(x))).view(b, s, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [b, s, heads, nope], [b, s, heads, v_dim]
        k_rope = self.wk_rope(x).view(b, s, 1, self.rope_dim)  # [b, s, 1, rope]
        if self.interleaved:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = apply_rope_qk(q_rope, k_rope, cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1) * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # [b, s, heads, nope + rope]
        out = self.inner_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask
        )  # [b, heads, s, v_dim]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def init_weights(self, init_std: float, out_std: float):
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wk_rope, self.wkv_b):
            if linear is not None:
                trunc_normal_(linear.weight, init_std)
        trunc_normal_(self.wo.weight, out_std)
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                norm.reset_parameters()
