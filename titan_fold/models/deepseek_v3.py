"""DeepSeek-V3 family: the same Transformer with multi-head latent attention (models/mla.py),
YaRN RoPE on the rotary part of q and k, sigmoid group-limited routing with aux-free bias and
routed_scaling_factor, shared experts without a gate, first_k_dense dense layers and optional
Multi-Token Prediction (models/mtp.py).

Flavors: `debug` (CPU), `16B` (torchtitan's deepseek_v3 16B widths, DeepSeek-V2-Lite sized: no
q LoRA, softmax routing), `671B` (DeepSeek-V3 / R1's config.json), `kimi_k2` (Kimi-K2's: 1T,
384 experts in one group). Sizes from their Hugging Face config.json files.
"""

from dataclasses import dataclass
from typing import Literal

from titan_fold.models.args import TransformerArgs
from titan_fold.moe import MoEArgs


@dataclass
class DeepSeekV3Args(TransformerArgs):
    q_lora_rank: int | None = None  # None: q = wq(x); else q = wq_b(norm(wq_a(x))) through this rank
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_interleave: bool = True  # DeepSeek's checkpoints store the rotary dims as interleaved pairs
    rope_type: Literal["default", "yarn"] = "default"
    rope_factor: float = 1.0
    original_max_seq_len: int = 4096  # YaRN: the context length the model was pretrained with
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0  # YaRN: also scales the softmax by mscale(factor, mscale_all_dim)^2
    rope_truncate: bool = True
    yarn_attention_factor_override: float | None = None  # rope_scaling.attention_factor when given

    def __post_init__(self):
        # the qk head dim: what the trainer's FLOP count and the attention widths read
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.n_kv_heads = self.n_heads
        super().__post_init__()
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank = {self.q_lora_rank}: must be >= 1, or None for no q LoRA")

    def attention_module(self):
        from titan_fold.models.mla import MLAttention

        return MLAttention(self)

    def rope_tables(self, device=None):
        from titan_fold.models.mla import yarn_cos_sin

        return yarn_cos_sin(self, device)

    def attention_flops_dim(self) -> float:
        return (self.head_dim + self.v_head_dim) / 2

    def yarn_attention_factor(self) -> float:
        """The factor YaRN multiplies cos and sin by (transformers' rule)."""
        from titan_fold.models.mla import yarn_mscale

        if self.yarn_attention_factor_override is not None:
            return self.yarn_attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.mscale) / yarn_mscale(self.rope_factor, self.mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    def softmax_scale(self) -> float:
        from titan_fold.models.mla import yarn_mscale

        scale = self.head_dim**-0.5
        if self.rope_type == "yarn" and self.mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.mscale_all_dim) ** 2
        return scale


def _yarn(
    factor: float, beta_fast: float, beta_slow: float, mscale: float, mscale_all_dim: float, original: int = 4096
) -> dict:
    return dict(
        rope_type="yarn",
        rope_factor=factor,
        original_max_seq_len=original,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


def _big(
    vocab_size: int,
    n_heads: int,
    first_k_dense: int,
    num_experts: int,
    num_groups: int,
    group_topk: int,
    routed_scaling_factor: float,
    rope_theta: float,
    max_seq_len: int,
    yarn: dict,
) -> DeepSeekV3Args:
    """DeepSeek-V3's widths (Kimi-K2 shares them): dim 7168, 61 layers, experts of 2048, top-8."""
    return DeepSeekV3Args(
        dim=7168,  # hidden_size
        n_layers=61,
        n_heads=n_heads,
        vocab_size=vocab_size,
        norm_eps=1e-6,
        rope_theta=rope_theta,
        max_seq_len=max_seq_len,  # max_position_embeddings
        ffn_dim=18432,  # intermediate_size: the dense layers
        first_k_dense=first_k_dense,  # first_k_dense_replace
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        **yarn,
        moe=MoEArgs(
            num_experts=num_experts,  # n_routed_experts
            top_k=8,
            moe_ffn_dim=2048,  # moe_intermediate_size
            shared_ffn_dim=2048,  # n_shared_experts (1) x moe_intermediate_size
            score_func="sigmoid",
            norm_topk_prob=True,
            num_groups=num_groups,  # n_group
            group_topk=group_topk,  # topk_group
            routed_scaling_factor=routed_scaling_factor,
            load_balance="aux_free",  # e_score_correction_bias; DeepSeek's bias update speed 1e-3
            aux_free_bias_update_rate=1e-3,
        ),
    )


DEEPSEEK_V3 = {
    # q LoRA, groups (4 of 2 experts, 2 chosen), YaRN, a dense first layer; heads divisible by tp <= 4
    "debug": DeepSeekV3Args(
        dim=64,
        n_layers=4,
        n_heads=4,
        vocab_size=512,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=2048,
        ffn_dim=128,
        first_k_dense=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        **_yarn(factor=4.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0, original=512),
        moe=MoEArgs(
            num_experts=8,
            top_k=2,
            moe_ffn_dim=32,
            shared_ffn_dim=32,
            score_func="sigmoid",
            norm_topk_prob=True,
            num_groups=4,
            group_topk=2,
            routed_scaling_factor=2.5,
            load_balance="aux_free",
        ),
    ),
    # torchtitan 0.2.2's deepseek_v3 "16B" (DeepSeek-V2-Lite widths): 15.7B parameters, 2.4B activated
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=163840,
        ffn_dim=10944,
        first_k_dense=1,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        **_yarn(factor=40.0, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        moe=MoEArgs(
            num_experts=64,
            top_k=6,
            moe_ffn_dim=1408,
            shared_ffn_dim=2 * 1408,
            score_func="softmax",
            norm_topk_prob=False,
            load_balance="aux_free",
            aux_free_bias_update_rate=1e-3,
        ),
    ),
    # deepseek-ai/DeepSeek-V3 (and R1): 671B parameters, 37B activated; 685B with its MTP layer
    "671B": _big(
        vocab_size=129280,
        n_heads=128,
        first_k_dense=3,
        num_experts=256,
        num_groups=8,
        group_topk=4,
        routed_scaling_factor=2.5,
        rope_theta=10000.0,
        max_seq_len=163840,
        yarn=_yarn(factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    ),
    # moonshotai/Kimi-K2-Instruct: 1.04T parameters, 32B activated; 384 experts, one group
    "kimi_k2": _big(
        vocab_size=163840,
        n_heads=64,
        first_k_dense=1,
        num_experts=384,
        num_groups=1,
        group_topk=1,
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        max_seq_len=131072,
        yarn=_yarn(factor=32.0, beta_fast=1, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    ),
}


def count_parameters(args: DeepSeekV3Args) -> int:
    """Parameters of the model these args build (embedding, head and MTP layers included),
    built on the meta device (no memory)."""
    import torch

    from titan_fold.models.transformer import Transformer

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(args).parameters())
