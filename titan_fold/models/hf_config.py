"""Hugging Face config.json <-> titan_fold model args: `args_from_hf_config` builds TransformerArgs
from one (the `hf` flavor) and rejects, by name, every field that would make titan_fold compute
something else than transformers (a RoPE scaling type, a sliding window that applies, another
activation, ...); `config_mismatches` lists the fields where a config and a model differ;
`hf_config` writes the config.json of a model."""

import json
import math
import os
import sys
from typing import Any

import torch

from titan_fold.common.errors import UserError
from titan_fold.models.args import TransformerArgs
from titan_fold.models.hf_deepseek import (
    deepseek_args_from_hf_config,
    deepseek_compared,
    deepseek_hf_config,
)
from titan_fold.models.hf_gpt_oss import gpt_oss_args_from_hf_config, gpt_oss_compared, gpt_oss_hf_config
from titan_fold.models.hf_qwen35 import (
    FAMILY_OF as QWEN35_FAMILY_OF,
)
from titan_fold.models.hf_qwen35 import (
    qwen35_args_from_hf_config,
    qwen35_compared,
    qwen35_hf_config,
)
from titan_fold.moe import MoEArgs


class HFConfigError(UserError, ValueError):
    """A config.json titan_fold cannot build, or one that does not match the model."""


ARCHITECTURES = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# model_type -> family, where they differ (Qwen3.5's vision-language and text-only configs)
FAMILY_OF = {**{family: family for family in ARCHITECTURES}, **QWEN35_FAMILY_OF}
# transformers' default rope_theta when a config.json has none
_DEFAULT_ROPE_THETA = {"qwen2_moe": 10000.0, "qwen3_moe": 10000.0, "mixtral": 1e6}

# fields that do not change what the model computes from its weights (generation, caching,
# initialization, bookkeeping): accepted and not compared
_INERT = {
    "architectures",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "output_router_logits",
    "router_aux_loss_coef",
    "max_position_embeddings",
    "max_window_layers",
    "tokenizer_class",
    "auto_map",
    "id2label",
    "label2id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "tie_encoder_decoder",
    "is_encoder_decoder",
    "chunk_size_feed_forward",
    "problem_type",
    "num_labels",
    "generation_config",
}


# ---------------------------------------------------------------- config.json -> TransformerArgs


def read_hf_config(path: str) -> dict:
    """The dict of a config.json, given the file or the HF folder that holds it."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise HFConfigError(f"{file}: no such file (a Hugging Face checkpoint folder holds a config.json)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFConfigError(f"{file}: not a readable JSON config ({e})") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{file}: not a JSON object")
    return config


def _rope_theta(family: str, config: dict) -> float:
    """rope_theta of a config in either spelling (transformers 4: rope_theta + rope_scaling;
    5: rope_parameters), after rejecting every RoPE variant other than the plain one."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise HFConfigError(f"{key} = {value!r}: expected a JSON object")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise HFConfigError(f"{key}.rope_type = {kind!r}: titan_fold implements plain RoPE only ('default')")
        factor = value.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise HFConfigError(f"{key}.partial_rotary_factor = {factor}: titan_fold rotates the whole head")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(
            f"partial_rotary_factor = {config['partial_rotary_factor']}: titan_fold rotates the whole head"
        )
    theta = config.get("rope_theta")
    if params and "rope_theta" in params:
        if theta is not None and float(theta) != float(params["rope_theta"]):
            raise HFConfigError(
                f"rope_theta = {theta} and rope_parameters.rope_theta = {params['rope_theta']} disagree"
            )
        theta = params["rope_theta"]
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA[family])


def _check_sliding_window(family: str, c: dict, max_positions: int) -> None:
    """Refuse a sliding window where transformers would apply one: to some layer, with a
    window shorter than the positions the model takes (titan_fold attends causally to all)."""
    window = c.get("sliding_window")
    if not window or window >= max_positions:
        return
    where = f"sliding_window = {window} < max_position_embeddings = {max_positions}"
    if family == "mixtral":  # every layer, whenever set
        raise HFConfigError(f"{where}: sliding-window attention is not implemented")
    if not c.get("use_sliding_window"):
        return
    if family == "qwen3_moe":
        raise HFConfigError(f"use_sliding_window = true with {where}: sliding-window attention is not implemented")
    n = c.get("num_hidden_layers", 0)
    # Qwen2-MoE: transformers' layer_types, or its rule for them
    types = c.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < c.get("max_window_layers", 28) else "full_attention"
        for i in range(n)
    ]
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if sliding:
        raise HFConfigError(
            f"use_sliding_window = true with {where} (layer_types: layers {sliding} slide): "
            "sliding-window attention is not implemented"
        )


