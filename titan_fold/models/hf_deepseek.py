"""Hugging Face DeepseekV3ForCausalLM <-> titan_fold's deepseek_v3: tensor names, config.json, FP8.

    HF (inside model.layers.{i}.)                         ours (inside layers.{i}.)
    self_attn.q_proj.weight           (no q LoRA)          attention.wq.weight
    self_attn.q_a_proj / q_a_layernorm / q_b_proj          attention.wq_a / q_a_norm / wq_b
    self_attn.kv_a_proj_with_mqa.weight [kv_lora + rope, dim]  rows split: attention.wkv_a [kv_lora, dim],
                                                           attention.wk_rope [rope, dim]
    self_attn.kv_a_layernorm / kv_b_proj / o_proj          attention.kv_a_norm / wkv_b / wo
    mlp.gate.weight, mlp.gate.e_score_correction_bias      moe.router.gate.weight, moe.router.expert_bias
    mlp.experts.{e}.{gate,up,down}_proj.weight             moe.experts.w13 (gate, up) / w2 (stacked)
    mlp.shared_experts.{gate,up,down}_proj.weight          moe.shared_expert.w1 / w3 / w2
    mlp.{gate,up,down}_proj.weight    (dense layers)       feed_forward.w1 / w3 / w2

The published checkpoints add the Multi-Token Prediction layer as model.layers.{n_layers + k}:
its block under the same names, plus enorm, hnorm, eh_proj, shared_head.norm (ours:
mtp.layers.{k}.{enorm, hnorm, eh_proj, norm}, the block as mtp.layers.{k}.block) and copies
of the embedding and head (embed_tokens, shared_head.head), which titan_fold shares with the
main model: import reads the main ones, export writes the copies. With mtp_layers = 0 those
tensors are reported and skipped.

FP8: the published safetensors hold float8_e4m3fn weights with a `weight_scale_inv` [ceil(rows
/ 128), ceil(cols / 128)] per 128 x 128 block; import dequantizes them (weight * scale of its
block) into bfloat16. Export writes what the model holds (bfloat16 with `--dtype bfloat16`).
"""

import math
import re
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_fold.models.deepseek_v3 import DeepSeekV3Args
from titan_fold.moe import MoEArgs

FP8_BLOCK = 128
SCALE_SUFFIX = ".weight_scale_inv"

