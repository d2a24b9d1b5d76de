"""Training FLOPs per token of a model in three published counts, for tables beside other stacks.

- megatron: Megatron-LM's `num_floating_point_operations` (megatron/training/training.py,
  transformer_flops): 3 (forward, dgrad, wgrad) x 2 (multiply-add) x every GEMM of a token,
  core attention halved for the causal mask, the logit layer over the vocabulary padded to a
  multiple of 128, no router, no norms. Megatron-Bridge and NeMo AutoModel report TFLOP/s in it.
- titan_fold: 6 x active parameters (embedding lookup included) + causal core attention
  (TransformerArgs.get_nparams_and_flops, what the trainer's MFU divides by).
- torchtitan: torchtitan 0.2.2's count for the same widths (its model args'
  get_nparams_and_flops): 6 x active parameters less the embedding + core attention counted
  non-causal.

Each takes titan_fold's TransformerArgs (FLAVORS[family][flavor]) and the sequence length.
"""

import dataclasses


def megatron_flops_per_token(args, seq_len: int) -> float:
    """Megatron-LM's count per token of a sequence of `seq_len` (GQA or MLA, SwiGLU experts)."""
    h, moe = args.dim, args.moe
    fb_fma = 3 * 2
    n_dense = sum(1 for i in range(args.n_layers) if not args.is_moe_layer(i))
    n_moe = args.n_layers - n_dense
    mlp = (
        fb_fma
        * h
        * 3  # SwiGLU: two input projections and one output projection
        * (args.ffn_dim * n_dense + moe.moe_ffn_dim * moe.top_k * n_moe + moe.shared_ffn_dim * n_moe)
    )
    if getattr(args, "kv_lora_rank", 0):
        H, nope, rope, v = args.n_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        q_lora = getattr(args, "q_lora_rank", None)
        q_term = h * H * (nope + rope) if not q_lora else q_lora * (h + H * (nope + rope) + 1)
        attention = fb_fma * (
            q_term
            + args.kv_lora_rank * (h + H * (nope + v) + 1)
            + h * rope
            + H * v * h
            + seq_len * H * (nope + rope) / 2
            + seq_len * H * v / 2
        )
    else:
        q = args.head_dim * args.n_heads
        kv = args.head_dim * args.n_kv_heads
        attention = fb_fma * (h * (q + 2 * kv) + q * seq_len / 2 * 2 + q * h)
    padded_vocab = -(-args.vocab_size // 128) * 128
    return mlp + attention * args.n_layers + fb_fma * h * padded_vocab


def titan_fold_flops_per_token(args, seq_len: int) -> float:
    """The trainer's own count, on the meta device."""
    import torch

    from titan_fold.models import Transformer

    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, seq_len))
    with torch.device("meta"):
        model = Transformer(args)
    return args.get_nparams_and_flops(model, seq_len)[1]


def counts(family: str, flavor: str, seq_len: int) -> dict[str, float]:
    """{"megatron", "titan_fold", "torchtitan"}: FLOPs per token of FLAVORS[family][flavor]."""
    from bench.vs_torchtitan import torchtitan_flops_per_token
    from titan_fold.models import FLAVORS

    args = FLAVORS[family][flavor]
    return {
        "megatron": megatron_flops_per_token(args, seq_len),
        "titan_fold": titan_fold_flops_per_token(args, seq_len),
        "torchtitan": torchtitan_flops_per_token(family, flavor, seq_len),
    }