def hf_dense_layers(config: dict, n_layers: int) -> tuple[int, ...]:
    """Layers that HF Qwen builds dense: in mlp_only_layers, or not a multiple of decoder_sparse_step."""
    only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise HFConfigError(f"decoder_sparse_step = {step!r}: must be an integer >= 1")
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < n_layers for i in only):
        raise HFConfigError(f"mlp_only_layers = {only!r}: must list layer indices in [0, {n_layers})")
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step != 0)


def _family_of(config: dict, name: str | None, where: str) -> str:
    model_type = config.get("model_type")
    if model_type not in FAMILY_OF:
        raise HFConfigError(f"{where}: model_type = {model_type!r}; titan_fold builds {', '.join(sorted(FAMILY_OF))}")
    family = FAMILY_OF[model_type]
    if name is not None and name != family:
        raise HFConfigError(f"{where}: model_type = {model_type!r} but --model.name is {name!r}")
    return family


def _integer(low: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(ok):
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


# the type and range of every config.json field titan_fold reads (an absent or null field is
# not checked here: the family's reader knows its default)
HF_FIELDS = (
    *(
        (key, "an integer >= 1", _integer(1))
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_local_experts",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "max_position_embeddings",
            "decoder_sparse_step",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_group",
            "topk_group",
        )
    ),
    # sliding_window: Qwen2's configs write 0 beside use_sliding_window = false
    *(
        (key, "an integer >= 0", _integer(0))
        for key in (
            "intermediate_size",
            "n_shared_experts",
            "first_k_dense_replace",
            "qk_nope_head_dim",
            "sliding_window",
        )
    ),
    *(
        (key, "a number > 0", _number(lambda v: v > 0))
        for key in ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
    ),
    ("router_aux_loss_coef", "a number >= 0", _number(lambda v: v >= 0)),
    *(
        (key, "true or false", _is_bool)
        for key in (
            "norm_topk_prob",
            "tie_word_embeddings",
            "qkv_bias",
            "attention_bias",
            "use_sliding_window",
            "rope_interleave",
        )
    ),
)


def check_hf_fields(config: dict) -> None:
    """Each field of HF_FIELDS that config.json sets has its type and range."""
    for key, rule, ok in HF_FIELDS:
        if config.get(key) is not None and not ok(config[key]):
            raise HFConfigError(f"{key} = {config[key]!r}: must be {rule}")


def args_from_hf_config(config: dict | str, name: str | None = None) -> tuple[str, TransformerArgs]:
    """(family, TransformerArgs) of an HF config (a dict, a config.json, or the folder holding it).

    name: the family the caller expects (`[model] name`); None takes the config's model_type.
    Every field that changes the computation is either implemented or rejected by name;
    fields titan_fold does not know are listed on stderr (they are not silently dropped).
    """
    where = "config.json"
    if isinstance(config, str):
        where = os.path.join(config, "config.json") if os.path.isdir(config) else config
        config = read_hf_config(config)
    family = _family_of(config, name, where)
    try:
        check_hf_fields(config)
        return family, _args_from_hf_config(family, config)
    except HFConfigError as e:
        raise HFConfigError(f"{where}: {e}") from None


