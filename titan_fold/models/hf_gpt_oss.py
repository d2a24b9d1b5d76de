"""Hugging Face GptOssForCausalLM <-> titan_fold's gpt_oss: tensor names, MXFP4, config.json.

transformers stacks the experts as we do, transposed ([E, in, out]), and reads its gate_up_proj
columns as alternating (gate, up) pairs, w13's row order (moe/experts.py):

    model.layers.{i}.self_attn.sinks                       [heads]         attention.sinks.weight
    model.layers.{i}.mlp.router.weight / .bias             [E, dim] / [E]  moe.router.gate.*
    model.layers.{i}.mlp.experts.gate_up_proj              [E, dim, 2 ffn] moe.experts.w13 (transposed)
    model.layers.{i}.mlp.experts.gate_up_proj_bias         [E, 2 ffn]      moe.experts.w13_bias
    model.layers.{i}.mlp.experts.down_proj                 [E, ffn, dim]   moe.experts.w2 (transposed)
    model.layers.{i}.mlp.experts.down_proj_bias            [E, dim]        moe.experts.w2_bias

and the attention projections (with biases), norms, embedding and head as every family.

MXFP4: the published checkpoints hold each expert matrix as `<name>_blocks` [E, out, in / 32,
16] uint8 (two 4-bit e2m1 values a byte, the low nibble first) and `<name>_scales` [E, out, in /
32] uint8 (a power of two per 32 values, biased by 127), out-major: the layout of our w13 and w2
with no transpose. Import dequantizes them to bfloat16 (`dequantize_mxfp4`, transformers'
table), as DeepSeek-V3's FP8 blocks are (models/hf_deepseek.py); export writes bfloat16 (or the
asked dtype) under the plain names, with no quantization_config, which transformers opens as is.
The trainer's `checkpoint.initial_load_in_hf` reads unquantized folders: convert an MXFP4 one
with `python -m titan_fold.hf import` first.
"""

import re
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_fold.models.gpt_oss import GptOssArgs
from titan_fold.models.mla import yarn_mscale
from titan_fold.moe import MoEArgs
from titan_fold.moe.activation import ExpertActivation

# e2m1 values of the 16 codes (transformers' FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per scale

# ours (inside layers.{i}.) -> HF (inside model.layers.{i}.), beyond hf_adapter's shared names
GPT_OSS_LAYER = {
    "attention.sinks.weight": "self_attn.sinks",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.w13_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts.w2_bias": "mlp.experts.down_proj_bias",
}
# stacked matrices, transposed on the HF side
GPT_OSS_EXPERTS = {"moe.experts.w13": "mlp.experts.gate_up_proj", "moe.experts.w2": "mlp.experts.down_proj"}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in dtype: each byte's low
    then high nibble as an e2m1 value, times 2^(scale - 127)."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


def dequantize_state_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """Every `X_blocks` with its `X_scales` -> a bfloat16 `X` [E, in, out] (HF's own layout); the rest as is."""
    out = {}
    for key, value in hf.items():
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):
            name = key.removesuffix("_blocks")
            if name + "_scales" not in hf:
                raise ValueError(f"{key}: no {name}_scales beside it")
            out[name] = dequantize_mxfp4(value, hf[name + "_scales"]).transpose(-2, -1)
            continue
        out[key] = value
    return out


def mxfp4_shapes(shapes: dict[str, Any]) -> dict[str, Any]:
    """An HF folder's {key: shape} with each MXFP4 pair as the one matrix it dequantizes to."""
    out = {}
    for key, shape in shapes.items():
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):
            *lead, out_dim, groups, half = shape
            out[key.removesuffix("_blocks")] = [*lead, groups * half * 2, out_dim]
            continue
        out[key] = shape
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class GptOssNames:
    """The GPT-OSS renames around MoEStateDictAdapter's shared ones (hf_adapter.py)."""

    def __init__(self, layouts: dict[str, tuple]):
        self.layouts = layouts  # (mesh, placements) of our DTensor experts, seen by native_to_hf

    def native_to_hf(self, state_dict: dict[str, Any], base_to_hf) -> dict[str, Any]:
        hf, rest = {}, {}
        for key, value in state_dict.items():
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
            if m is None or (m.group(2) not in GPT_OSS_LAYER and m.group(2) not in GPT_OSS_EXPERTS):
                rest[key] = value
                continue
            i, name = m.groups()
            if isinstance(value, DTensor) and name.startswith("moe.experts."):
                self.layouts[key] = (value.device_mesh, value.placements)
                value = value.full_tensor()  # [E, ...] on every rank
            if name in GPT_OSS_EXPERTS:
                hf[f"model.layers.{i}.{GPT_OSS_EXPERTS[name]}"] = value.transpose(-2, -1).contiguous()
            else:
                hf[f"model.layers.{i}.{GPT_OSS_LAYER[name]}"] = value
        hf.update(base_to_hf(rest))
        return hf

    def hf_to_native(self, hf: dict[str, Any], base_from_hf) -> dict[str, Any]:
        hf = dequantize_state_dict(hf)
        inverse = {v: k for k, v in {**GPT_OSS_LAYER, **GPT_OSS_EXPERTS}.items()}
        native, rest = {}, {}
        for key, value in hf.items():
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
            if m is None or m.group(2) not in inverse:
                rest[key] = value
                continue
            i, name = m.group(1), inverse[m.group(2)]
            if name in GPT_OSS_EXPERTS:
                value = value.transpose(-2, -1).contiguous()
            key = f"layers.{i}.{name}"
            if key in self.layouts:  # every rank read the whole stack: cut out its own shard
                mesh, placements = self.layouts[key]
                value = distribute_tensor(value, mesh, placements, src_data_rank=None)
            native[key] = value
        native.update(base_from_hf(rest))
        return native


