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

import re
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

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
            if name.startswith("linear_attn."):
                native.update({ours + k: v for k, v in self._gdn_from_hf(name, value).items()})
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

    def _gdn_from_hf(self, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
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
            names = ("wq", "wk", "wv", "wz")
        elif short == "in_proj_ba.weight":
            parts, names = grouped.split([r, r], 1), ("wb", "wa")
        else:
            return {f"linear_attn.{short}": value}  # unknown: the base adapter names it in its error
        return {f"attention.{n}.weight": p.flatten(0, 1) for n, p in zip(names, parts, strict=True)}

    def model_view_of_hf_shapes(self, shapes: dict[str, Any]) -> dict[str, Any]:
        """An HF folder's {key: shape} as this model reads it (skipped tensors left out)."""
        return {k: s for k, s in shapes.items() if not k.startswith(tuple(SKIPPED_PREFIXES))}


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
