"""Helpers shared by the test files: builders, references and configs (no tests here).

A test file imports from this module (or launcher, host_sync), never from another test file
nor from conftest."""

import itertools
import json
import math
import os
import pathlib
import subprocess
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from launcher import ZYGOTE, RanksFailed

from titan_fold.common.config import parse_args
from titan_fold.moe import MoE

# --- an MoE layer (tests/test_moe_layer.py and the multi-rank MoE tests)
DIM, FFN = 16, 12  # 16-byte aligned rows in fp32: the grouped-GEMM path runs


def make_layer(args, dtype, seed=0, skew=0.0):
    torch.manual_seed(seed)
    moe = MoE(DIM, args)
    moe.init_weights(0.3)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)
        if skew:  # expert 0 wins most tokens, expert 1 the rest: others get nothing
            moe.router.gate.weight[0] += skew
            moe.router.gate.weight[1] += skew / 2
    return moe.to(dtype)


# --- QuACK stand-ins in float64 (tests/test_moe_fast_paths.py, tests/test_bench.py)
def _grouped_product(a, b, cu_seqlens_m, cu_seqlens_k, a_idx):
    """float64 a @ b per group: rows of a (a[a_idx] where given) by cu_seqlens_m, b [E, k, n];
    or the contraction by cu_seqlens_k, a [m, R], b [R, n] -> [E, m, n]."""
    a, b = a.double(), b.double()
    if cu_seqlens_k is not None:
        bounds = cu_seqlens_k.tolist()
        out = torch.stack([a[:, s:e] @ b[s:e] for s, e in itertools.pairwise(bounds)])
    else:
        rows = a if a_idx is None else a[a_idx.long()]
        bounds = cu_seqlens_m.tolist()
        out = torch.cat([rows[s:e] @ b[i] for i, (s, e) in enumerate(itertools.pairwise(bounds))])
    return out


def _stand_in_quack(calls):
    """QuACK's interface as moe/quack.py calls it, each call computed in float64 and recorded in
    calls: gemm_tuned / gemm_tuned.fn / _gemm_execute (a plain grouped GEMM: tuned, its config
    pinned, or replayed) and gemm_dgated (its config pinned, if any, recorded beside the call),
    whose epilogue, per QuACK's documentation, takes acc = A @ B per group and the preact's (gate,
    up) pairs and returns pack(dgate, dup) of SwiGLU's backward of acc * scale, the SwiGLU times
    scale, and the row sum of SwiGLU x acc."""
    from types import SimpleNamespace

    def launch(kind, a, b, out, c, cu_seqlens_m, cu_seqlens_k, A_idx, plan):
        assert c is None
        calls.append((kind, plan))
        out.copy_(_grouped_product(a, b, cu_seqlens_m, cu_seqlens_k, A_idx))

    class GemmTuned:  # QuACK's autotuned gemm: its config chosen at a signature's first call
        best_config = SimpleNamespace(kwargs={"config": "its pick"})  # no sweep here: no configs_timings

        def __call__(self, a, b, out, c, **kw):
            return self.fn(a, b, out, c, config=None, kind="tuned", **kw)

        @staticmethod
        def fn(a, b, out, c, *, cu_seqlens_m, cu_seqlens_k=None, A_idx=None, dynamic_scheduler, config, kind="pinned"):
            assert dynamic_scheduler and (config is None) == (kind == "tuned")
            plan = (config or f"config {len(calls)}", 1, True, object())
            launch(kind, a, b, out, c, cu_seqlens_m, cu_seqlens_k, A_idx, plan)
            return plan

    def gemm_execute(
        a, b, out, c, *, cu_seqlens_m, cu_seqlens_k, A_idx, config, split_k, dynamic_scheduler, dispatch_plan, **fixed
    ):
        assert fixed["rounding_mode"] == "RN" and fixed["split_k_mode"] == "SERIAL" and fixed["beta"] == 1.0
        launch(
            "replay",
            a,
            b,
            out,
            c,
            cu_seqlens_m,
            cu_seqlens_k,
            A_idx,
            (config, split_k, dynamic_scheduler, dispatch_plan),
        )

    def gemm_dgated(a, b, preact, *, activation, colvec_scale, colvec_reduce, cu_seqlens_m, config, dynamic_scheduler):
        assert activation == "swiglu" and colvec_reduce and dynamic_scheduler
        calls.append(("dgated", config))
        acc = _grouped_product(a, b, cu_seqlens_m, None, None)  # [R, ffn]
        s = colvec_scale.double()[:, None]
        gate, up = preact.double()[:, 0::2], preact.double()[:, 1::2]
        sig = torch.sigmoid(gate)
        out = gate * sig * up
        dout = acc * s
        dgate, dup = dout * up * sig * (1 + gate * (1 - sig)), dout * gate * sig
        dpre = torch.stack((dgate, dup), -1).flatten(-2)
        return dpre.to(preact.dtype), (out * s).to(preact.dtype), (out * acc).sum(-1).float()

    return SimpleNamespace(
        gemm_tuned=GemmTuned(),
        _gemm_execute=gemm_execute,
        gemm_dgated=gemm_dgated,
        RoundingMode=SimpleNamespace(RN="RN"),
        SplitKMode=SimpleNamespace(SERIAL="SERIAL"),
    )


