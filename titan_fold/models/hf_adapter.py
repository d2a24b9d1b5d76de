"""Hugging Face <-> titan_fold: state dicts and config.json, for Qwen2-MoE, Qwen3-MoE and Mixtral.

The HF names are those of the checkpoints on the Hub (and of what transformers 5.x
`save_pretrained` writes, although it fuses experts in memory): one tensor per expert,

    Qwen2MoeForCausalLM   model.layers.{i}.mlp.gate.weight                     [E, dim]
                          model.layers.{i}.mlp.experts.{e}.gate_proj.weight    [ffn, dim]
                          ...up_proj.weight [ffn, dim], ...down_proj.weight    [dim, ffn]
                          model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight
                          model.layers.{i}.mlp.shared_expert_gate.weight       [1, dim]
    Qwen3MoeForCausalLM   as Qwen2-MoE without the shared expert, plus
                          model.layers.{i}.self_attn.{q,k}_norm.weight         [head_dim]
    MixtralForCausalLM    model.layers.{i}.block_sparse_moe.gate.weight        [E, dim]
                          model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3  [ffn, dim], w2 [dim, ffn]

while ours stacks them: moe.experts.w1 / w3 [E, ffn, dim], w2 [E, dim, ffn]
(gate_proj = w1, up_proj = w3, down_proj = w2). Attention (q/k/v/o_proj), norms,
embeddings and the head map one to one; RoPE is half-split on both sides, so wq / wk need
no permutation. A tied checkpoint has no lm_head.weight: our output head is the embedding.
The aux-free `router.expert_bias` has no HF counterpart: export drops it (and refuses
non-zero ones, which would route differently), import leaves it at its initial zeros.

Under expert parallelism the stacked weights are DTensors (ep x etp, FSDP over edp).
`to_hf` then hands out whole per-expert tensors (every rank gathers every expert: HF
import and export hold the routed experts of the whole model once per rank, fine up to
mid-size models; convert the biggest ones with `python -m titan_fold.hf` on one process
and resume the resulting DCP checkpoint under any layout), and `from_hf` cuts each rank's
shard back out of the stacked result with the parameter's own mesh and placements.

config.json: `args_from_hf_config` builds TransformerArgs from it (the `hf` flavor) and
rejects, by name, every field that would make titan_fold compute something else than
transformers (a RoPE scaling type, a sliding window that applies, another activation, ...);
`config_mismatches` lists the fields where a config and a model differ; `hf_config` writes
the config.json of a model.
"""

import json
import os
import re
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_fold.errors import UserError
from titan_fold.models.args import TransformerArgs
from titan_fold.models.hf_deepseek import (
    DeepSeekV3Names,
    deepseek_args_from_hf_config,
    deepseek_compared,
    deepseek_hf_config,
)
from titan_fold.moe import MoEArgs


class HFConfigError(UserError, ValueError):
    """A config.json titan_fold cannot build, or one that does not match the model."""


class HFKeyError(UserError, KeyError):
    """A tensor name the family does not have (another family, or a broken checkpoint)."""

    def __str__(self) -> str:
        return str(self.args[0])


# ours (inside layers.{i}.) -> HF (inside model.layers.{i}.), same for every family
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # dense layers (Qwen's mlp_only_layers / decoder_sparse_step; HF Mixtral has none)
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