def _args_from_hf_config(family: str, c: dict) -> TransformerArgs:
    if family == "deepseek_v3":
        return deepseek_args_from_hf_config(c, _INERT, HFConfigError)
    if family in QWEN35_FAMILY_OF.values():
        return qwen35_args_from_hf_config(family, c, _INERT, HFConfigError, hf_dense_layers)
    if family == "gpt_oss":
        return gpt_oss_args_from_hf_config(c, _INERT, HFConfigError)
    used = set(_INERT)

    def get(key, default=KeyError, *aliases):
        used.add(key)
        used.update(aliases)
        for k in (key, *aliases):
            if k in c and c[k] is not None:
                return c[k]
        if default is KeyError:
            raise HFConfigError(f"{key} is missing")
        return default

    def reject(key, ok, rule):
        used.add(key)
        if key in c and not ok(c[key]):
            raise HFConfigError(f"{key} = {c[key]!r}: {rule}")

    reject("hidden_act", lambda v: v == "silu", "titan_fold's FFNs are SwiGLU (silu)")
    reject("attention_dropout", lambda v: not v, "attention dropout is not implemented")
    reject("quantization_config", lambda v: not v, "quantized checkpoints are not supported")
    reject("pretraining_tp", lambda v: v in (None, 1), "not supported")
    used.update({"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"})
    n_layers = get("num_hidden_layers")
    n_heads = get("num_attention_heads")
    dim = get("hidden_size")
    num_experts = get("num_experts", None, "num_local_experts")
    if not num_experts:
        raise HFConfigError(f"num_experts = {num_experts!r}: titan_fold's families are MoE models (>= 1 expert)")
    top_k = get("num_experts_per_tok")
    if not 1 <= top_k <= num_experts:
        raise HFConfigError(f"num_experts_per_tok = {top_k}: must be in [1, num_experts = {num_experts}]")
    common = dict(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", n_heads),
        head_dim=get("head_dim", dim // n_heads),
        vocab_size=get("vocab_size"),
        norm_eps=float(get("rms_norm_eps")),
        rope_theta=_rope_theta(family, c),
        max_seq_len=c.get("max_position_embeddings") or 4096,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
    )
    moe = dict(
        num_experts=num_experts,
        top_k=top_k,
        score_func="softmax",
        aux_loss_coeff=float(c.get("router_aux_loss_coef", 1e-3)),
    )
    _check_sliding_window(family, c, common["max_seq_len"])
    used.update({"sliding_window", "use_sliding_window", "layer_types"})
    if family == "mixtral":
        reject("router_jitter_noise", lambda v: not v, "router jitter is not implemented")
        ffn = get("intermediate_size")
        args = TransformerArgs(**common, ffn_dim=ffn, moe=MoEArgs(**moe, moe_ffn_dim=ffn, norm_topk_prob=True))
    else:
        moe.update(moe_ffn_dim=get("moe_intermediate_size"), norm_topk_prob=bool(get("norm_topk_prob", False)))
        dense = hf_dense_layers(c, n_layers)
        used.update({"mlp_only_layers", "decoder_sparse_step"})
        ffn = get("intermediate_size", 0 if not dense else KeyError)
        if family == "qwen2_moe":
            shared = get("shared_expert_intermediate_size")
            if shared < 1:
                raise HFConfigError(
                    f"shared_expert_intermediate_size = {shared}: must be >= 1 (HF Qwen2-MoE always has one)"
                )
            args = TransformerArgs(
                **common,
                qkv_bias=bool(get("qkv_bias", True)),
                ffn_dim=ffn,
                dense_layers=dense,
                moe=MoEArgs(**moe, shared_ffn_dim=shared, shared_expert_gate=True),
            )
        else:
            bias = bool(get("attention_bias", False))
            args = TransformerArgs(
                **common,
                qkv_bias=bias,
                out_bias=bias,
                qk_norm=True,
                ffn_dim=ffn,
                dense_layers=dense,
                moe=MoEArgs(**moe),
            )
    unknown = sorted(set(c) - used)
    if unknown:
        print(f"warning: config.json fields titan_fold does not read: {', '.join(unknown)}", file=sys.stderr)
    return args


# ---------------------------------------------------------------- comparison


def _sizes(args: TransformerArgs) -> dict[str, int]:
    """The model's widths and counts under their HF names (written to and compared with config.json)."""
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
    }


def _compared(family: str, args: TransformerArgs) -> dict[str, Any]:
    """The computation-changing values of a model, under their HF names."""
    if family == "deepseek_v3":
        return deepseek_compared(args)
    if family in QWEN35_FAMILY_OF.values():
        return qwen35_compared(family, args)
    if family == "gpt_oss":
        return gpt_oss_compared(args)
    moe = args.moe
    values = {
        **_sizes(args),
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.norm_topk_prob,
        "router score function": moe.score_func,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "qkv bias": args.qkv_bias,
        "o_proj bias": args.out_bias,
        "q/k norm": args.qk_norm,
        "dense layers (mlp_only_layers, decoder_sparse_step)": [
            i for i in range(args.n_layers) if not args.is_moe_layer(i)
        ],
        "moe_intermediate_size" if family != "mixtral" else "intermediate_size": moe.moe_ffn_dim,
        "shared_expert_intermediate_size": moe.shared_ffn_dim,
        "shared_expert_gate": moe.shared_expert_gate,
    }
    if values["dense layers (mlp_only_layers, decoder_sparse_step)"]:
        values["intermediate_size"] = args.ffn_dim  # width of the dense layers
    return values


def config_mismatches(config: dict, family: str, args: TransformerArgs) -> list[str]:
    """'field: config.json X, model Y' for every computation-changing field where they differ."""
    _, from_config = args_from_hf_config(config, family)
    want, have = _compared(family, from_config), _compared(family, args)
    return [
        f"{k}: config.json {want.get(k)}, model {have.get(k)}"
        for k in want.keys() | have.keys()
        if want.get(k) != have.get(k)
    ]


def check_hf_config(path: str, family: str, args: TransformerArgs, flavor: str = "hf") -> None:
    """Raise HFConfigError listing each field where `path`'s config.json and the model differ;
    for a packaged `flavor`, the line also points to the `hf` flavor, which fits any such folder."""
    config = read_hf_config(path)
    _family_of(config, family, path)
    try:
        mismatches = sorted(config_mismatches(config, family, args))
    except HFConfigError as e:
        raise HFConfigError(f"{path}: {e}") from None
    if mismatches:
        raise HFConfigError(
            f"{path}: config.json does not match the model ({len(mismatches)} fields); nothing was written: "
            + "; ".join(mismatches)
            + ("" if flavor == "hf" else "; --model.flavor hf takes the model's sizes from this config.json")
        )


