"""The routed experts' activation: one object every expert path takes (moe/experts.py).

    ab = x @ w13.T (+ w13_bias)          [R, 2 * ffn]  (gate, up) pairs, alternating
    h  = act(gate, up) (* p)             [R, ffn]
    y  = h @ w2.T (+ w2_bias (* p))      [R, dim]

Two activations:
- "swiglu": silu(gate) * up (Qwen, Mixtral, DeepSeek), moe/swiglu.py's fused kernels;
- "clamped_swiglu" (GPT-OSS): gate clamped above at `limit`, up to [-limit, limit], then
  gate * sigmoid(alpha * gate) * (up + 1). transformers' GptOssExperts reads its gate_up_proj
  columns as pairs too (gate = [..., ::2], up = [..., 1::2]), so w13 takes them in order.

A fast path that cannot carry an activation says why (`ExpertActivation.quack_problem`);
GroupedExperts then runs torch's grouped GEMMs, or refuses where QuACK was asked for by name.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from titan_fold.common.tensors import cast
from titan_fold.moe.swiglu import swiglu_pairs

ActivationName = Literal["swiglu", "clamped_swiglu"]


@dataclass(frozen=True)
class ExpertActivation:
    name: ActivationName = "swiglu"
    alpha: float = 1.702  # clamped_swiglu: the sigmoid's gain
    limit: float = 7.0  # clamped_swiglu: gate <= limit, -limit <= up <= limit

    def pairs(self, ab: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        """ab [..., 2 * ffn] (gate, up) pairs -> h [..., ffn] in ab's dtype, times p [..., 1] when given."""
        if self.name == "swiglu":
            return swiglu_pairs(ab, p)
        return clamped_swiglu_pairs(ab, p, self.alpha, self.limit)

    def quack_problem(self, biases: bool) -> str | None:
        """Why QuACK's epilogue (silu(gate) * up * p, moe/quack_epilogue.py) cannot run these experts."""
        if self.name != "swiglu":
            return f"has a SwiGLU epilogue only, not the experts' {self.name}"
        if biases:
            return "adds no expert biases in its epilogue"
        return None


SWIGLU = ExpertActivation()


def clamped_swiglu_pairs(ab: torch.Tensor, p: torch.Tensor | None, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation of (gate, up) pairs ab [..., 2 * ffn], in float32 at least (p's dtype
    when given), rounded once to ab's dtype; autograd gives clamp's gradient (zero past the limit)."""
    compute = torch.promote_types(ab.dtype, torch.float32) if p is None else p.dtype
    gate, up = ab[..., 0::2].to(compute), ab[..., 1::2].to(compute)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    h = gate * torch.sigmoid(alpha * gate) * (up + 1)
    return cast(h if p is None else h * p, ab.dtype)