# ours (inside layers.{i}.) -> HF (inside model.layers.{i}.), besides the shared _LAYER names
MLA_LAYER = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
}
KV_A = "self_attn.kv_a_proj_with_mqa.weight"
# the MTP layer's own modules: ours (inside mtp.layers.{k}.) -> HF (inside model.layers.{n + k}.)
MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """float8 weight [rows, cols] * its 128 x 128 block's scale_inv [ceil(rows/128), ceil(cols/128)]."""
    rows, cols = weight.shape
    want = (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv {list(scale_inv.shape)} for a weight {[rows, cols]}: expected {list(want)}")
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek publishes: per 128 x 128 block, scale_inv = amax / 448 (e4m3's max)."""
    rows, cols = weight.shape
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max  # [br, bc]
    q = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_state_dict(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every fp8 `X.weight` with its `X.weight_scale_inv` -> a bfloat16 `X.weight`; the rest as is."""
    out = {}
    for key, value in hf.items():
        if key.endswith(SCALE_SUFFIX):
            continue
        scale = hf.get(key[: -len(".weight")] + SCALE_SUFFIX) if key.endswith(".weight") else None
        if scale is not None:
            value = dequantize_fp8(value, scale)
        elif value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{key}: a float8 tensor without {SCALE_SUFFIX}")
        out[key] = value
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class DeepSeekV3Names:
    """The DeepSeek-specific renames around MoEStateDictAdapter (hf_adapter.py): MLA, the split
    kv_a projection, MTP layers, FP8 scales."""

    def __init__(self, args: DeepSeekV3Args, layouts: dict[str, tuple] | None = None):
        self.args = args
        self.n = args.n_layers
        # (mesh, placements) of our DTensor wkv_a / wk_rope, seen by native_to_hf: hf_to_native cuts
        # each rank's piece back out of the whole rows it reads
        self.layouts = {} if layouts is None else layouts

    def mtp_layer(self, hf_index: int) -> int | None:
        """k of an HF layer index that is an MTP layer, else None."""
        return hf_index - self.n if hf_index >= self.n else None

    # ---- ours -> HF
    def native_to_hf(self, state_dict: dict[str, Any], base_to_hf) -> dict[str, Any]:
        """base_to_hf: the generic adapter's to_hf (embedding, norms, dense FFN, router, experts)."""
        main, hf = {}, {}
        kv_parts: dict[str, dict[str, Any]] = {}
        for key, value in state_dict.items():
            m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", key)
            if m is not None:
                k, rest = int(m.group(1)), m.group(2)
                if rest in MTP_OWN:
                    hf[f"model.layers.{self.n + k}.{MTP_OWN[rest]}"] = value
                    continue
                key = f"layers.{self.n + k}.{rest.removeprefix('block.')}"
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
            if m is not None and m.group(2) in MLA_LAYER:
                hf[f"model.layers.{m.group(1)}.{MLA_LAYER[m.group(2)]}"] = value
            elif m is not None and m.group(2) in ("attention.wkv_a.weight", "attention.wk_rope.weight"):
                if isinstance(value, DTensor):
                    self.layouts[key] = (value.device_mesh, value.placements)
                kv_parts.setdefault(m.group(1), {})[m.group(2)] = value
            else:
                main[key] = value
        for i, parts in kv_parts.items():
            # [kv_lora_rank + rope, dim]: the latent rows first, as HF splits them
            hf[f"model.layers.{i}.{KV_A}"] = torch.cat(
                [_full(parts["attention.wkv_a.weight"]), _full(parts["attention.wk_rope.weight"])]
            )
        hf.update(base_to_hf(main))
        for k in range(self.args.mtp_layers):
            for hf_name, ours in MTP_COPIES.items():
                if f"model.layers.{self.n + k}.eh_proj.weight" in hf and ours in state_dict:
                    # a copy: safetensors refuses tensors that share memory
                    hf[f"model.layers.{self.n + k}.{hf_name}"] = _full(state_dict[ours]).clone()
        return hf

    # ---- HF -> ours
    def hf_to_native(self, hf: dict[str, Any], base_from_hf) -> dict[str, Any]:
        hf = dequantize_state_dict(hf)
        native, rest = {}, {}
        skipped: list[str] = []
        for key, value in hf.items():
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
            if m is None:
                rest[key] = value
                continue
            i, name = int(m.group(1)), m.group(2)
            k = self.mtp_layer(i)
            if k is not None and k >= self.args.mtp_layers:
                skipped.append(key)
                continue
            if k is not None:
                if name in MTP_COPIES:
                    continue  # the main model's embedding and head
                own = {v: o for o, v in MTP_OWN.items()}.get(name)
                if own is not None:
                    native[f"mtp.layers.{k}.{own}"] = value
                    continue
            if name == KV_A:
                latent = value[: self.args.kv_lora_rank]
                rope = value[self.args.kv_lora_rank :]
                native[f"layers.{i}.attention.wkv_a.weight"], native[f"layers.{i}.attention.wk_rope.weight"] = (
                    latent,
                    rope,
                )
                continue
            mla = {v: o for o, v in MLA_LAYER.items()}.get(name)
            if mla is not None:
                native[f"layers.{i}.{mla}"] = value
                continue
            rest[key] = value
        if skipped:
            layers = sorted({int(k.split(".")[2]) for k in skipped})
            print(
                f"note: skipped {len(skipped)} tensors of the Multi-Token Prediction layer(s) "
                f"{', '.join(f'model.layers.{i}' for i in layers)} (set mtp.num_layers to import them)",
                file=sys.stderr,
            )
        native.update(base_from_hf(rest))
        for key, (mesh, placements) in self.layouts.items():
            if key in native:  # every rank read the whole rows: cut out its own piece, no communication
                native[key] = distribute_tensor(native[key].contiguous(), mesh, placements, src_data_rank=None)
        # MTP blocks were named as layers n + k: move them under mtp.layers.{k}.block
        moved = {}
        for key, value in native.items():
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
            if m is not None and int(m.group(1)) >= self.n:
                moved[f"mtp.layers.{int(m.group(1)) - self.n}.block.{m.group(2)}"] = value
            else:
                moved[key] = value
        return moved

    def model_view_of_hf_shapes(self, shapes: dict[str, Any]) -> dict[str, Any]:
        """An HF folder's {key: shape} as this model reads it (no scales, no skipped MTP layers)."""
        out = {}
        for key, shape in shapes.items():
            if key.endswith(SCALE_SUFFIX):
                continue
            m = re.fullmatch(r"model\.layers\.(\d+)\..+", key)
            if m is not None and (k := self.mtp_layer(int(m.group(1)))) is not None and k >= self.args.mtp_layers:
                continue
            out[key] = shape
        return out


# ---------------------------------------------------------------- config.json

# transformers' DeepseekV3Config defaults, for fields a config.json leaves out
HF_DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
# fields of DeepSeek's own (remote-code) config.json that transformers does not read
INERT = {
    "num_nextn_predict_layers",
    "num_mtp_layers",
    "topk_method",
    "scoring_func",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "moe_layer_freq",
    "num_local_experts",
    "head_dim",
    "qk_head_dim",
    # MLA builds a key per head from the latent whatever it says (transformers' default is 128
    # for any head count; its SDPA attention gives the same result)
    "num_key_value_heads",
}
YARN_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "partial_rotary_factor",
}


def deepseek_args_from_hf_config(c: dict, inert: set, error) -> DeepSeekV3Args:
    """DeepSeekV3Args of a DeepSeek-V3 config.json (dict). error(message) builds the exception
    raised (hf_adapter's HFConfigError); each names the field and the rule."""
    used = set(inert) | INERT

    def get(key):
        used.add(key)
        value = c.get(key, HF_DEFAULTS.get(key))
        if value is None and key != "q_lora_rank":
            raise error(f"{key} = null: must be set")
        return value

    def need(ok: bool, key: str, rule: str):
        if not ok:
            raise error(f"{key} = {c.get(key, HF_DEFAULTS.get(key))!r}: {rule}")

    for key, ok, rule in (
        ("hidden_act", lambda v: v == "silu", "titan_fold's FFNs are SwiGLU (silu)"),
        ("attention_dropout", lambda v: not v, "attention dropout is not implemented"),
        ("attention_bias", lambda v: not v, "biases on the attention projections are not implemented"),
        ("pretraining_tp", lambda v: v in (None, 1), "not supported"),
        ("quantization_config", _fp8_quantization, "titan_fold reads fp8 e4m3 with 128 x 128 weight blocks only"),
    ):
        used.add(key)
        if key in c and not ok(c[key]):
            raise error(f"{key} = {c[key]!r}: {rule}")
    heads = get("num_attention_heads")
    q_lora = get("q_lora_rank")
    need(
        q_lora is None or (isinstance(q_lora, int) and q_lora >= 1),
        "q_lora_rank",
        "must be >= 1, or null for no q LoRA",
    )
    experts, groups, group_topk, top_k = (
        get("n_routed_experts"),
        get("n_group"),
        get("topk_group"),
        get("num_experts_per_tok"),
    )
    need(isinstance(experts, int) and experts >= 1, "n_routed_experts", "must be >= 1")
    need(
        isinstance(groups, int) and groups >= 1 and experts % groups == 0,
        "n_group",
        f"must divide n_routed_experts = {experts}",
    )
    need(isinstance(group_topk, int) and 1 <= group_topk <= groups, "topk_group", f"must be in [1, n_group = {groups}]")
    need(
        isinstance(top_k, int) and 1 <= top_k <= group_topk * (experts // groups),
        "num_experts_per_tok",
        f"must be in [1, topk_group x experts per group = {group_topk * (experts // groups)}]",
    )
    moe_ffn, n_shared = get("moe_intermediate_size"), get("n_shared_experts")
    n_layers = get("num_hidden_layers")
    first_dense = get("first_k_dense_replace")
    need(isinstance(first_dense, int) and first_dense >= 0, "first_k_dense_replace", "must be an integer >= 0")
    rope = _rope(c, used, error)
    args = DeepSeekV3Args(
        dim=get("hidden_size"),
        n_layers=n_layers,
        n_heads=heads,
        vocab_size=get("vocab_size"),
        norm_eps=float(get("rms_norm_eps")),
        max_seq_len=get("max_position_embeddings"),
        ffn_dim=get("intermediate_size"),
        first_k_dense=first_dense,
        tie_embeddings=bool(get("tie_word_embeddings")),
        q_lora_rank=q_lora,
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        rope_interleave=bool(get("rope_interleave")),
        **rope,
        moe=MoEArgs(
            num_experts=experts,
            top_k=top_k,
            moe_ffn_dim=moe_ffn,
            shared_ffn_dim=n_shared * moe_ffn,
            score_func="sigmoid",
            norm_topk_prob=bool(get("norm_topk_prob")),
            num_groups=groups,
            group_topk=group_topk,
            routed_scaling_factor=float(get("routed_scaling_factor")),
            load_balance="aux_free",
        ),
    )
    unknown = sorted(set(c) - used)
    if unknown:
        print(f"warning: config.json fields titan_fold does not read: {', '.join(unknown)}", file=sys.stderr)
    return args


def _fp8_quantization(q) -> bool:
    if not q:
        return True
    return (
        isinstance(q, dict)
        and q.get("quant_method") == "fp8"
        and q.get("fmt", "e4m3") == "e4m3"
        and list(q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])) == [FP8_BLOCK, FP8_BLOCK]
    )


def _rope(c: dict, used: set, error) -> dict:
    """DeepSeekV3Args' RoPE fields from rope_theta + rope_scaling (transformers 4) or rope_parameters (5)."""
    used.update({"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor"})
    theta = c.get("rope_theta")
    chosen, where = None, None
    for key in ("rope_parameters", "rope_scaling"):
        value = c.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise error(f"{key} = {value!r}: expected a JSON object")
        if chosen is None:
            chosen, where = value, key
    chosen = chosen or {}
    if "rope_theta" in chosen:
        if theta is not None and float(theta) != float(chosen["rope_theta"]):
            raise error(f"rope_theta = {theta} and {where}.rope_theta = {chosen['rope_theta']} disagree")
        theta = chosen["rope_theta"]
    theta = float(theta if theta is not None else HF_DEFAULTS["rope_theta"])
    kind = chosen.get("rope_type", chosen.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise error(f"{where}.rope_type = {kind!r}: titan_fold implements 'default' and 'yarn' RoPE")
    unknown = sorted(set(chosen) - YARN_KEYS)
    if unknown:
        raise error(
            f"{where}.{unknown[0]}: not a RoPE field titan_fold reads (it reads {', '.join(sorted(YARN_KEYS))})"
        )
    for key, value in (
        ("partial_rotary_factor", chosen.get("partial_rotary_factor", 1.0)),
        ("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)),
    ):
        if value != 1.0:
            raise error(f"{key} = {value}: titan_fold rotates the whole qk_rope_head_dim")
    if kind == "default":
        return dict(rope_theta=theta, rope_type="default")
    original = chosen.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 1:
        raise error(f"{where}.original_max_position_embeddings = {original!r}: YaRN needs it (an integer >= 1)")
    factor = chosen.get("factor")
    if factor is None:  # transformers' rule
        factor = c.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]) / original
    return dict(
        rope_theta=theta,
        rope_type="yarn",
        rope_factor=float(factor),
        original_max_seq_len=original,
        beta_fast=float(chosen.get("beta_fast") or 32),
        beta_slow=float(chosen.get("beta_slow") or 1),
        mscale=float(chosen.get("mscale") or 0.0),
        mscale_all_dim=float(chosen.get("mscale_all_dim") or 0.0),
        rope_truncate=bool(chosen.get("truncate", True)),
        yarn_attention_factor_override=chosen.get("attention_factor"),
    )


def deepseek_compared(args: DeepSeekV3Args) -> dict[str, Any]:
    """The computation-changing values of a deepseek_v3 model, under their HF names."""
    moe = args.moe
    values = {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": args.rope_interleave,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "first_k_dense_replace": [i for i in range(args.n_layers) if not args.is_moe_layer(i)],
        "intermediate_size": args.ffn_dim,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.moe_ffn_dim,
        "shared experts' width": moe.shared_ffn_dim,
        "shared expert gate": moe.shared_expert_gate,
        "router score function": moe.score_func,
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.num_groups,
        "topk_group": moe.group_topk,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "rope_type": args.rope_type,
    }
    if args.rope_type == "yarn":
        values.update(
            {
                "rope factor": args.rope_factor,
                "original_max_position_embeddings": args.original_max_seq_len,
                "beta_fast": args.beta_fast,
                "beta_slow": args.beta_slow,
                "mscale": args.mscale,
                "mscale_all_dim": args.mscale_all_dim,
                "attention_factor": args.yarn_attention_factor(),
                "truncate": args.rope_truncate,
            }
        )
    return values


def deepseek_hf_config(args: DeepSeekV3Args, need) -> dict:
    """config.json fields of DeepseekV3ForCausalLM with the same computation. need(ok, what) refuses."""
    moe = args.moe
    dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
    need(moe.score_func == "sigmoid", f"routes with sigmoid scores, the model has {moe.score_func!r}")
    need(dense == list(range(len(dense))), "has dense layers only first (first_k_dense_replace)")
    need(not moe.shared_expert_gate, "has no shared expert gate")
    need(moe.shared_ffn_dim % moe.moe_ffn_dim == 0, "has n_shared_experts x moe_intermediate_size shared expert width")
    rope: dict[str, Any] = {"rope_type": args.rope_type, "rope_theta": args.rope_theta}
    if args.rope_type == "yarn":
        rope.update(
            factor=args.rope_factor,
            original_max_position_embeddings=args.original_max_seq_len,
            beta_fast=args.beta_fast,
            beta_slow=args.beta_slow,
            mscale=args.mscale,
            mscale_all_dim=args.mscale_all_dim,
            truncate=args.rope_truncate,
        )
        if args.yarn_attention_factor_override is not None:
            rope["attention_factor"] = args.yarn_attention_factor_override
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "moe_intermediate_size": moe.moe_ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": moe.shared_ffn_dim // moe.moe_ffn_dim,
        "n_routed_experts": moe.num_experts,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "n_group": moe.num_groups,
        "topk_group": moe.group_topk,
        "num_experts_per_tok": moe.top_k,
        "first_k_dense_replace": len(dense),
        "norm_topk_prob": moe.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # transformers 4 reads rope_theta + rope_scaling, 5 rope_parameters
        "rope_theta": args.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if args.rope_type == "yarn" else None,
        "rope_parameters": rope,
        "rope_interleave": args.rope_interleave,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "num_nextn_predict_layers": args.mtp_layers,
        "initializer_range": 0.02,
        "use_cache": True,
    }