def _stand_in_up_epilogue(calls):
    """moe/quack_epilogue.py's GEMM as moe/quack.py calls it, in float64 and recorded in calls:
    acc = A @ B per group of rows (A's rows A[A_idx] where given), D = acc (its (gate, up) pairs
    adjacent), postact = silu(gate) * up * p; the config pinned, if any, recorded beside the call."""

    def up(a, b, c, *, out, cu_seqlens_m, A_idx, p, config, dynamic_scheduler):
        assert c is None and dynamic_scheduler and set(out) == {"D", "postact"}
        calls.append(("gated", config))
        acc = _grouped_product(a, b, cu_seqlens_m, None, A_idx)  # [R, 2 * ffn]
        gate, up = acc[:, 0::2], acc[:, 1::2]
        out["D"].copy_(acc)
        out["postact"].copy_(gate * torch.sigmoid(gate) * up * p.double()[:, None])

    return up


# --- the clip kernel's reference (tests/test_clip.py and its interpreter script)
def _chunk_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float64 sums of squares of each CHUNK elements of each tensor in turn: what
    sum_squares.partials returns, one per program."""
    from titan_fold.parallel import sum_squares

    chunk = sum_squares.CHUNK
    return (
        torch.cat([torch.nn.functional.pad(t.double(), (0, -t.numel() % chunk)).view(-1, chunk) for t in tensors])
        .square()
        .sum(1)
    )


# --- the layout's groups (tests/test_layout.py, tests/test_layout_gloo.py)
# independent reference: Megatron-Core's RankGenerator from its definition.
# A rank's coordinates come from its index with the first name of the order fastest
# (order tp-cp-ep-dp-pp; dp split as dp_shard (fast) x dp_replicate for our HSDP names).
# The groups of a set of names are the ranks that differ only in those names; inside a
# group, ranks are ordered by their index over those names (first name fastest).

ORDER = ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")


def megatron_groups(world: int, sizes: dict[str, int], names: set[str]) -> list[list[int]]:
    assert set(names) <= set(ORDER)
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for rank in range(world):
        rest, coords = rank, {}
        for n in ORDER:
            rest, coords[n] = divmod(rest, sizes.get(n, 1))
        assert rest == 0
        key = tuple(coords[n] for n in ORDER if n not in names)
        inner, stride = 0, 1
        for n in ORDER:
            if n in names:
                inner += coords[n] * stride
                stride *= sizes.get(n, 1)
        groups.setdefault(key, []).append((inner, rank))
    out = [[r for _, r in sorted(g)] for g in groups.values()]
    return sorted(out, key=lambda g: g[0])


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """A layout's degrees: `reference(**asdict(d))`'s arguments; str(d) is its test id."""

    world: int
    pp: int
    dpr: int  # dp_replicate
    dps: int  # dp_shard
    cp: int
    tp: int
    ep: int
    etp: int

    def __str__(self) -> str:
        return (
            f"w{self.world}_pp{self.pp}_dpr{self.dpr}_dps{self.dps}_cp{self.cp}_tp{self.tp}_ep{self.ep}_etp{self.etp}"
        )


def reference(world, pp, dpr, dps, cp, tp, ep, etp) -> dict[str, list[list[int]]]:
    """Every named group of both meshes: attention generator has ep=1, expert generator cp=1."""
    att = dict(tp=tp, cp=cp, ep=1, dp_shard=dps, dp_replicate=dpr, pp=pp)
    edp = world // (pp * ep * etp)
    exp = dict(tp=etp, cp=1, ep=ep, dp_shard=edp, dp_replicate=1, pp=pp)
    dp = {"dp_shard", "dp_replicate"}
    return {
        "pp": megatron_groups(world, att, {"pp"}),
        "dp_replicate": megatron_groups(world, att, {"dp_replicate"}),
        "dp_shard": megatron_groups(world, att, {"dp_shard"}),
        "cp": megatron_groups(world, att, {"cp"}),
        "tp": megatron_groups(world, att, {"tp"}),
        "dp": megatron_groups(world, att, dp),
        "dp_shard_cp": megatron_groups(world, att, {"dp_shard", "cp"}),
        "dp_cp": megatron_groups(world, att, dp | {"cp"}),
        "cp_tp": megatron_groups(world, att, {"cp", "tp"}),
        "stage": megatron_groups(world, att, dp | {"cp", "tp"}),
        "expert.pp": megatron_groups(world, exp, {"pp"}),
        "edp": megatron_groups(world, exp, {"dp_shard"}),
        "ep": megatron_groups(world, exp, {"ep"}),
        "etp": megatron_groups(world, exp, {"tp"}),
        "ep_etp": megatron_groups(world, exp, {"ep", "tp"}),
    }


# --- the equivalence runs (tests/test_equivalence*.py, tests/test_muon_folding.py)
STEPS = 5
BATCH = ("--training.local_batch_size", "1", "--training.global_batch_size", "8")


def degrees(tp=1, cp=1, dp_replicate=1, ep=1, etp=1) -> tuple[str, ...]:
    return (
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--parallelism.context_parallel_degree",
        str(cp),
        "--parallelism.data_parallel_replicate_degree",
        str(dp_replicate),
        "--parallelism.expert_parallel_degree",
        str(ep),
        "--parallelism.expert_tensor_parallel_degree",
        str(etp),
    )


# --- the dry run's configs (tests/test_dryrun*.py, tests/test_gradient_check.py)
WORLD = {
    "debug_moe.toml": 2,
    "debug_qwen3_moe.toml": 2,
    "debug_sft.toml": 2,
    "sft_qwen3_30b_a3b.toml": 8,
    "qwen3_30b_a3b.toml": 8,
    "qwen2.toml": 64,
    "mixtral_8x22b.toml": 128,
    "mixtral_8x22b_g8t8.toml": 128,
    "debug_deepseek_v3.toml": 2,
    "deepseek_v3_16b.toml": 8,
    "deepseek_v3_671b.toml": 1024,
    "debug_qwen3_5_moe.toml": 2,
    "sft_qwen3_5_35b_a3b.toml": 8,
    "qwen3_5_397b_a17b.toml": 256,
    "debug_gpt_oss.toml": 2,
    "sft_gpt_oss_20b.toml": 8,
    "gpt_oss_120b.toml": 128,
}
# the paper's 1024-GPU layouts: Table 5's folded Mixtral-8x22B at 128K (cp8 tp8 ep8 pp8 etp1,
# global batch 128), its unfolded MCore row (cp16 tp4 ep8 pp8, etp = tp), and the packaged
# 4K mappings scaled to 1024 GPUs (Table 4's strong scaling, global batch 1024)
PAPER_1024 = {
    "mixtral folded 128K": (
        "mixtral_8x22b.toml",
        [
            "--training.seq_len",
            "131072",
            "--model.max_seq_len",
            "131072",
            "--training.global_batch_size",
            "128",
            "--parallelism.context_parallel_degree",
            "8",
            "--parallelism.tensor_parallel_degree",
            "8",
            "--parallelism.expert_parallel_degree",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "8",
            "--parallelism.expert_tensor_parallel_degree",
            "1",
        ],
    ),
    "mixtral mcore 128K": (
        "mixtral_8x22b.toml",
        [
            "--training.seq_len",
            "131072",
            "--model.max_seq_len",
            "131072",
            "--training.global_batch_size",
            "128",
            "--parallelism.context_parallel_degree",
            "16",
            "--parallelism.tensor_parallel_degree",
            "4",
            "--parallelism.expert_parallel_degree",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "8",
            "--parallelism.expert_tensor_parallel_degree",
            "4",
        ],
    ),
    "qwen2 4K": ("qwen2.toml", ["--training.global_batch_size", "1024"]),
    "mixtral g8t8 4K": ("mixtral_8x22b_g8t8.toml", ["--training.global_batch_size", "1024"]),
}


def config(name, *overrides):
    return parse_args(["--job.config_file", name, *overrides])


# --- the MoE layer reference in float64 (tests/test_moe_layer.py, tests/test_dispatcher.py)
# Written without the layer's code: Python loops over tokens and experts, dictionaries for
# the drop decision. Decisions are taken on detached values; the arithmetic goes through
# autograd so gradients can be compared as well.
def route_token(logits_t, args, bias):
    """-> (scores [E] tensor, chosen expert ids list, probs list of 0-d tensors)."""
    scores = logits_t.softmax(-1) if args.score_func == "softmax" else logits_t.sigmoid()
    choice = [float(v) for v in scores.detach()]
    if args.load_balance == "aux_free":
        choice = [c + float(b) for c, b in zip(choice, bias, strict=True)]
    chosen = sorted(range(len(choice)), key=lambda e: -choice[e])[: args.top_k]
    probs = [scores[e] for e in chosen]
    if args.norm_topk_prob:
        total = sum(probs)
        probs = [p / total for p in probs]
    return scores, chosen, probs


def drop_decisions(chosen, probs, num_experts, cap, policy):
    """chosen/probs: per token lists -> set of kept (t, j)."""
    kept = set()
    for e in range(num_experts):
        mine = [(t, j) for t in range(len(chosen)) for j in range(len(chosen[t])) if chosen[t][j] == e]
        if policy == "probs":
            mine.sort(key=lambda tj: (-float(probs[tj[0]][tj[1]].detach()), tj[0] * len(chosen[0]) + tj[1]))
        kept.update(mine[:cap])
    return kept


def expert_ffn(x_t, w13, w2, e, p, prob_before_w2):
    # w13 [E, 2 * ffn, dim]: rows 2f and 2f + 1 are hidden unit f's gate and up projections
    h = F.silu(w13[e, 0::2] @ x_t) * (w13[e, 1::2] @ x_t)
    return w2[e] @ (h * p) if prob_before_w2 else (w2[e] @ h) * p


def reference_moe(x, gate, w13, w2, args, bias=None, chunks=1, full_tokens=None):
    """x [T, dim]; gate [E, dim]; full expert weights. Returns (y [T, dim], kept set, chosen).

    chunks: split the tokens into this many equal groups that decide capacity separately
    (sub-sequence dropping on `chunks` ranks). Shared experts are not included.
    """
    T = x.shape[0]
    E = gate.shape[0]
    bias = [0.0] * E if bias is None else list(bias)
    chosen, probs = [], []
    for t in range(T):
        _, c, p = route_token(gate @ x[t], args, bias)
        chosen.append(c)
        probs.append(p)
    if args.token_drop == "dropless":
        kept = {(t, j) for t in range(T) for j in range(args.top_k)}
    else:
        kept = set()
        n = T // chunks
        for i in range(chunks):
            cap = math.ceil(n * args.top_k * args.capacity_factor / E)
            part = drop_decisions(chosen[i * n : (i + 1) * n], probs[i * n : (i + 1) * n], E, cap, args.drop_policy)
            kept.update((t + i * n, j) for t, j in part)
    rows = []
    for t in range(T):
        y_t = torch.zeros_like(x[t])
        for j, e in enumerate(chosen[t]):
            if (t, j) in kept:
                y_t = y_t + expert_ffn(x[t], w13, w2, e, probs[t][j], args.prob_before_w2)
        rows.append(y_t)
    return torch.stack(rows), kept, chosen


# --- a trainer run whose checkpoints resume exactly (tests/test_checkpoint.py and the copies'
# resume in tests/test_hot_replicas_train.py): micro-batches of one sequence (aux statistics see
# the same tokens in every layout), aux-free routing (the router biases are state), every step
# logged, a checkpoint at step 3 with its optimizer state
def checkpointed_run(steps: int) -> tuple[str, ...]:
    return (
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "8",
        "--moe.load_balance",
        "aux_free",
        "--moe.aux_loss_coeff",
        "0",
        "--metrics.log_freq",
        "1",
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.no-last_save_model_only",
    )


def router_biases(checkpoint) -> dict[str, torch.Tensor]:
    """The aux-free router biases a step folder holds, by key."""
    import torch.distributed.checkpoint as dcp

    from titan_fold.checkpoint.trusted import read_metadata

    md = read_metadata(str(checkpoint)).state_dict_metadata
    state = {k: torch.zeros(list(m.size)) for k, m in md.items() if k.endswith("router.expert_bias")}
    assert state, "no router bias in the checkpoint"
    dcp.load(state, checkpoint_id=str(checkpoint))
    return state


# --- runs of the trainer and of the CLIs, forked from the launcher's zygote (tests/launcher.py)
def forked(
    nproc: int, module: str, *args: str, env: dict | None = None, timeout: float = 900
) -> tuple[list[int], str, str]:
    """`python -m MODULE ARGS` on NPROC ranks with torchrun's environment (0: one plain process),
    forked from one process that imported the trainer once per session (tests/launcher.py);
    -> every rank's exit code, stdout, stderr."""
    with tempfile.TemporaryDirectory() as logs:
        out, err = pathlib.Path(logs, "stdout"), pathlib.Path(logs, "stderr")
        codes = ZYGOTE.launch(nproc, list(args), str(out), str(err), env=env, timeout=timeout, module=module)
        return codes, out.read_text(errors="replace"), err.read_text(errors="replace")


