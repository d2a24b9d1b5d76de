"""Muon under the foldings: one rank's Muon, parameter by parameter.

The trainer: two Muon steps from the seed checkpoint under dp2 x ep2, tp2 x dp2 (FSDP over TP)
x ep2 x etp2, cp2, dp4 x ep2 x edp2 and pp2 x tp2 give the one-rank run's weights, every
parameter (from the last checkpoint), and its loss and per-group gradient and update norms. A
one-rank run resumed under tp2 x ep2 x etp2 (the momenta resharded by DCP) takes its next step
as the run that goes on.

The placements one by one: on 4 gloo ranks in fp32, Muon parameters (attention-like matrices, a stack of experts) are
DTensors placed as the foldings place them: FSDP over dp, FSDP over TP (torch's strided shard),
HSDP, TP with colwise, rowwise and replicated weights and an uneven shard, dp2 x ep2 (FSDP over
edp on the experts' dim 0), ep2 x etp2, and ep4 with FSDP over edp on another dim.
Two Muon steps on the same global gradients must give the one-process Muon's weights; the
2-D matrices must also step as torch.optim.Muon. The owners spread the Newton-Schulz work.
"""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from helpers import BATCH, assert_matches_one_rank, degrees, torchrun, train_from_seed
from launcher import end_rank_checks, fork_ranks, run_checks, start_rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titan_fold.checkpoint.files import read_model_tensors
from titan_fold.models.groups import uses_muon
from titan_fold.parallel.orthogonalize import Orthogonalizer
from titan_fold.trainer.muon import Muon

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

WORLD = 4
SHAPES = {
    "layers.0.attention.wq.weight": (24, 16),
    "layers.0.attention.wo.weight": (16, 24),
    "layers.0.attention.wq_a.weight": (8, 16),
    "layers.0.attention.wkv_b.weight": (10, 6),  # 10 rows: uneven shards over 4 (3, 3, 3, 1) and 8
    "layers.0.moe.experts.w13": (4, 12, 8),  # 4 experts, each a gate and an up matrix [6, 8]
    "layers.0.moe.experts.w2": (4, 8, 6),
}
ATTENTION = [n for n in SHAPES if ".attention." in n]
EXPERTS = [n for n in SHAPES if ".experts." in n]
S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


def strided(dim: int, split: int):
    return _StridedShard(dim, split_factor=split)


# name -> [(mesh shape, mesh dim names, {parameter: placements})]
LAYOUTS = {
    "dp4": [((4,), ("dp_shard",), {n: [S0] for n in SHAPES})],
    "tp2_fsdp2": [
        (
            (2, 2),
            ("dp_shard", "tp"),
            {
                "layers.0.attention.wq.weight": [strided(0, 2), S0],
                "layers.0.attention.wo.weight": [S0, S1],
                "layers.0.attention.wq_a.weight": [S0, R],
                "layers.0.attention.wkv_b.weight": [S1, S0],
            },
        ),
        ((4,), ("edp",), {n: [S0] for n in EXPERTS}),
    ],
    "hsdp2x2": [((2, 2), ("dp_replicate", "dp_shard"), {n: [R, S0] for n in SHAPES})],
    "tp4": [
        (
            (4,),
            ("tp",),
            {
                "layers.0.attention.wq.weight": [S0],
                "layers.0.attention.wo.weight": [S1],
                "layers.0.attention.wq_a.weight": [R],
                "layers.0.attention.wkv_b.weight": [S0],
                "layers.0.moe.experts.w13": [S1],
                "layers.0.moe.experts.w2": [S2],
            },
        )
    ],
    "dp2_ep2": [
        ((4,), ("dp_shard",), {n: [S0] for n in ATTENTION}),
        ((2, 2), ("edp", "ep"), {n: [strided(0, 2), S0] for n in EXPERTS}),
    ],
    "ep2_etp2": [
        ((2, 2), ("dp_shard", "tp"), {n: [S0, S0] for n in ATTENTION}),
        ((2, 2), ("ep", "etp"), {"layers.0.moe.experts.w13": [S0, S1], "layers.0.moe.experts.w2": [S0, S2]}),
    ],
    "ep4_edp_on_dim": [
        ((4,), ("dp_shard",), {n: [S1] for n in ATTENTION}),
        ((2, 2), ("edp", "ep"), {"layers.0.moe.experts.w13": [S2, S0], "layers.0.moe.experts.w2": [S1, S0]}),
    ],
}
SETTINGS = dict(
    lr=0.02,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=(3.4445, -4.775, 2.0315),
    ns_steps=5,
    lr_adjust="match_rms_adamw",
)
STEPS = 2


def globals_(seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(STEPS)]
    return weights, grads


def one_process(ns_dtype: str) -> dict[str, torch.Tensor]:
    weights, grads = globals_()
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    opt = Muon(list(params.items()), **SETTINGS, ns_dtype=ns_dtype)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def folded(layout, ns_dtype: str) -> tuple[dict[str, torch.Tensor], Orthogonalizer]:
    weights, grads = globals_()
    params, where = {}, {}
    for shape, names, placed in LAYOUTS[layout]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for n, placements in placed.items():
            where[n] = (mesh, placements)
            params[n] = torch.nn.Parameter(distribute_tensor(weights[n].clone(), mesh, placements))
    assert set(params) == set(SHAPES), layout
    opt = Muon(list(params.items()), **SETTINGS, ns_dtype=ns_dtype)
    for g in grads:
        for n, p in params.items():
            p.grad = distribute_tensor(g[n].clone(), *where[n])
        opt.step()
    return {n: p.detach().full_tensor() for n, p in params.items()}, opt._orthogonalizer


