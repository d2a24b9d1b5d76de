"""GPT-OSS family (openai/gpt-oss-20b, -120b): the same Transformer with the variants it needs.

    attention  biases on q, k, v, o; one learned sink per head; sliding-window (128) and full
               layers alternating, the sliding ones first (transformers' layer_types)
    RoPE       YaRN (factor 32 over 4096 positions, beta 32 / 1, not truncated), cos and sin
               times its attention factor 0.1 ln(32) + 1 (models/mla.py's tables)
    experts    biases on w13 and w2, the clamped SwiGLU (alpha 1.702, limit 7; moe/activation.py)
    router     a bias on the logits; softmax over the top-4 logits, which is the softmax over all
               experts renormalized over the chosen ones (score_func softmax, norm_topk_prob)

Every layer is MoE (32 or 128 experts of width 2880); no shared expert, untied head.
Hub import and export, with the MXFP4 experts dequantized: models/hf_gpt_oss.py.
"""

from dataclasses import dataclass

import torch

from titan_fold.models.args import TransformerArgs
from titan_fold.models.mla import yarn_inv_freq, yarn_mscale
from titan_fold.moe import MoEArgs
from titan_fold.moe.activation import ExpertActivation


@dataclass
class GptOssArgs(TransformerArgs):
    rope_factor: float = 32.0  # YaRN; 1 = plain RoPE
    original_max_seq_len: int = 4096  # YaRN: the context length the model was pretrained with
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_truncate: bool = False

    def rope_tables(self, device=None):
        """(cos, sin) [max_seq_len, head_dim], half-split, YaRN's frequencies and attention factor."""
        dim = self.rotary_dim
        if self.rope_factor > 1:
            inv_freq = yarn_inv_freq(
                dim,
                self.rope_theta,
                self.rope_factor,
                self.original_max_seq_len,
                self.beta_fast,
                self.beta_slow,
                self.rope_truncate,
                device,
            )
        else:
            inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        angles = torch.outer(torch.arange(self.max_seq_len, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        factor = yarn_mscale(self.rope_factor)
        return angles.cos() * factor, angles.sin() * factor


def alternating_layers(n_layers: int) -> tuple[str, ...]:
    """transformers' GPT-OSS default: sliding-window layers at even indices, full ones at odd."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))


def _gpt_oss(
    n_layers: int,
    num_experts: int,
    dim: int = 2880,
    n_heads: int = 64,
    n_kv_heads: int = 8,
    head_dim: int = 64,
    moe_ffn_dim: int = 2880,
    top_k: int = 4,
    vocab_size: int = 201088,
    sliding_window: int = 128,
    max_seq_len: int = 131072,
    aux_loss_coeff: float = 0.9,  # the published config.json's router_aux_loss_coef
) -> GptOssArgs:
    return GptOssArgs(
        dim=dim,  # hidden_size
        n_layers=n_layers,  # num_hidden_layers
        n_heads=n_heads,  # num_attention_heads
        n_kv_heads=n_kv_heads,  # num_key_value_heads
        head_dim=head_dim,
        vocab_size=vocab_size,
        norm_eps=1e-5,  # rms_norm_eps
        rope_theta=150000.0,
        qkv_bias=True,  # attention_bias
        out_bias=True,
        max_seq_len=max_seq_len,  # max_position_embeddings
        attention_sinks=True,
        sliding_window=sliding_window,
        layer_types=alternating_layers(n_layers),
        ffn_dim=moe_ffn_dim,  # intermediate_size; every layer is MoE
        moe=MoEArgs(
            num_experts=num_experts,  # num_local_experts
            top_k=top_k,  # num_experts_per_tok
            moe_ffn_dim=moe_ffn_dim,
            score_func="softmax",
            norm_topk_prob=True,
            aux_loss_coeff=aux_loss_coeff,  # router_aux_loss_coef
            activation=ExpertActivation("clamped_swiglu", alpha=1.702, limit=7.0),  # swiglu_alpha, swiglu_limit
            expert_biases=True,
            router_bias=True,
        ),
    )


GPT_OSS = {
    # 8 query / 4 kv heads so every tp up to 4 divides them; a window of 8 that CPU sequences pass
    "debug": _gpt_oss(
        n_layers=4,
        num_experts=8,
        dim=64,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        moe_ffn_dim=32,
        top_k=4,
        vocab_size=512,
        sliding_window=8,
        max_seq_len=2048,
        aux_loss_coeff=1e-2,
    ),
    # openai/gpt-oss-20b: 20.9B parameters, 3.6B activated
    "20b": _gpt_oss(n_layers=24, num_experts=32),
    # openai/gpt-oss-120b: 116.8B parameters, 5.1B activated
    "120b": _gpt_oss(n_layers=36, num_experts=128),
}
