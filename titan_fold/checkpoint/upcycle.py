"""Upcycling: a dense checkpoint becomes the starting point of an MoE model.

    python -m titan_fold.upcycle --dense DENSE --out OUT --model.name qwen2_moe --model.flavor debug \
        [--granularity G] [--router_std S] [--hf]

DENSE is a DCP checkpoint folder of a model whose layers use `feed_forward` (or, with
--hf, a Hugging Face Qwen2 / Qwen3 / Mistral safetensors folder, its config.json checked
against the MoE model); OUT is a model-only DCP checkpoint of the MoE model (a packaged
flavor, or `--model.flavor hf --model.hf_config PATH`), to start training from with
`--checkpoint.initial_load_path OUT`. Everything but the FFNs is copied as is. The dense
shapes are checked against the MoE model's (built on the meta device) before anything is
built or read; OUT must be new or empty.

Plain upcycling (G = 1, Komatsuzaki et al.): every expert of layer i is a copy of the
dense FFN of layer i. Granular upcycling (Megatron's --moe-upcycling-granularity G): the
FFN width is cut into G segments and every original copy becomes G finer experts, one per
segment; the flavor must have E = N * G experts of width ffn / G and top_k = k * G.

Why the MoE reproduces the dense model at step 0 (SwiGLU is element-wise over the width):

    FFN(x) = W2 (silu(W1 x) * W3 x) = sum_g W2[:, S_g] (silu(W1[S_g] x) * W3[S_g] x) = sum_g FFN_g(x)

with S_g the g-th block of ffn / G rows of W1, W3 (columns of W2). Fine expert (n, g),
index n * G + g, holds FFN_g with W2 scaled by s; the MoE computes sum_{chosen} p_j s FFN_j(x).

- Router rows: row (n, g) is a copy of a coarse row r_n (r_n ~ N(0, router_std)), so the G
  experts of copy n always score alike and top-(k G) picks whole copies: k copies, each
  with all G segments. Then every segment g is chosen exactly k times and, writing c_n for
  the common weight of copy n's experts, the output is s * (sum_{n chosen} c_n) * FFN(x).
- norm_topk_prob (Mixtral): the k G chosen weights sum to 1, so sum_n G c_n = 1 and
  s = G makes the output FFN(x) exactly, for any router weights.
- no renormalization (Qwen2-MoE softmax, or sigmoid): sum_n c_n depends on x unless the
  router is zero; with router_std = 0 every chosen weight is p0 = 1 / E (softmax) or
  1 / 2 (sigmoid), and with G = 1 s = 1 / (k p0) gives FFN(x) whatever k experts are
  picked (they are identical). But a zero router sends every token to the same k experts
  (top-k's tie-breaking), a degenerate start. The default router_std for these routers
  is therefore 0.01 / sqrt(dim): router logits of std ~0.01 (the FFN input is RMS-normed),
  so every chosen weight is p0 (1 + O(0.01)) and the MoE reproduces the dense model to
  about 1%, while the tokens spread over all experts. For G > 1 the copies' equal
  scores still pick whole copies, but the weights do not sum to a constant: refused.

A shared expert of the flavor (Qwen2-MoE) keeps its fresh initialization with its output
projection and gate zeroed, so it adds nothing at step 0 and learns from there.
"""

import argparse
import dataclasses
import math
import warnings

import torch

from titan_fold.common.errors import UserError
from titan_fold.models import Transformer, TransformerArgs
from titan_fold.moe.activation import ExpertActivation
from titan_fold.moe.experts import stack_gate_up


class UpcycleError(UserError, ValueError):
    pass


def default_router_std(args: TransformerArgs) -> float:
    """Exact for routers that renormalize the top-k, about 1% off otherwise (module docstring)."""
    return 0.02 if args.moe.norm_topk_prob else 0.01 / math.sqrt(args.dim)


def expert_scale(args: TransformerArgs, granularity: int, router_std: float) -> float:
    """s, the factor on each fine expert's W2 (module docstring)."""
    moe = args.moe
    if moe.norm_topk_prob:
        return float(granularity)
    if granularity != 1:
        raise UpcycleError(
            "upcycling a router without norm_topk_prob reproduces the dense model only with "
            "granularity 1 (see titan_fold/checkpoint/upcycle.py)"
        )
    p0 = 1.0 / moe.num_experts if moe.score_func == "softmax" else 0.5
    return 1.0 / (moe.top_k * p0)


