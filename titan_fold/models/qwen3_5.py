"""Qwen3.5-MoE and Qwen3-Next: hybrid models of Gated DeltaNet linear attention (models/gated_deltanet.py)
and gated full attention, every layer MoE with a sigmoid-gated shared expert.

    layer i: "linear_attention" (3 of every 4) or "full_attention" (every 4th: i % 4 == 3)
    full attention: q_proj gives q and a gate per head; out = wo(attention * sigmoid(gate));
                    q/k norms; RoPE on the first quarter of head_dim 256
    norms: zero-centered, x_hat * (1 + weight) (transformers' Qwen3NextRMSNorm), the gated
           RMSNorm of the linear attention excepted (x_hat * weight * silu(z))
    MoE: softmax top-k renormalized, shared expert scaled by sigmoid(x @ shared_expert_gate)

Flavors: `debug` (CPU), Qwen3.5 `35B-A3B`, `122B-A10B`, `397B-A17B` (model.name qwen3_5_moe) and
Qwen3-Next `80B-A3B` (qwen3_next). Widths from the published configs (as launched by Megatron
scripts: slime's scripts/models/qwen3.5-*.sh); the linear-attention head counts of 122B-A10B
and 397B-A17B (16 key, 64 value heads of 128) are the Qwen3.5 configs' for their widths.
"""

from dataclasses import dataclass

from titan_fold.models.args import TransformerArgs


@dataclass
class Qwen35Args(TransformerArgs):
    # Gated DeltaNet: key heads (query heads too), value heads (a multiple of the key heads: each
    # key head serves value_heads / key_heads of them), their widths, the convolution's taps
    linear_n_key_heads: int = 2
    linear_n_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.linear_n_value_heads % self.linear_n_key_heads:
            raise ValueError(
                f"linear_n_value_heads={self.linear_n_value_heads} must be a multiple of "
                f"linear_n_key_heads={self.linear_n_key_heads}"
            )

    def linear_attention_module(self):
        from titan_fold.models.gated_deltanet import GatedDeltaNet

        return GatedDeltaNet(self)