class MoEStateDictAdapter(StateDictAdapter):
    """Family-specific names of the MoE block come from the subclass."""

    moe_prefix: str  # "mlp" or "block_sparse_moe"
    expert_names: dict[str, str]  # ours (w1, w2, w3) -> HF name of one expert's matrix
    moe_layer: dict[str, str]  # ours (inside moe.) -> HF (inside moe_prefix.), not routed experts

    def __init__(self, model_args: TransformerArgs, hf_assets_path: str | None = None):
        # no fqn_to_index_mapping: titan_fold writes HF folders itself (checkpoint.save_hf_folder)
        super().__init__(model_args, None)
        self.hf_assets_path = hf_assets_path
        self.model_args = model_args
        # mesh and placements of our DTensor expert weights, seen by to_hf, used by from_hf
        self._expert_layout: dict[str, tuple] = {}

    def _native_to_hf_key(self, key: str) -> str | None:
        if key in _TOP:
            return None if key == "output.weight" and self.model_args.tie_embeddings else _TOP[key]
        m = _LAYER_KEY.fullmatch(key)
        if m is None:
            raise HFKeyError(f"no Hugging Face name for {key!r}")
        i, rest = m.groups()
        if rest in _LAYER:
            return f"model.layers.{i}.{_LAYER[rest]}"
        if rest.startswith("moe."):
            inner = rest[len("moe.") :]
            if inner == "router.expert_bias" and inner not in self.moe_layer:
                return None
            if inner in self.moe_layer:
                return f"model.layers.{i}.{self.moe_prefix}.{self.moe_layer[inner]}"
        raise HFKeyError(f"no Hugging Face name for {key!r}")

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf = {}
        for key, value in state_dict.items():
            m = _LAYER_KEY.fullmatch(key)
            if m is not None and m.group(2) in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
                i, name = m.group(1), m.group(2).rsplit(".", 1)[1]
                if isinstance(value, DTensor):
                    self._expert_layout[key] = (value.device_mesh, value.placements)
                    value = value.full_tensor()  # [E, ...] on every rank
                for e in range(value.shape[0]):
                    hf[f"model.layers.{i}.{self.moe_prefix}.experts.{e}.{self.expert_names[name]}"] = value[e]
                continue
            hf_key = self._native_to_hf_key(key)
            if hf_key is not None:
                hf[hf_key] = value
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        inverse_layer = {v: k for k, v in _LAYER.items()}
        inverse_moe = {v: k for k, v in self.moe_layer.items()}
        inverse_expert = {v: k for k, v in self.expert_names.items()}
        inverse_top = {v: k for k, v in _TOP.items()}
        expert_re = re.compile(rf"{re.escape(self.moe_prefix)}\.experts\.(\d+)\.(.+)")
        native: dict[str, Any] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}  # our stacked key -> {e: matrix}
        for hf_key, value in hf_state_dict.items():
            if hf_key == "lm_head.weight" and self.model_args.tie_embeddings:
                continue  # some tied checkpoints store the head anyway; transformers ties it too
            top = inverse_top.get(hf_key)
            if top is not None:
                native[top] = value
                continue
            m = _HF_LAYER_KEY.fullmatch(hf_key)
            if m is None:
                raise HFKeyError(f"unknown Hugging Face key {hf_key!r} (another model family?)")
            i, rest = m.groups()
            e = expert_re.fullmatch(rest)
            if e is not None and e.group(2) in inverse_expert:
                experts.setdefault(f"layers.{i}.moe.experts.{inverse_expert[e.group(2)]}", {})[int(e.group(1))] = value
            elif rest in inverse_layer:
                native[f"layers.{i}.{inverse_layer[rest]}"] = value
            elif rest.startswith(self.moe_prefix + ".") and rest[len(self.moe_prefix) + 1 :] in inverse_moe:
                native[f"layers.{i}.moe.{inverse_moe[rest[len(self.moe_prefix) + 1:]]}"] = value
            else:
                raise HFKeyError(f"unknown Hugging Face key {hf_key!r} (another model family?)")
        for key, by_expert in experts.items():
            n = self.model_args.moe.num_experts
            if sorted(by_expert) != list(range(n)):
                raise HFConfigError(
                    f"{key}: the Hugging Face checkpoint has {len(by_expert)} experts ({sorted(by_expert)}), "
                    f"the model {n}: check --model.name / --model.flavor"
                )
            stacked = torch.stack([by_expert[e] for e in range(n)])  # [E, ...]
            if key in self._expert_layout:
                mesh, placements = self._expert_layout[key]
                # every rank holds the whole stack: cut out its own shard, no communication
                stacked = distribute_tensor(stacked, mesh, placements, src_data_rank=None)
            native[key] = stacked
        if self.model_args.tie_embeddings and "tok_embeddings.weight" in native:
            native["output.weight"] = native["tok_embeddings.weight"]
        return native

    def hf_shapes_for_model(self, shapes: dict[str, Any]) -> dict[str, Any]:
        """An HF folder's {key: shape} as from_hf reads it (keys it skips left out)."""
        return shapes


