"""Named model sizes: FLAVORS[model_name][flavor] -> TransformerArgs.

Real sizes come from the models' Hugging Face config.json files (named per flavor; the
files are in tests/data/hf_configs/ and tests/test_hf_configs.py checks that they build
these flavors). The flavor `hf` of every family (train_spec.py) takes all sizes from any
such config.json instead (`[model] hf_config`).
`debug` flavors are tiny and train in seconds on a CPU (vocab >= 258 for the byte tokenizer).
The `[moe]` section of a job config may override the router settings of any flavor.
"""

from titan_fold.models.args import TransformerArgs
from titan_fold.models.deepseek_v3 import DEEPSEEK_V3
from titan_fold.models.gpt_oss import GPT_OSS
from titan_fold.models.qwen3_5 import QWEN3_5_MOE, QWEN3_NEXT
from titan_fold.moe import MoEArgs

# Qwen2-MoE: qkv bias, a shared expert scaled by sigmoid(x @ w_gate), softmax scores
# used as they are (norm_topk_prob false).
QWEN2_MOE = {
    # 8 query / 4 kv heads (GQA) so that every tp up to 4 divides them
    "debug": TransformerArgs(
        dim=64,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=512,
        norm_eps=1e-6,
        rope_theta=1e6,
        qkv_bias=True,
        max_seq_len=2048,
        ffn_dim=128,
        moe=MoEArgs(
            num_experts=8,
            top_k=2,
            moe_ffn_dim=32,
            shared_ffn_dim=64,
            shared_expert_gate=True,
            score_func="softmax",
            norm_topk_prob=False,
        ),
    ),
    # Qwen/Qwen2-57B-A14B: 57.4B parameters, 14.2B activated counting the embedding table
    "57B-A14B": TransformerArgs(
        dim=3584,  # hidden_size
        n_layers=28,  # num_hidden_layers
        n_heads=28,  # num_attention_heads (head_dim 128)
        n_kv_heads=4,  # num_key_value_heads
        vocab_size=151936,
        norm_eps=1e-6,  # rms_norm_eps
        rope_theta=1e6,
        qkv_bias=True,
        max_seq_len=32768,  # max_position_embeddings
        ffn_dim=18944,  # intermediate_size; unused while every layer is MoE (decoder_sparse_step 1)
        moe=MoEArgs(
            num_experts=64,
            top_k=8,  # num_experts_per_tok
            moe_ffn_dim=2560,  # moe_intermediate_size
            shared_ffn_dim=20480,  # shared_expert_intermediate_size
            shared_expert_gate=True,
            score_func="softmax",
            norm_topk_prob=False,
            aux_loss_coeff=1e-3,  # router_aux_loss_coef
        ),
    ),
}


# Mixtral: softmax over all experts, then the top-k weights renormalized to sum to one
# (the same as a softmax over the k chosen logits); no biases, no shared expert.
def _mixtral(
    dim, n_layers, n_heads, vocab_size, max_seq_len, ffn_dim, num_experts=8, top_k=2, n_kv_heads=8, aux_loss_coeff=1e-3
) -> TransformerArgs:
    return TransformerArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        norm_eps=1e-5,
        rope_theta=1e6,
        max_seq_len=max_seq_len,
        ffn_dim=ffn_dim,  # intermediate_size, the width of each original expert
        moe=MoEArgs(
            num_experts=num_experts,
            top_k=top_k,
            moe_ffn_dim=ffn_dim // (num_experts // 8),
            norm_topk_prob=True,
            aux_loss_coeff=aux_loss_coeff,
        ),
    )


MIXTRAL = {
    "debug": _mixtral(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=2048, ffn_dim=128, aux_loss_coeff=0.01
    ),
    # mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B activated
    "8x7B": _mixtral(
        dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=32768, ffn_dim=14336, aux_loss_coeff=2e-2
    ),
    # mistralai/Mixtral-8x22B-v0.1: 141B parameters, 39B activated
    "8x22B": _mixtral(dim=6144, n_layers=56, n_heads=48, vocab_size=32768, max_seq_len=65536, ffn_dim=16384),
    # The paper's fine-grained Mixtral-8x22B (section 4, "fine-grained upcycling"): each expert
    # split 8 ways, 64 experts of 16384 / 8 = 2048, top-8. Same 141B total; a token passes
    # through one original expert's width instead of two: 22.3B activated.
    "8x22B-G8T8": _mixtral(
        dim=6144, n_layers=56, n_heads=48, vocab_size=32768, max_seq_len=65536, ffn_dim=16384, num_experts=64, top_k=8
    ),
}


# Qwen3-MoE: q/k RMSNorm per head, no biases, no shared expert, head_dim independent of
# dim / n_heads, softmax top-k renormalized (norm_topk_prob true in the published models).
def _qwen3(
    dim,
    n_layers,
    n_heads,
    n_kv_heads,
    head_dim,
    ffn_dim,
    num_experts,
    top_k,
    moe_ffn_dim,
    vocab_size=151936,
    max_seq_len=40960,
) -> TransformerArgs:
    return TransformerArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        norm_eps=1e-6,
        rope_theta=1e6,
        qk_norm=True,
        max_seq_len=max_seq_len,
        ffn_dim=ffn_dim,  # intermediate_size; unused while every layer is MoE
        moe=MoEArgs(
            num_experts=num_experts, top_k=top_k, moe_ffn_dim=moe_ffn_dim, norm_topk_prob=True, aux_loss_coeff=1e-3
        ),
    )


QWEN3_MOE = {
    # head_dim 16 != 64 / 8, as in the real ones (128 != 2048 / 32)
    "debug": _qwen3(
        dim=64,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        ffn_dim=128,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=32,
        vocab_size=512,
        max_seq_len=2048,
    ),
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B activated
    "30B-A3B": _qwen3(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=6144,
        num_experts=128,
        top_k=8,
        moe_ffn_dim=768,
    ),
    # Qwen/Qwen3-235B-A22B: 235B parameters, 22B activated
    "235B-A22B": _qwen3(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=12288,
        num_experts=128,
        top_k=8,
        moe_ffn_dim=1536,
    ),
}

FLAVORS = {
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
    "deepseek_v3": DEEPSEEK_V3,
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_next": QWEN3_NEXT,
    "gpt_oss": GPT_OSS,
}
