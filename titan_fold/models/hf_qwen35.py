"""Hugging Face Qwen3.5-MoE / Qwen3-Next <-> titan_fold's qwen3_5_moe / qwen3_next: tensor names.

    HF (inside model.layers.{i}.)                    ours (inside layers.{i}.)
    linear_attn.in_proj_qkv.weight  (Qwen3.5)        attention.wq / wk / wv (rows: q, k, v)
    linear_attn.in_proj_z / in_proj_b / in_proj_a    attention.wz / wb / wa
    linear_attn.in_proj_qkvz.weight (Qwen3-Next)     rows grouped by key head j: q_j, k_j, v_j, z_j
    linear_attn.in_proj_ba.weight   (Qwen3-Next)     rows grouped by key head j: b_j, a_j
    linear_attn.conv1d.weight [q|k|v channels, 1, K] attention.conv_q / conv_k / conv_v [channels, K]
    linear_attn.A_log, dt_bias                       attention.decay.A_log, dt_bias
    linear_attn.norm.weight, out_proj.weight         attention.norm.weight, attention.wo.weight
    self_attn.q_proj.weight [heads x (q | gate)]     attention.wq (the same rows: the output gate's layout)
    mlp.*                                            as Qwen2-MoE (hf_adapter.py)

Separate projections on our side let tensor parallelism shard each by heads (a fused one would
mix q, k and v rows on one rank). The Hub's Qwen3.5 checkpoints are the vision-language model:
its text tensors sit under model.language_model., read as model.; the vision tower (model.visual.)
and the Multi-Token Prediction layers (mtp.) are skipped on import with a note. Export writes the
text model (Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM), per-expert tensors as transformers
saves them; import also takes experts stacked as transformers holds them (experts.gate_up_proj,
experts.down_proj).
"""

import dataclasses
import re
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_fold.compat.distributed import HFStorageInfo, HFStorageReaderHooks