class Qwen2MoEStateDictAdapter(MoEStateDictAdapter):
    family = "qwen2_moe"
    moe_prefix = "mlp"
    expert_names = {"w1": "gate_proj.weight", "w3": "up_proj.weight", "w2": "down_proj.weight"}
    moe_layer = {
        "router.gate.weight": "gate.weight",
        "shared_expert.w1.weight": "shared_expert.gate_proj.weight",
        "shared_expert.w3.weight": "shared_expert.up_proj.weight",
        "shared_expert.w2.weight": "shared_expert.down_proj.weight",
        "shared_expert_gate.weight": "shared_expert_gate.weight",
    }


class Qwen3MoEStateDictAdapter(MoEStateDictAdapter):
    family = "qwen3_moe"
    moe_prefix = "mlp"
    expert_names = Qwen2MoEStateDictAdapter.expert_names
    moe_layer = {"router.gate.weight": "gate.weight"}


class MixtralStateDictAdapter(MoEStateDictAdapter):
    family = "mixtral"
    moe_prefix = "block_sparse_moe"
    expert_names = {"w1": "w1.weight", "w3": "w3.weight", "w2": "w2.weight"}
    moe_layer = {"router.gate.weight": "gate.weight"}


class DeepSeekV3StateDictAdapter(MoEStateDictAdapter):
    """MLA, MTP and FP8 names are models/hf_deepseek.py's; the aux-free bias is HF's
    e_score_correction_bias, so it is exported and imported."""

    family = "deepseek_v3"
    moe_prefix = "mlp"
    expert_names = Qwen2MoEStateDictAdapter.expert_names
    moe_layer = {
        "router.gate.weight": "gate.weight",
        "router.expert_bias": "gate.e_score_correction_bias",
        "shared_expert.w1.weight": "shared_experts.gate_proj.weight",
        "shared_expert.w3.weight": "shared_experts.up_proj.weight",
        "shared_expert.w2.weight": "shared_experts.down_proj.weight",
    }
    exports_expert_bias = True

    def __init__(self, model_args: TransformerArgs, hf_assets_path: str | None = None):
        super().__init__(model_args, hf_assets_path)
        self._mla_layout: dict[str, tuple] = {}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return DeepSeekV3Names(self.model_args, self._mla_layout).native_to_hf(state_dict, super().to_hf)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return DeepSeekV3Names(self.model_args, self._mla_layout).hf_to_native(hf_state_dict, super().from_hf)

    def hf_shapes_for_model(self, shapes: dict[str, Any]) -> dict[str, Any]:
        return DeepSeekV3Names(self.model_args).model_view_of_hf_shapes(shapes)

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if not from_quantized:
            return super().get_hf_storage_reader(path)
        from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

        return QuantizedHuggingFaceStorageReader(path=path, target_dtype=torch.float32, block_size=128)


ADAPTERS = {
    "qwen2_moe": Qwen2MoEStateDictAdapter,
    "qwen3_moe": Qwen3MoEStateDictAdapter,
    "mixtral": MixtralStateDictAdapter,
    "deepseek_v3": DeepSeekV3StateDictAdapter,
}
ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
# transformers' default rope_theta when a config.json has none
_DEFAULT_ROPE_THETA = {"qwen2_moe": 10000.0, "qwen3_moe": 10000.0, "mixtral": 1e6}

