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
from titan_fold.moe import MoEArgs


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

    def rms_norm(self, dim: int):
        from titan_fold.models.layers import ZeroCenteredRMSNorm

        return ZeroCenteredRMSNorm(dim, eps=self.norm_eps)

    def linear_attention_module(self):
        from titan_fold.models.gated_deltanet import GatedDeltaNet

        return GatedDeltaNet(self)

    def mixer_flops(self, layer_id: int, lengths):
        """A linear-attention layer's rule: per token and value head it multiplies the K x V state
        three times, S^T k (what the state predicts for v), the rank-one write k (beta (v - S^T
        k))^T and the read S^T q: 3 x 2 K V forward FLOPs, 18 K V with backward (twice the
        forward), linear in the tokens. The chunked form does more (products within a chunk); as
        for causal attention, the count is the work the definition needs. Projections,
        convolution, decay and norm are parameters (6 N). Full-attention layers: TransformerArgs'."""
        if self.layer_type(layer_id) != "linear_attention":
            return super().mixer_flops(layer_id, lengths)
        per_token = 18 * self.linear_n_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return per_token * float(lengths.sum())


def _qwen35(
    dim: int,
    n_layers: int,
    n_heads: int,
    num_experts: int,
    top_k: int,
    moe_ffn_dim: int,
    linear_n_value_heads: int = 32,
    vocab_size: int = 248320,
    n_kv_heads: int = 2,
    head_dim: int = 256,
    linear_n_key_heads: int = 16,
    linear_head_dim: int = 128,
    max_seq_len: int = 262144,
    rope_theta: float = 1e7,
) -> Qwen35Args:
    """A Qwen3.5-MoE / Qwen3-Next size: three linear-attention layers to every full one, gated
    attention with q/k norms and RoPE on a quarter of each head, every layer MoE with a gated
    shared expert as wide as one routed expert."""
    return Qwen35Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        norm_eps=1e-6,
        rope_theta=rope_theta,
        partial_rotary_factor=0.25,
        qk_norm=True,
        attention_output_gate=True,
        layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)),
        max_seq_len=max_seq_len,
        ffn_dim=0,  # every layer is MoE
        linear_n_key_heads=linear_n_key_heads,
        linear_n_value_heads=linear_n_value_heads,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        moe=MoEArgs(
            num_experts=num_experts,
            top_k=top_k,
            moe_ffn_dim=moe_ffn_dim,
            shared_ffn_dim=moe_ffn_dim,
            shared_expert_gate=True,
            score_func="softmax",
            norm_topk_prob=True,
            aux_loss_coeff=1e-3,
        ),
    )


QWEN3_5_MOE = {
    # two linear layers, a full one, a linear one; heads divisible by tp <= 2 (linear key heads 2)
    "debug": _qwen35(
        dim=64,
        n_layers=4,
        n_heads=4,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=32,
        linear_n_value_heads=4,
        vocab_size=512,
        n_kv_heads=2,
        head_dim=32,
        linear_n_key_heads=2,
        linear_head_dim=16,
        max_seq_len=2048,
        rope_theta=1e6,
    ),
    # Qwen/Qwen3.5-35B-A3B: 35B parameters, 3B activated
    "35B-A3B": _qwen35(dim=2048, n_layers=40, n_heads=16, num_experts=256, top_k=8, moe_ffn_dim=512),
    # Qwen/Qwen3.5-122B-A10B: 122B parameters, 10B activated
    "122B-A10B": _qwen35(
        dim=3072, n_layers=48, n_heads=32, num_experts=256, top_k=8, moe_ffn_dim=1024, linear_n_value_heads=64
    ),
    # Qwen/Qwen3.5-397B-A17B: 397B parameters, 17B activated
    "397B-A17B": _qwen35(
        dim=4096, n_layers=60, n_heads=32, num_experts=512, top_k=10, moe_ffn_dim=1024, linear_n_value_heads=64
    ),
}

QWEN3_NEXT = {
    "debug": QWEN3_5_MOE["debug"],
    # Qwen/Qwen3-Next-80B-A3B: 80B parameters, 3B activated
    "80B-A3B": _qwen35(
        dim=2048, n_layers=48, n_heads=16, num_experts=512, top_k=10, moe_ffn_dim=512, vocab_size=151936
    ),
}