def upcycle_state_dict(
    dense: dict[str, torch.Tensor],
    args: TransformerArgs,
    granularity: int = 1,
    router_std: float = 0.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """MoE model state dict (of `args`) from a dense one whose layers have feed_forward.w1/w2/w3."""
    moe, G = args.moe, granularity
    check_upcycle(args, G, router_std)
    scale = expert_scale(args, G, router_std)
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    out = model.state_dict()
    for key in out:
        if ".moe." not in key and key in dense:
            if dense[key].shape != out[key].shape:
                raise UpcycleError(f"{key}: dense {tuple(dense[key].shape)}, MoE flavor {tuple(out[key].shape)}")
            out[key] = dense[key].clone().to(out[key].dtype)
        elif ".moe." not in key:
            raise UpcycleError(f"{key}: not in the dense checkpoint")
    for i in range(args.n_layers):
        if not args.is_moe_layer(i):
            continue
        p = f"layers.{i}."
        w1, w2, w3 = (dense[f"{p}feed_forward.{w}.weight"] for w in ("w1", "w2", "w3"))  # [ffn, dim], [dim, ffn]
        ffn = w1.shape[0]
        if ffn != moe.moe_ffn_dim * G:
            raise UpcycleError(f"layer {i}: dense ffn width {ffn} != moe_ffn_dim {moe.moe_ffn_dim} x granularity {G}")
        copies = moe.num_experts // G
        seg = moe.moe_ffn_dim
        # expert n * G + g = segment g of copy n
        gate_up = stack_gate_up(w1.view(G, seg, -1), w3.view(G, seg, -1))  # [G, 2 seg, dim]
        out[f"{p}moe.experts.w13"] = gate_up.repeat(copies, 1, 1).clone()  # [E, 2 seg, dim]
        out[f"{p}moe.experts.w2"] = (
            (w2.view(-1, G, seg).transpose(0, 1) * scale).repeat(copies, 1, 1).clone()
        )  # [E, dim, seg]
        coarse = torch.randn(copies, args.dim) * router_std
        out[f"{p}moe.router.gate.weight"] = coarse.repeat_interleave(G, dim=0).to(w1.dtype)  # [E, dim]
        out[f"{p}moe.router.expert_bias"].zero_()
        if moe.shared_ffn_dim:
            out[f"{p}moe.shared_expert.w2.weight"].zero_()
        if moe.shared_expert_gate:
            out[f"{p}moe.shared_expert_gate.weight"].zero_()
    return out


def check_upcycle(args: TransformerArgs, granularity: int, router_std: float) -> None:
    """The refusals before any tensor is read: experts that are no copy of a dense FFN, the
    granularity, the router's std."""
    moe = args.moe
    if moe.activation != ExpertActivation() or moe.expert_biases:
        # the dense twin's FFN is plain SwiGLU without biases: copies of it would not be these experts
        raise UpcycleError(
            f"upcycling copies a plain SwiGLU FFN into every expert; this model's experts run "
            f"{moe.activation.name}{' with biases' if moe.expert_biases else ''} (GPT-OSS), which no dense model has"
        )
    if granularity < 1:
        raise UpcycleError(f"--granularity {granularity}: must be >= 1")
    if moe.num_experts % granularity or moe.top_k % granularity:
        raise UpcycleError(
            f"--granularity {granularity}: num_experts {moe.num_experts} and top_k {moe.top_k} must be multiples of it"
        )
    if not router_std >= 0:
        raise UpcycleError(f"--router_std {router_std}: must be >= 0")


def dense_args(args: TransformerArgs, granularity: int) -> TransformerArgs:
    """The dense model an MoE `args` upcycles from: every layer a SwiGLU of width moe_ffn_dim x G."""
    return dataclasses.replace(
        args, dense_layers=tuple(range(args.n_layers)), ffn_dim=args.moe.moe_ffn_dim * granularity
    )


def read_dense(path: str, hf: bool, family: str, args: TransformerArgs, granularity: int) -> dict[str, torch.Tensor]:
    """The dense state dict, its shapes (and, from HF, its config.json) checked against the
    dense twin of the MoE model before any tensor is read."""
    from titan_fold.checkpoint.files import compare_shapes, hf_shapes, read_hf_folder, read_model_tensors
    from titan_fold.models.hf_adapter import ADAPTERS, check_dense_hf_config

    dense = dense_args(args, granularity)
    with torch.device("meta"):
        wanted = {k: list(v.shape) for k, v in Transformer(dense).state_dict().items()}
    if dense.tie_embeddings:
        del wanted["output.weight"]
    if not hf:
        return read_model_tensors(path, wanted)
    check_dense_hf_config(path, dense)
    adapter = ADAPTERS[family](dense)
    meta = {k: torch.empty(shape, device="meta") for k, (shape, _) in hf_shapes(path).items()}
    saved = {k: list(v.shape) for k, v in adapter.from_hf(meta).items()}
    compare_shapes(f"Hugging Face checkpoint {path}", saved, wanted)
    extra = sorted(set(saved) - set(wanted) - {"output.weight"})
    if extra:  # e.g. qkv biases the MoE model has no place for
        raise UpcycleError(f"{path}: tensors the MoE model does not have: {', '.join(extra[:6])}")
    return adapter.from_hf(read_hf_folder(path))


def run(a: argparse.Namespace) -> None:
    """`python -m titan_fold.upcycle`'s work, its options parsed (options.upcycle_parser)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
    import torch.distributed.checkpoint as dcp

    from titan_fold.checkpoint.hf import check_out_folder, resolve_model

    family, args = resolve_model(a.name, a.flavor, a.hf_config)
    router_std = a.router_std if a.router_std is not None else default_router_std(args)
    check_upcycle(args, a.granularity, router_std)
    expert_scale(args, a.granularity, router_std)
    check_out_folder(a.out)
    dense = read_dense(a.dense, a.hf, family, args, a.granularity)
    sd = upcycle_state_dict(dense, args, a.granularity, router_std, a.seed)
    dcp.save(sd, checkpoint_id=a.out, no_dist=True)
    print(
        f"upcycled {a.dense} -> {a.out} ({a.name} {a.flavor}, granularity {a.granularity}, router_std {router_std:.3g})"
    )