def check_layout(layout: str, reference: dict[str, torch.Tensor], torch_reference: dict[str, torch.Tensor]) -> None:
    start, _ = globals_()
    got, orthogonalizer = folded(layout, "float32")
    for n, want in reference.items():
        change, want_change = got[n] - start[n], want - start[n]
        assert (change - want_change).norm() <= 1e-5 * want_change.norm(), (layout, n)
    # each rank owns some of the work, and none much more than the mean
    loads = torch.tensor(list(orthogonalizer.loads.values()), dtype=torch.float64)
    assert len(loads) == WORLD and loads.max() <= 1.5 * loads.mean(), (layout, orthogonalizer.loads)
    got, _ = folded(layout, "bfloat16")
    for n, want in torch_reference.items():
        change, want_change = got[n] - start[n], want - start[n]
        assert (change - want_change).norm() <= 1e-3 * want_change.norm(), (layout, n, "torch.optim.Muon")


def torch_muon() -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the 2-D matrices (Newton-Schulz in bf16, as torch computes it)."""
    weights, grads = globals_()
    params = {n: torch.nn.Parameter(weights[n].clone()) for n in ATTENTION}
    s = SETTINGS
    opt = torch.optim.Muon(
        list(params.values()),
        lr=s["lr"],
        weight_decay=s["weight_decay"],
        momentum=s["momentum"],
        nesterov=s["nesterov"],
        ns_coefficients=s["ns_coefficients"],
        ns_steps=s["ns_steps"],
        adjust_lr_fn=s["lr_adjust"],
    )
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def worker(rank, port, out_dir, layouts):
    start_rank(rank, port, WORLD)
    reference, torch_reference = one_process("float32"), torch_muon()
    failures = run_checks(
        [(name, lambda name=name: check_layout(name, reference, torch_reference)) for name in layouts], "muon"
    )
    dist.barrier()
    end_rank_checks(out_dir, rank, failures)


def test_one_muon_step_under_each_folding_is_one_ranks(tmp_path):
    failures = fork_ranks(worker, WORLD, tmp_path, sorted(LAYOUTS))
    assert not failures, "\n".join(failures)[:20000]


MUON = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")
TRAINER_LAYOUTS = {
    "dp2_ep2": (2, degrees(ep=2)),
    "tp2_dp2_ep2_etp2": (4, degrees(tp=2, ep=2, etp=2)),
    "cp2": (2, degrees(cp=2)),
    "dp4_ep2_edp2": (4, degrees(ep=2)),
    # the batch in 8 micro-batches of one sequence through the 2 stages, as the one-rank run accumulates it
    "pp2_tp2": (4, (*degrees(tp=2), "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8")),
}


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory, seed_checkpoint):
    folder = tmp_path_factory.mktemp("muon_ref")
    return folder, train_from_seed(folder, 1, seed_checkpoint, STEPS, *BATCH, *MUON)


@pytest.mark.parametrize("name", sorted(TRAINER_LAYOUTS))
def test_trainer_muon_steps_match_one_rank(name, muon_reference, tmp_path, seed_checkpoint):
    nproc, args = TRAINER_LAYOUTS[name]
    folded = train_from_seed(tmp_path, nproc, seed_checkpoint, STEPS, *BATCH, *MUON, *args)
    reference, metrics = muon_reference
    assert_matches_one_rank(metrics, folded, name)
    seed = read_model_tensors(seed_checkpoint)
    want = read_model_tensors(str(reference / "checkpoint" / f"step-{STEPS}"))
    got = read_model_tensors(str(tmp_path / "checkpoint" / f"step-{STEPS}"))
    assert set(got) == set(want) == set(seed)
    for n in want:
        change, want_change = got[n] - seed[n], want[n] - seed[n]
        # fp32 sums in another order; AdamW's first steps divide by sqrt(v) and magnify them
        rel = 1e-4 if uses_muon(n, want[n]) else 3e-4
        assert (change - want_change).norm() <= rel * want_change.norm(), (name, n)


def test_resume_under_another_folding_continues_the_run(tmp_path, seed_checkpoint):
    full = (
        *BATCH,
        *MUON,
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        seed_checkpoint,
        "--checkpoint.interval",
        "1",
        "--checkpoint.no-last_save_model_only",
        "--training.steps",
        "2",
    )
    torchrun(1, "--job.dump_folder", str(tmp_path / "on"), *full)
    os.makedirs(tmp_path / "resumed" / "checkpoint")
    shutil.copytree(tmp_path / "on" / "checkpoint" / "step-1", tmp_path / "resumed" / "checkpoint" / "step-1")
    torchrun(4, "--job.dump_folder", str(tmp_path / "resumed"), *full, *degrees(tp=2, ep=2, etp=2))
    start = read_model_tensors(str(tmp_path / "on" / "checkpoint" / "step-1"))
    want = read_model_tensors(str(tmp_path / "on" / "checkpoint" / "step-2"))
    got = read_model_tensors(str(tmp_path / "resumed" / "checkpoint" / "step-2"))
    for n in want:
        change, want_change = got[n] - start[n], want[n] - start[n]
        rel = 1e-4 if uses_muon(n, want[n]) else 3e-4
        assert (change - want_change).norm() <= rel * want_change.norm(), n