# fields that do not change what the model computes from its weights (generation, caching,
# initialization, bookkeeping): accepted and not compared
_INERT = {
    "architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "output_router_logits",
    "router_aux_loss_coef", "max_position_embeddings", "max_window_layers", "tokenizer_class", "auto_map",
    "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder",
    "is_encoder_decoder", "chunk_size_feed_forward", "problem_type", "num_labels", "generation_config",
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
        raise HFConfigError(f"partial_rotary_factor = {config['partial_rotary_factor']}: titan_fold rotates the whole head")
    theta = config.get("rope_theta")
    if params and "rope_theta" in params:
        if theta is not None and float(theta) != float(params["rope_theta"]):
            raise HFConfigError(f"rope_theta = {theta} and rope_parameters.rope_theta = {params['rope_theta']} disagree")
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
    if model_type not in ADAPTERS:
        raise HFConfigError(
            f"{where}: model_type = {model_type!r}; titan_fold builds {', '.join(sorted(ADAPTERS))}"
        )
    if name is not None and name != model_type:
        raise HFConfigError(f"{where}: model_type = {model_type!r} but --model.name is {name!r}")
    return model_type


def args_from_hf_config(config: dict | str, name: str | None = None) -> tuple[str, TransformerArgs]:
    """(family, TransformerArgs) of an HF config (a dict, a config.json, or the folder holding it).

    name: the family the caller expects (`[model] name`); None takes the config's model_type.
    Every field that changes the computation is either implemented or rejected by name;
    fields titan_fold does not know are listed on stderr (they are not silently dropped).
    """
    where = "config.json"
    if isinstance(config, str):
        where = config
        config = read_hf_config(config)
    family = _family_of(config, name, where)
    try:
        return family, _args_from_hf_config(family, config)
    except HFConfigError as e:
        raise HFConfigError(f"{where}: {e}") from None


def _args_from_hf_config(family: str, c: dict) -> TransformerArgs:
    if family == "deepseek_v3":
        return deepseek_args_from_hf_config(c, _INERT, HFConfigError)
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
    moe = dict(num_experts=num_experts, top_k=top_k, score_func="softmax",
               aux_loss_coeff=float(c.get("router_aux_loss_coef", 1e-3)))
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
                raise HFConfigError(f"shared_expert_intermediate_size = {shared}: must be >= 1 (HF Qwen2-MoE always has one)")
            args = TransformerArgs(**common, qkv_bias=bool(get("qkv_bias", True)), ffn_dim=ffn, dense_layers=dense,
                                   moe=MoEArgs(**moe, shared_ffn_dim=shared, shared_expert_gate=True))
        else:
            bias = bool(get("attention_bias", False))
            args = TransformerArgs(**common, qkv_bias=bias, out_bias=bias, qk_norm=True, ffn_dim=ffn,
                                   dense_layers=dense, moe=MoEArgs(**moe))
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
        "dense layers (mlp_only_layers, decoder_sparse_step)": [i for i in range(args.n_layers) if not args.is_moe_layer(i)],
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
    return [f"{k}: config.json {want.get(k)}, model {have.get(k)}" for k in want.keys() | have.keys()
            if want.get(k) != have.get(k)]


def check_hf_config(path: str, family: str, args: TransformerArgs) -> None:
    """Raise HFConfigError listing each field where `path`'s config.json and the model differ."""
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
        )


# ---------------------------------------------------------------- TransformerArgs -> config.json


def hf_config(family: str, args: TransformerArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of the HF model with the same computation (for export); dtype: the tensors'."""
    moe = args.moe

    def need(ok: bool, what: str):
        if not ok:
            raise HFConfigError(f"{family}: {ARCHITECTURES[family]} {what}; this model cannot be exported as one")

    dtype_name = str(dtype).removeprefix("torch.")
    if family == "deepseek_v3":
        return {"architectures": [ARCHITECTURES[family]], "model_type": family, **deepseek_hf_config(args, need),
                "torch_dtype": dtype_name, "dtype": dtype_name}
    need(moe.score_func == "softmax", f"routes with softmax scores, the model has {moe.score_func!r}")
    dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
    config = {
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
        config.update(num_local_experts=moe.num_experts, intermediate_size=moe.moe_ffn_dim, sliding_window=None,
                      router_jitter_noise=0.0)
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
