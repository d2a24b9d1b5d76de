"""Hugging Face <-> titan_fold state dicts, for Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen3.5-MoE, Qwen3-Next.

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

while ours stacks them: moe.experts.w13 [E, 2 * ffn, dim] with each expert's gate_proj and
up_proj rows alternating (row 2f gate, row 2f + 1 up: moe/experts.py), w2 [E, dim, ffn]
(down_proj). Attention (q/k/v/o_proj), norms,
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

config.json (reading it into TransformerArgs, checking it against a model, writing it): hf_config.py,
whose public names are re-exported here.
"""

import re
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_fold.common.errors import UserError
from titan_fold.models.args import TransformerArgs
from titan_fold.models.hf_config import (  # the config.json half, public here too
    ARCHITECTURES as ARCHITECTURES,
)
from titan_fold.models.hf_config import (
    HFConfigError as HFConfigError,
)
from titan_fold.models.hf_config import (
    args_from_hf_config as args_from_hf_config,
)
from titan_fold.models.hf_config import (
    check_dense_hf_config as check_dense_hf_config,
)
from titan_fold.models.hf_config import (
    check_hf_config as check_hf_config,
)
from titan_fold.models.hf_config import (
    config_mismatches as config_mismatches,
)
from titan_fold.models.hf_config import (
    hf_config as hf_config,
)
from titan_fold.models.hf_config import (
    read_hf_config as read_hf_config,
)
from titan_fold.models.hf_deepseek import (
    DeepSeekV3Names,
)
from titan_fold.models.hf_gpt_oss import GptOssNames, mxfp4_shapes
from titan_fold.models.hf_qwen35 import Qwen35Names, TextModelReader
from titan_fold.moe.experts import split_gate_up, stack_gate_up


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
    # one expert's matrices -> their HF names: w1 (gate), w3 (up), the halves of our w13, and w2 (down)
    expert_names: dict[str, str]
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
            if m is not None and m.group(2) in ("moe.experts.w13", "moe.experts.w2"):
                i, name = m.group(1), m.group(2).rsplit(".", 1)[1]
                if isinstance(value, DTensor):
                    self._expert_layout[key] = (value.device_mesh, value.placements)
                    value = value.full_tensor()  # [E, ...] on every rank
                # w13's halves are strided views, made contiguous below
                parts = dict(zip(("w1", "w3"), split_gate_up(value), strict=True)) if name == "w13" else {"w2": value}
                for ours, stacked in parts.items():
                    for e in range(stacked.shape[0]):
                        hf[f"model.layers.{i}.{self.moe_prefix}.experts.{e}.{self.expert_names[ours]}"] = stacked[
                            e
                        ].contiguous()
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
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, w1 / w2 / w3) -> {e: matrix}
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
                experts.setdefault((i, inverse_expert[e.group(2)]), {})[int(e.group(1))] = value
            elif rest in inverse_layer:
                native[f"layers.{i}.{inverse_layer[rest]}"] = value
            elif rest.startswith(self.moe_prefix + ".") and rest[len(self.moe_prefix) + 1 :] in inverse_moe:
                native[f"layers.{i}.moe.{inverse_moe[rest[len(self.moe_prefix) + 1 :]]}"] = value
            else:
                raise HFKeyError(f"unknown Hugging Face key {hf_key!r} (another model family?)")
        n = self.model_args.moe.num_experts
        stacks = {}  # (layer, w1 / w2 / w3) -> [E, ...]
        for (i, name), by_expert in experts.items():
            if sorted(by_expert) != list(range(n)):
                raise HFConfigError(
                    f"layers.{i}.moe.experts.{name} ({self.expert_names[name]}): the Hugging Face checkpoint has "
                    f"{len(by_expert)} experts ({sorted(by_expert)}), the model {n}: check --model.name / --model.flavor"
                )
            stacks[i, name] = torch.stack([by_expert[e] for e in range(n)])
        for i in sorted({i for i, _ in stacks}, key=int):
            found = {name for j, name in stacks if j == i}
            if found != {"w1", "w2", "w3"}:
                missing = [self.expert_names[name] for name in ("w1", "w2", "w3") if name not in found]
                raise HFConfigError(f"layer {i}: the Hugging Face checkpoint's experts lack {', '.join(missing)}")
            w13 = stack_gate_up(stacks[i, "w1"], stacks[i, "w3"])  # [E, 2 * ffn, dim]
            for name, stacked in (("w13", w13), ("w2", stacks[i, "w2"])):
                key = f"layers.{i}.moe.experts.{name}"
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


class Qwen35StateDictAdapter(MoEStateDictAdapter):
    """Qwen3.5-MoE: the MoE block's names are Qwen2-MoE's; the linear attention's and the
    vision-language checkpoint's prefixes are models/hf_qwen35.py's."""

    family = "qwen3_5_moe"
    moe_prefix = "mlp"
    expert_names = Qwen2MoEStateDictAdapter.expert_names
    moe_layer = Qwen2MoEStateDictAdapter.moe_layer

    def __init__(self, model_args: TransformerArgs, hf_assets_path: str | None = None):
        super().__init__(model_args, hf_assets_path)
        self._fused_layout: dict[str, tuple] = {}

    def _names(self) -> Qwen35Names:
        return Qwen35Names(self.model_args, self.family, self._fused_layout)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._names().native_to_hf(state_dict, super().to_hf)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._names().hf_to_native(hf_state_dict, super().from_hf)

    def hf_shapes_for_model(self, shapes: dict[str, Any]) -> dict[str, Any]:
        return self._names().model_view_of_hf_shapes(shapes)

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        return TextModelReader(path)


class Qwen3NextStateDictAdapter(Qwen35StateDictAdapter):
    family = "qwen3_next"


class GptOssStateDictAdapter(MoEStateDictAdapter):
    """Sinks, router and stacked expert names, and MXFP4 experts, are models/hf_gpt_oss.py's."""

    family = "gpt_oss"
    moe_prefix = "mlp"
    expert_names: dict[str, str] = {}  # stacked on both sides: GptOssNames moves them
    moe_layer: dict[str, str] = {}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return GptOssNames(self._expert_layout).native_to_hf(state_dict, super().to_hf)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return GptOssNames(self._expert_layout).hf_to_native(hf_state_dict, super().from_hf)

    def hf_shapes_for_model(self, shapes: dict[str, Any]) -> dict[str, Any]:
        return mxfp4_shapes(shapes)


ADAPTERS = {
    "qwen2_moe": Qwen2MoEStateDictAdapter,
    "qwen3_moe": Qwen3MoEStateDictAdapter,
    "mixtral": MixtralStateDictAdapter,
    "deepseek_v3": DeepSeekV3StateDictAdapter,
    "qwen3_5_moe": Qwen35StateDictAdapter,
    "qwen3_next": Qwen3NextStateDictAdapter,
    "gpt_oss": GptOssStateDictAdapter,
}
