"""bench/flops.py's three FLOP counts against a hand count of one Qwen3-30B-A3B layer and one
DeepSeek-V3-16B (MLA) layer: a layer's count is the difference of the 2- and 1-layer models."""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import flops  # noqa: E402
from bench.train_step import register_proxy  # noqa: E402
from titan_fold.models import FLAVORS  # noqa: E402

SEQ = 4096


def per_layer(count, family: str, base: str) -> float:
    """count(L=2) - count(L=1) at the flavor's real widths and vocabulary."""
    args = FLAVORS[family][base]
    one, two = (dataclasses.replace(args, n_layers=n, first_k_dense=0) for n in (1, 2))
    return count(two, SEQ) - count(one, SEQ)


# Qwen3-30B-A3B: dim 2048, 32 query heads and 4 kv heads of 128, 8 of 128 experts of width 768
H, Q, KV, F, K, E = 2048, 32 * 128, 4 * 128, 768, 8, 128
QWEN3_GEMMS = H * (Q + 2 * KV) + Q * H + K * 3 * H * F  # multiply-adds of a token's projections
QWEN3_NORMS = 128 + 128 + H + H  # q/k norms, attention and ffn norms
QWEN3_ROUTER = H * E
# DeepSeek-V3-16B: dim 2048, 16 heads, kv rank 512, q/k nope 128, rope 64, v 128, top-6 of width 1408, shared 2816
MH, NOPE, ROPE, V, R, MF, MK, SF = 16, 128, 64, 128, 512, 1408, 6, 2816
MLA_GEMMS = H * MH * (NOPE + ROPE) + H * (R + ROPE) + R * MH * (NOPE + V) + MH * V * H
MLA_MLP = (MK * MF + SF) * 3 * H


def test_megatron_count_of_a_layer_by_hand():
    # 3 (forward, dgrad, wgrad) x 2 (multiply-add); core attention q.k and p.v halved for causal
    qwen3 = 6 * (QWEN3_GEMMS + 2 * Q * SEQ / 2)
    assert per_layer(flops.megatron_flops_per_token, "qwen3_moe", "30B-A3B") == qwen3
    # MLA: the kv rank's norm counted as a GEMM column (Megatron's "+ 1")
    mla = 6 * (MLA_GEMMS + R + MH * (NOPE + ROPE) * SEQ / 2 + MH * V * SEQ / 2 + MLA_MLP)
    assert per_layer(flops.megatron_flops_per_token, "deepseek_v3", "16B") == mla


def test_titan_fold_count_of_a_layer_by_hand():
    # 6 x active parameters (router and norms included) + 6 x heads x head_dim x seq (causal)
    qwen3 = 6 * (QWEN3_GEMMS + QWEN3_NORMS + QWEN3_ROUTER) + 6 * 32 * 128 * SEQ
    assert per_layer(flops.titan_fold_flops_per_token, "qwen3_moe", "30B-A3B") == qwen3


def test_torchtitan_count_of_a_layer_by_hand():
    """torchtitan counts q.k and p.v over every key (non-causal): 12 x heads x head_dim x seq."""
    from bench.vs_torchtitan import torchtitan_flops_per_token

    def count(args, seq):
        name = f"30B-A3B-flops{args.n_layers}"
        FLAVORS["qwen3_moe"][name] = args
        try:
            return torchtitan_flops_per_token("qwen3_moe", name, seq)
        finally:
            FLAVORS["qwen3_moe"].pop(name)

    qwen3 = 6 * (QWEN3_GEMMS + QWEN3_NORMS + QWEN3_ROUTER) + 12 * 32 * 128 * SEQ
    assert per_layer(count, "qwen3_moe", "30B-A3B") == qwen3


def test_published_per_token_counts():
    """Megatron's count of the full model is the ~23 GFLOP per token the published TFLOP/s rest on
    (Megatron-Bridge: 10,494 tokens/s/GPU reported as 241 TFLOP/s/GPU)."""
    assert flops.megatron_flops_per_token(FLAVORS["qwen3_moe"]["30B-A3B"], SEQ) == pytest.approx(241e12 / 10494, 2e-3)


def test_one_ep_ranks_experts_keep_the_per_token_count():
    """The full-depth proxy "-E16" (one EP8 rank's experts) costs what the full model costs per
    token but for the router's columns."""
    register_proxy("qwen3_moe", "30B-A3B-E16")
    try:
        full, rank = FLAVORS["qwen3_moe"]["30B-A3B"], FLAVORS["qwen3_moe"]["30B-A3B-E16"]
        assert rank.n_layers == 48 and rank.vocab_size == full.vocab_size and rank.moe.num_experts == 16
        assert flops.megatron_flops_per_token(rank, SEQ) == flops.megatron_flops_per_token(full, SEQ)
        diff = flops.titan_fold_flops_per_token(full, SEQ) - flops.titan_fold_flops_per_token(rank, SEQ)
        assert diff == 6 * 48 * H * (E - 16)
    finally:
        FLAVORS["qwen3_moe"].pop("30B-A3B-E16")


def test_torchtitan_formula_on_our_gpt_oss_equals_its_own_model():
    """Families torchtitan 0.2.2 lacks (Qwen3.5) take its MoE formula over titan_fold's model
    (bench/vs_torchtitan.py MOE_FORMULA_FAMILIES); on GPT-OSS, which it has, that gives its own
    model's count at the proxy's widths: the parameter names fall in the same classes."""
    import torch
    from torchtitan.models.gpt_oss import GptOssModel, gptoss_configs

    from bench.vs_torchtitan import torchtitan_flops_per_token

    register_proxy("gpt_oss", "20b-L6")
    try:
        proxy = FLAVORS["gpt_oss"]["20b-L6"]
        assert proxy.layer_types == ("sliding_attention", "full_attention") * 3
        theirs = dataclasses.replace(gptoss_configs["20b"], n_layers=6, vocab_size=32768)
        with torch.device("meta"):
            model = GptOssModel(theirs)
        assert torchtitan_flops_per_token("gpt_oss", "20b-L6", SEQ) == theirs.get_nparams_and_flops(model, SEQ)[1]
    finally:
        FLAVORS["gpt_oss"].pop("20b-L6")