# ---------------------------------------------------------------- TransformerArgs -> config.json


def hf_config(family: str, args: TransformerArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of the HF model with the same computation (for export); dtype: the tensors'."""
    moe = args.moe

    def need(ok: bool, what: str):
        if not ok:
            raise HFConfigError(f"{family}: {ARCHITECTURES[family]} {what}; this model cannot be exported as one")

    dtype_name = str(dtype).removeprefix("torch.")
    if family in ("deepseek_v3", "gpt_oss"):
        family_config = deepseek_hf_config if family == "deepseek_v3" else gpt_oss_hf_config
        return {
            "architectures": [ARCHITECTURES[family]],
            "model_type": family,
            **family_config(args, need),
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
    if family in QWEN35_FAMILY_OF.values():
        return {
            "architectures": [ARCHITECTURES[family]],
            **qwen35_hf_config(family, args, need),
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
    need(moe.score_func == "softmax", f"routes with softmax scores, the model has {moe.score_func!r}")
    dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        **_sizes(args),
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # transformers 4 reads rope_theta, 5 rope_parameters
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # transformers 4 reads torch_dtype, 5 dtype
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if family == "mixtral":
        need(moe.norm_topk_prob, "renormalizes the top-k weights (norm_topk_prob)")
        need(not moe.shared_ffn_dim, "has no shared expert")
        need(not (args.qkv_bias or args.out_bias or args.qk_norm), "has no attention biases and no q/k norm")
        need(not dense, "has no dense layers")
        config.update(
            num_local_experts=moe.num_experts,
            intermediate_size=moe.moe_ffn_dim,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
        return config
    config.update(
        num_experts=moe.num_experts,
        moe_intermediate_size=moe.moe_ffn_dim,
        norm_topk_prob=moe.norm_topk_prob,
        intermediate_size=args.ffn_dim,
        decoder_sparse_step=1,
        mlp_only_layers=dense,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=args.n_layers,
    )
    if family == "qwen2_moe":
        need(moe.shared_ffn_dim > 0 and moe.shared_expert_gate, "has a gated shared expert")
        need(not (args.out_bias or args.qk_norm), "has no o_proj bias and no q/k norm")
        config.update(shared_expert_intermediate_size=moe.shared_ffn_dim, qkv_bias=args.qkv_bias)
        return config
    need(args.qk_norm, "has q/k norms")
    need(not moe.shared_ffn_dim and not moe.shared_expert_gate, "has no shared expert")
    need(args.qkv_bias == args.out_bias, "has biases on all of q, k, v, o_proj or on none (attention_bias)")
    config.update(attention_bias=args.qkv_bias)
    return config


def check_dense_hf_config(path: str, dense: TransformerArgs) -> None:
    """A dense HF model (Qwen2, Qwen3, Mistral, Llama) to upcycle: the fields the MoE inherits
    from it must equal the dense twin of the MoE model (upcycle.dense_args)."""
    c = read_hf_config(path)
    if c.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{path}: hidden_act = {c['hidden_act']!r}: titan_fold's FFNs are SwiGLU (silu)")
    try:
        theta = _rope_theta("qwen2_moe", c)
    except HFConfigError as e:
        raise HFConfigError(f"{path}: {e}") from None
    heads = c.get("num_attention_heads")
    want = {
        "hidden_size": c.get("hidden_size"),
        "num_hidden_layers": c.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim") or (c.get("hidden_size") or 0) // (heads or 1),
        "vocab_size": c.get("vocab_size"),
        "intermediate_size": c.get("intermediate_size"),
        "rms_norm_eps": c.get("rms_norm_eps"),
        "rope_theta": theta,
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
    }
    have = {
        "hidden_size": dense.dim,
        "num_hidden_layers": dense.n_layers,
        "num_attention_heads": dense.n_heads,
        "num_key_value_heads": dense.n_kv_heads,
        "head_dim": dense.head_dim,
        "vocab_size": dense.vocab_size,
        "intermediate_size": dense.ffn_dim,
        "rms_norm_eps": dense.norm_eps,
        "rope_theta": dense.rope_theta,
        "tie_word_embeddings": dense.tie_embeddings,
    }
    wrong = [f"{k}: config.json {want[k]}, model {have[k]}" for k in want if want[k] != have[k]]
    if wrong:
        raise HFConfigError(
            f"{path}: the dense config.json does not fit the MoE model (intermediate_size = moe_intermediate_size "
            f"x granularity); nothing was written: " + "; ".join(wrong)
        )