# ---------------------------------------------------------------- config.json

INERT = {"initial_context_length", "experts_per_token", "quantization_config", "hidden_act", "swiglu_alpha"}


def gpt_oss_args_from_hf_config(c: dict, inert: set, error) -> GptOssArgs:
    """GptOssArgs of a GPT-OSS config.json (dict); error(message) builds the exception raised."""
    used = set(inert) | INERT | {"rope_theta", "rope_scaling", "rope_parameters"}

    def get(key, default=None):
        used.add(key)
        value = c.get(key, default)
        if value is None:
            raise error(f"{key} = null: must be set")
        return value

    for key, ok, rule in (
        ("hidden_act", lambda v: v == "silu", "GPT-OSS's experts are its clamped SwiGLU"),
        ("attention_dropout", lambda v: not v, "attention dropout is not implemented"),
        ("attention_bias", lambda v: v is True, "GPT-OSS has biases on q, k, v and o_proj"),
        ("quantization_config", _mxfp4, "titan_fold reads MXFP4 experts (quant_method mxfp4) or unquantized ones"),
    ):
        used.add(key)
        if key in c and not ok(c[key]):
            raise error(f"{key} = {c[key]!r}: {rule}")
    n_layers = get("num_hidden_layers")
    layer_types = tuple(
        get("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)])
    )
    if len(layer_types) != n_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise error(f"layer_types = {list(layer_types)}: {n_layers} of sliding_attention / full_attention")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "yarn")) not in ("yarn", "default"):
        raise error(f"rope_parameters = {rope!r}: GPT-OSS's RoPE is YaRN")
    theta = float(rope.get("rope_theta", c.get("rope_theta", 150000.0)))
    factor = float(rope.get("factor", 1.0)) if rope.get("rope_type", rope.get("type")) == "yarn" else 1.0
    if rope.get("attention_factor") not in (None, yarn_mscale(factor)):
        raise error(f"rope_parameters.attention_factor = {rope['attention_factor']}: titan_fold takes YaRN's own")
    args = GptOssArgs(
        dim=get("hidden_size"),
        n_layers=n_layers,
        n_heads=get("num_attention_heads"),
        n_kv_heads=get("num_key_value_heads"),
        head_dim=get("head_dim", c.get("hidden_size", 0) // max(c.get("num_attention_heads", 1), 1)),
        vocab_size=get("vocab_size"),
        norm_eps=float(get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_factor=factor,
        original_max_seq_len=int(rope.get("original_max_position_embeddings", 4096)),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        rope_truncate=bool(rope.get("truncate", True)),
        qkv_bias=True,
        out_bias=True,
        max_seq_len=get("max_position_embeddings"),
        attention_sinks=True,
        sliding_window=get("sliding_window", 128),
        layer_types=layer_types,
        ffn_dim=get("intermediate_size"),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        moe=MoEArgs(
            num_experts=get("num_local_experts"),
            top_k=get("num_experts_per_tok", c.get("experts_per_token")),
            moe_ffn_dim=get("intermediate_size"),
            score_func="softmax",
            norm_topk_prob=True,
            aux_loss_coeff=float(get("router_aux_loss_coef", 1e-3)),
            activation=ExpertActivation(
                "clamped_swiglu", alpha=float(c.get("swiglu_alpha", 1.702)), limit=float(get("swiglu_limit", 7.0))
            ),
            expert_biases=True,
            router_bias=True,
        ),
    )
    unknown = sorted(set(c) - used)
    if unknown:
        print(f"warning: config.json fields titan_fold does not read: {', '.join(unknown)}", file=sys.stderr)
    return args


def _mxfp4(q) -> bool:
    return not q or (isinstance(q, dict) and q.get("quant_method") == "mxfp4")


def _rope_parameters(args: GptOssArgs) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": args.rope_theta,
        "factor": args.rope_factor,
        "beta_fast": args.beta_fast,
        "beta_slow": args.beta_slow,
        "truncate": args.rope_truncate,
        "original_max_position_embeddings": args.original_max_seq_len,
    }


def gpt_oss_compared(args: GptOssArgs) -> dict[str, Any]:
    """The computation-changing values of a GPT-OSS model, under their HF names."""
    moe = args.moe
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": _rope_parameters(args),
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types),
        "tie_word_embeddings": args.tie_embeddings,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "intermediate_size": moe.moe_ffn_dim,
        "swiglu_alpha": moe.activation.alpha,
        "swiglu_limit": moe.activation.limit,
    }


def gpt_oss_hf_config(args: GptOssArgs, need) -> dict[str, Any]:
    """config.json fields of GptOssForCausalLM for args (need(ok, what) refuses what HF cannot hold)."""
    moe = args.moe
    need(args.qkv_bias and args.out_bias and args.attention_sinks, "has attention biases and sinks")
    need(moe.activation.name == "clamped_swiglu" and moe.expert_biases and moe.router_bias, "has its clamped SwiGLU")
    need(moe.score_func == "softmax" and moe.norm_topk_prob and not moe.shared_ffn_dim, "routes by softmax top-k")
    compared = gpt_oss_compared(args)
    return {
        **compared,
        "rope_theta": args.rope_theta,
        "rope_scaling": compared["rope_parameters"],
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "initializer_range": 0.02,
        "use_cache": True,
    }