GDN_PLAIN = {
    "attention.decay.A_log": "linear_attn.A_log",
    "attention.decay.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
}
GDN_OUT = ("attention.wo.weight", "linear_attn.out_proj.weight")
# ours in a linear-attention layer that HF fuses into one tensor: gathered whole on export, cut
# back to this rank's piece on import
FUSED = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wz.weight",
    "attention.wb.weight",
    "attention.wa.weight",
    "attention.conv_q.weight",
    "attention.conv_k.weight",
    "attention.conv_v.weight",
)
SKIPPED_PREFIXES = {"model.visual.": "the vision tower", "mtp.": "the Multi-Token Prediction layers"}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class Qwen35Names:
    """The renames, splits and joins around MoEStateDictAdapter (hf_adapter.py) for one family."""

    def __init__(self, args, family: str, layouts: dict[str, tuple] | None = None):
        self.args = args
        self.next = family == "qwen3_next"  # Qwen3-Next fuses per key head (in_proj_qkvz, in_proj_ba)
        # (mesh, placements) of our DTensors that HF fuses, seen on export, used on import
        self.layouts = {} if layouts is None else layouts

    def _groups(self) -> tuple[int, int]:
        """(key heads, value heads per key head)."""
        a = self.args
        return a.linear_n_key_heads, a.linear_n_value_heads // a.linear_n_key_heads

    # ---- ours -> HF
    def native_to_hf(self, state_dict: dict[str, Any], base_to_hf) -> dict[str, Any]:
        main, hf = {}, {}
        layers: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state_dict.items():
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
            if m is None:
                main[key] = value
                continue
            i, rest = m.groups()
            linear = f"layers.{i}.attention.conv_q.weight" in state_dict
            if rest in FUSED and linear:
                if isinstance(value, DTensor):
                    self.layouts[key] = (value.device_mesh, value.placements)
                layers.setdefault(i, {})[rest] = _full(value)
            elif rest in GDN_PLAIN:
                hf[f"model.layers.{i}.{GDN_PLAIN[rest]}"] = value
            elif rest == GDN_OUT[0] and linear:
                hf[f"model.layers.{i}.{GDN_OUT[1]}"] = value
            else:
                main[key] = value
        for i, parts in layers.items():
            hf.update({f"model.layers.{i}.{k}": v for k, v in self._gdn_to_hf(parts).items()})
        hf.update(base_to_hf(main))
        return hf

    def _gdn_to_hf(self, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        conv = torch.cat([p["attention.conv_q.weight"], p["attention.conv_k.weight"], p["attention.conv_v.weight"]])
        out = {"linear_attn.conv1d.weight": conv.unsqueeze(1)}  # [channels, 1, K]
        q, k, v = p["attention.wq.weight"], p["attention.wk.weight"], p["attention.wv.weight"]
        z, b, a = p["attention.wz.weight"], p["attention.wb.weight"], p["attention.wa.weight"]
        if not self.next:
            out["linear_attn.in_proj_qkv.weight"] = torch.cat([q, k, v])
            out.update(
                {
                    "linear_attn.in_proj_z.weight": z,
                    "linear_attn.in_proj_b.weight": b,
                    "linear_attn.in_proj_a.weight": a,
                }
            )
            return out
        nk, _ = self._groups()
        dim = q.shape[-1]

        def by_key_head(*ws):  # each [nk * rows, dim] -> rows of key head j together
            return torch.cat([w.view(nk, -1, dim) for w in ws], 1).flatten(0, 1)

        out["linear_attn.in_proj_qkvz.weight"] = by_key_head(q, k, v, z)
        out["linear_attn.in_proj_ba.weight"] = by_key_head(b, a)
        return out

    # ---- HF -> ours
    def hf_to_native(self, hf: dict[str, Any], base_from_hf) -> dict[str, Any]:
        native, rest = {}, {}
        skipped: dict[str, int] = {}
        for key, value in hf.items():
            what = next((w for p, w in SKIPPED_PREFIXES.items() if key.startswith(p)), None)
            if what is not None:
                skipped[what] = skipped.get(what, 0) + 1
                continue
            key = key.replace("model.language_model.", "model.", 1)
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
            if m is None:
                rest[key] = value
                continue
            i, name = m.groups()
            ours = f"layers.{i}."
            if name.startswith("linear_attn.") and (parts := self._gdn_from_hf(name, value)) is not None:
                native.update({ours + k: v for k, v in parts.items()})
            elif name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                rest.update({f"model.layers.{i}.{k}": v for k, v in _unstack_experts(name, value).items()})
            else:
                rest[key] = value
        for what, n in skipped.items():
            print(f"note: skipped {n} tensors of {what} (titan_fold trains the text model)", file=sys.stderr)
        native.update(base_from_hf(rest))
        for key, (mesh, placements) in self.layouts.items():
            if key in native:  # every rank read the whole fused tensor: cut out its own piece
                native[key] = distribute_tensor(native[key].contiguous(), mesh, placements, src_data_rank=None)
        return native

    def _gdn_from_hf(self, name: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        a = self.args
        q_rows, v_rows = a.linear_n_key_heads * a.linear_key_head_dim, a.linear_n_value_heads * a.linear_value_head_dim
        inverse = {h.removeprefix("linear_attn."): o for o, h in GDN_PLAIN.items()}
        short = name.removeprefix("linear_attn.")
        if short in inverse:
            return {inverse[short]: value}
        if short == "out_proj.weight":
            return {GDN_OUT[0]: value}
        if short == "conv1d.weight":
            q, k, v = value.squeeze(1).split([q_rows, q_rows, v_rows])
            return {"attention.conv_q.weight": q, "attention.conv_k.weight": k, "attention.conv_v.weight": v}
        if short == "in_proj_qkv.weight":
            q, k, v = value.split([q_rows, q_rows, v_rows])
            return {"attention.wq.weight": q, "attention.wk.weight": k, "attention.wv.weight": v}
        if short in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
            return {f"attention.w{short[8]}.weight": value}
        nk, r = self._groups()
        grouped = value.view(nk, -1, value.shape[-1])
        if short == "in_proj_qkvz.weight":
            dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
            parts = grouped.split([dk, dk, r * dv, r * dv], 1)
            names: tuple[str, ...] = ("wq", "wk", "wv", "wz")
        elif short == "in_proj_ba.weight":
            parts, names = grouped.split([r, r], 1), ("wb", "wa")
        else:
            return None  # not a linear-attention tensor of this family
        return {f"attention.{n}.weight": p.flatten(0, 1) for n, p in zip(names, parts, strict=True)}

    def model_view_of_hf_shapes(self, shapes: dict[str, Any]) -> dict[str, Any]:
        """An HF folder's {key: shape} as this model reads it: skipped tensors left out, the text
        model's prefix model., stacked experts as per-expert tensors."""
        out = {}
        for key, shape in shapes.items():
            if key.startswith(tuple(SKIPPED_PREFIXES)):
                continue
            key = key.replace("model.language_model.", "model.", 1)
            m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", key)
            if m is None:
                out[key] = shape
                continue
            n, rows, cols = shape
            for e in range(n):
                if m.group(2) == "gate_up_proj":
                    out[f"{m.group(1)}.{e}.gate_proj.weight"] = out[f"{m.group(1)}.{e}.up_proj.weight"] = [
                        rows // 2,
                        cols,
                    ]
                else:
                    out[f"{m.group(1)}.{e}.down_proj.weight"] = [rows, cols]
        return out


TEXT_PREFIX = "model.language_model."


@dataclasses.dataclass
class _NamedStorageInfo(HFStorageInfo):
    name: str = ""  # the tensor's name in its safetensors file


class TextModelReader(HFStorageReaderHooks):
    """DCP's Hugging Face reader of a vision-language folder's text model under the text model's
    names (model.X for model.language_model.X), so the trainer's checkpoint.initial_load_in_hf
    reads the Hub's Qwen3.5 folders as they are; the vision tower and MTP tensors are not asked for."""

    def read_metadata(self):
        metadata = super().read_metadata()

        def text_name(fqn: str) -> str:
            return "model." + fqn.removeprefix(TEXT_PREFIX) if fqn.startswith(TEXT_PREFIX) else fqn

        metadata.state_dict_metadata = {text_name(k): v for k, v in metadata.state_dict_metadata.items()}
        metadata.storage_data = {
            dataclasses.replace(index, fqn=text_name(index.fqn)): _NamedStorageInfo(
                info.relative_path, info.shape, info.dtype, name=index.fqn
            )
            for index, info in metadata.storage_data.items()
        }
        return metadata

    def read_request(self, f, req, planner) -> None:
        name = self.storage_data[req.storage_index].name  # the file's own name of the tensor
        super().read_request(
            f, dataclasses.replace(req, storage_index=dataclasses.replace(req.storage_index, fqn=name)), planner
        )


def _unstack_experts(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' in-memory experts (gate_up_proj [E, 2 * ffn, dim]: gate rows, then up rows;
    down_proj [E, dim, ffn]) -> the per-expert tensors of a checkpoint."""
    out = {}
    for e in range(value.shape[0]):
        if name.endswith("gate_up_proj"):
            gate, up = value[e].chunk(2)
            out[f"mlp.experts.{e}.gate_proj.weight"], out[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        else:
            out[f"mlp.experts.{e}.down_proj.weight"] = value[e]
    return out


# ---------------------------------------------------------------- config.json

# model_type -> family; Qwen3.5's vision-language config nests the text model's under text_config
FAMILY_OF = {"qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}
# fields that do not change the text model's computation: the vision tower's, MTP's (dropped),
# and the multimodal rotary sections (text positions are the same on all three axes)
INERT = {
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings",
    "full_attention_interval",
}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


def text_config(c: dict) -> dict:
    """The text model's fields of a qwen3_5_moe (vision-language) config, else the config itself."""
    if c.get("model_type") == "qwen3_5_moe":
        inner = c.get("text_config")
        if not isinstance(inner, dict):
            raise ValueError("model_type = 'qwen3_5_moe' needs a text_config object")
        return {**inner, "tie_word_embeddings": c.get("tie_word_embeddings", inner.get("tie_word_embeddings", False))}
    return c


def qwen35_args_from_hf_config(family: str, config: dict, inert: set, error, dense_layers):
    """Qwen35Args of a qwen3_5_moe (either config) or qwen3_next config.json (dict). error(message)
    builds the exception raised (hf_config's HFConfigError); each names the field and the rule.
    dense_layers(config, n_layers): hf_config's reading of mlp_only_layers and decoder_sparse_step."""
    from titan_fold.models.qwen3_5 import Qwen35Args
    from titan_fold.moe import MoEArgs

    try:
        c = text_config(config)
    except ValueError as e:
        raise error(str(e)) from None
    used = (
        set(inert) | INERT | {"text_config", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"}
    )

    def get(key, default=KeyError):
        used.add(key)
        if c.get(key) is not None:
            return c[key]
        if default is KeyError:
            raise error(f"{key} is missing")
        return default

    def need(ok: bool, key: str, rule: str):
        if not ok:
            raise error(f"{key} = {c.get(key)!r}: {rule}")

    need(get("hidden_act", "silu") == "silu", "hidden_act", "titan_fold's FFNs are SwiGLU (silu)")
    need(not get("attention_dropout", 0.0), "attention_dropout", "attention dropout is not implemented")
    need(not get("attention_bias", False), "attention_bias", "biases on the gated attention are not implemented")
    need(not get("quantization_config", None), "quantization_config", "quantized checkpoints are not supported")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise error(f"rope_parameters = {rope!r}: expected a JSON object")
    if unknown := sorted(set(rope) - ROPE_KEYS):
        raise error(f"rope_parameters: {', '.join(unknown)}: titan_fold implements plain (partial) RoPE")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise error(f"rope_parameters.rope_type = {kind!r}: titan_fold implements plain RoPE only ('default')")
    n_layers, heads, dim = get("num_hidden_layers"), get("num_attention_heads"), get("hidden_size")
    layer_types = c.get("layer_types")
    if layer_types is None:
        interval = c.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    used.add("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise error(f"layer_types = {layer_types!r}: must list one type per layer ({n_layers})")
    if unknown := sorted(set(layer_types) - {"full_attention", "linear_attention"}):
        raise error(f"layer_types: {', '.join(map(repr, unknown))}: Qwen3.5 / Qwen3-Next layers are full or linear")
    num_experts, top_k = get("num_experts"), get("num_experts_per_tok")
    need(1 <= top_k <= num_experts, "num_experts_per_tok", f"must be in [1, num_experts = {num_experts}]")
    shared = get("shared_expert_intermediate_size")
    need(shared >= 1, "shared_expert_intermediate_size", "must be >= 1 (both families have a shared expert)")
    dense: tuple[int, ...] = ()
    ffn = 0
    if family == "qwen3_next":
        dense = dense_layers(c, n_layers)
        used.update({"mlp_only_layers", "decoder_sparse_step"})
        ffn = get("intermediate_size", 0 if not dense else KeyError)
    norm_topk = bool(get("norm_topk_prob", True)) if family == "qwen3_next" else True
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    args = Qwen35Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=get("num_key_value_heads", heads),
        head_dim=get("head_dim", 256),
        vocab_size=get("vocab_size"),
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        partial_rotary_factor=float(factor),
        max_seq_len=c.get("max_position_embeddings") or 4096,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        qk_norm=True,
        attention_output_gate=True,
        layer_types=tuple(layer_types),
        ffn_dim=ffn,
        dense_layers=dense,
        linear_n_key_heads=get("linear_num_key_heads", 16),
        linear_n_value_heads=get("linear_num_value_heads", 32),
        linear_key_head_dim=get("linear_key_head_dim", 128),
        linear_value_head_dim=get("linear_value_head_dim", 128),
        linear_conv_kernel=get("linear_conv_kernel_dim", 4),
        moe=MoEArgs(
            num_experts=num_experts,
            top_k=top_k,
            moe_ffn_dim=get("moe_intermediate_size"),
            shared_ffn_dim=shared,
            shared_expert_gate=True,
            score_func="softmax",
            norm_topk_prob=norm_topk,
            aux_loss_coeff=float(c.get("router_aux_loss_coef", 1e-3)),
        ),
    )
    unknown = sorted(set(c) - used)
    if unknown:
        print(f"warning: config.json fields titan_fold does not read: {', '.join(unknown)}", file=sys.stderr)
    if c.get("mtp_num_hidden_layers"):
        print(
            f"note: the checkpoint's {c['mtp_num_hidden_layers']} Multi-Token Prediction layer(s) are not imported",
            file=sys.stderr,
        )
    return args


def _shapes(args) -> dict[str, Any]:
    """The widths, layer kinds and expert counts of a qwen3_5_moe / qwen3_next model under their HF
    names: what config.json writes and a folder is compared on alike."""
    moe = args.moe
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "layer_types": list(args.layer_types),
        "linear_num_key_heads": args.linear_n_key_heads,
        "linear_num_value_heads": args.linear_n_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.moe_ffn_dim,
        "shared_expert_intermediate_size": moe.shared_ffn_dim,
    }


def qwen35_compared(family: str, args) -> dict[str, Any]:
    """The computation-changing values of a qwen3_5_moe / qwen3_next model, under their HF names."""
    moe = args.moe
    values = {
        **_shapes(args),
        "rope_theta": args.rope_theta,
        "partial_rotary_factor": args.partial_rotary_factor,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "shared_expert_gate": moe.shared_expert_gate,
        "norm_topk_prob": moe.norm_topk_prob,
        "router score function": moe.score_func,
        "dense layers (mlp_only_layers, decoder_sparse_step)": [
            i for i in range(args.n_layers) if not args.is_moe_layer(i)
        ],
    }
    if values["dense layers (mlp_only_layers, decoder_sparse_step)"]:
        values["intermediate_size"] = args.ffn_dim
    return values


def qwen35_hf_config(family: str, args, need) -> dict:
    """config.json fields of the text model (Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM) with the
    same computation. need(ok, what) refuses."""
    moe = args.moe
    dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
    need(moe.score_func == "softmax", f"routes with softmax scores, the model has {moe.score_func!r}")
    need(moe.shared_ffn_dim > 0 and moe.shared_expert_gate, "has a gated shared expert")
    if family == "qwen3_5_moe":
        need(moe.norm_topk_prob, "renormalizes the top-k weights")
        need(not dense, "has no dense layers")
    config = {
        "model_type": "qwen3_5_moe_text" if family == "qwen3_5_moe" else family,
        **_shapes(args),
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "qwen3_next":
        config.update(
            norm_topk_prob=moe.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            intermediate_size=args.ffn_dim,
        )
    return config