def torchrun(nproc: int, *args: str, config: str = "debug_moe.toml") -> None:
    """`torchrun --standalone --nproc_per_node NPROC -m titan_fold.train --job.config_file CONFIG ARGS`,
    the ranks forked (`forked`); torchrun itself: test_checkpoint.py's fault test and
    test_reliability.py's signal tests. A failed run raises RanksFailed: a crash, not a wrong value."""
    codes, out, err = forked(nproc, "titan_fold.train", "--job.config_file", config, *args)
    if any(codes):
        raise RanksFailed(f"exit codes {codes}\n{out[-3000:]}{err[-6000:]}")


def python_m(module: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` as one process in this test's working folder: its exit code,
    stdout and stderr, as subprocess.run(capture_output=True, text=True) gives them, without
    the fresh interpreter's seconds of imports (`forked`)."""
    (code,), out, err = forked(0, module, *args, env=env, timeout=timeout)
    return subprocess.CompletedProcess(["python", "-m", module, *args], code, out, err)


def read_metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_from_seed(
    folder, nproc: int, seed_checkpoint: str, steps: int, *args: str, config: str = "debug_moe.toml"
) -> list[dict]:
    """Train `steps` steps from the seed checkpoint, logging every step with each parameter
    group's norms; -> the metrics."""
    torchrun(
        nproc,
        "--job.dump_folder",
        str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        seed_checkpoint,
        "--checkpoint.interval",
        "1000",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.group_grad_norms",
        *args,
        config=config,
    )
    return read_metrics(folder)


# a folding changes where each parameter group's work runs: each group is compared on its own,
# relative to its own norm (the routed experts' is about 1e-3 of the total in the debug model)
GROUP_METRICS = ("group_grad_norms", "group_update_norms")


def assert_matches_one_rank(
    reference: list[dict],
    got: list[dict],
    name: str,
    keys: tuple[str, ...] = ("loss", "grad_norm", "moe_aux_loss"),
    rel: float = 1e-4,
    abs: float = 1e-7,
) -> None:
    """Every step of `got` as the one-rank `reference`: the logged `keys`, and the gradient norm
    and update norm of every parameter group (train_from_seed logs them)."""
    assert len(got) == len(reference) > 0, name
    for ref, run in zip(reference, got, strict=True):
        for key in keys:
            assert run[key] == pytest.approx(ref[key], rel=rel, abs=abs), (name, key, ref["step"])
        # the groups part the parameters: their squares add up to the total
        assert sum(v**2 for v in run["group_grad_norms"].values()) == pytest.approx(run["grad_norm"] ** 2, rel=1e-4)
        for metric in GROUP_METRICS:
            assert set(run[metric]) == set(ref[metric]), (name, metric, ref["step"])
            for group, value in ref[metric].items():
                assert run[metric][group] == pytest.approx(value, rel=rel), (name, metric, group, ref["step"])


def one_rank_step(model, loss_fn):
    """A TrainStep over one rank's one model part, eager, without a trainer: its
    _forward_backward(input_dict=, labels=, global_valid_tokens=) runs the trainer's micro-batch
    (the MTP layers' scale, the aux losses' scale, the batch's split, R2's record pass, the loss)."""
    import contextlib
    import functools
    from types import SimpleNamespace

    from titan_fold.trainer.step import TrainStep

    step = SimpleNamespace(
        parallel_dims=SimpleNamespace(pp_enabled=False, cp=1, tp=1),
        overlap=None,
        model_parts=[model],
        model_args=model.args,
        loss_fn=loss_fn,
        train_context=contextlib.nullcontext,
        maybe_enable_amp=contextlib.nullcontext(),
        step=1,
    )
    for name in ("post_dataloading_process", "loss_target", "_routed_experts", "_one_part_forward_backward"):
        setattr(step, name, functools.partial(getattr(TrainStep, name), step))
    step.forward_backward = functools.partial(TrainStep._forward_backward, step)
    return step
