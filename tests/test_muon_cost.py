"""Muon in the dry run and the cost model: the optimizer state the dry run counts against what
Muon really keeps, the planner's Newton-Schulz time against an independent FLOP count, and the
dry run's report of the optimizer step's own collectives."""

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from titan_fold import dryrun
from titan_fold.common.config import parse_args
from titan_fold.dryrun.report import format_report
from titan_fold.models.flavors import FLAVORS
from titan_fold.models.groups import uses_muon
from titan_fold.models.transformer import Transformer
from titan_fold.planning import cost_model
from titan_fold.planning.accounting import parameter_report
from titan_fold.planning.sizes import model_sizes
from titan_fold.trainer.muon import Muon


@pytest.fixture(autouse=True)
def no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def job(optimizer: str):
    return types.SimpleNamespace(
        training=types.SimpleNamespace(dtype="float32"), optimizer=types.SimpleNamespace(name=optimizer)
    )


def test_state_bytes_are_what_muon_keeps():
    """parameter_report's optimizer bytes equal the bytes of the state tensors Muon holds after a
    step (one momentum per orthogonalized matrix, AdamW's two moments for the rest)."""
    torch.manual_seed(0)
    model = Transformer(FLAVORS["qwen3_moe"]["debug"])
    named = list(model.named_parameters())
    opt = Muon(
        named,
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_coefficients=(3.4445, -4.775, 2.0315),
        ns_steps=5,
        lr_adjust="match_rms_adamw",
        ns_dtype="float32",
    )
    for _, p in named:
        p.grad = torch.randn_like(p)
    opt.step()
    kept = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.ndim > 0)
    assert any(uses_muon(n, p) for n, p in named) and not all(uses_muon(n, p) for n, p in named)
    assert parameter_report([model], job("Muon"))["bytes"]["optimizer"] == kept
    adamw = parameter_report([model], job("AdamW"))["bytes"]["optimizer"]
    muon_numel = parameter_report([model], job("Muon"))["muon_numel"]
    assert adamw - kept == muon_numel * 4 > 0


def _ns_flops_by_hand(args) -> int:
    """Five Newton-Schulz steps over every matrix Muon orthogonalizes: X X^T, its square and the
    product with X, 4 m^2 n + 2 m^3 FLOPs a step for m <= n; w13 holds a gate and an up matrix per expert."""
    with torch.device("meta"):
        model = Transformer(args)
    total = 0
    for name, p in model.named_parameters():
        if not uses_muon(name, p):
            continue
        rows, cols = p.shape[-2:]
        experts = p.shape[0] if p.ndim == 3 else 1
        if name.endswith(".experts.w13"):
            rows, experts = rows // 2, 2 * experts
        m, n = sorted((rows, cols))
        total += experts * 5 * (4 * m * m * n + 2 * m**3)
    return total


def test_cost_model_times_newton_schulz_and_exchange():
    args = dataclasses.replace(FLAVORS["qwen3_moe"]["30B-A3B"], n_layers=4)
    sizes = model_sizes(args, 4096)
    cluster = cost_model.Cluster(gpus=2)
    rate = cluster.tflops * 1e12 * cluster.compute_efficiency
    adamw = cost_model.Workload(4096, 4)
    muon = dataclasses.replace(adamw, optimizer="Muon")
    one = cost_model.Mapping(1, 1, 1, 1, 1, 1, 1, 1)
    # one rank: all of Newton-Schulz, nothing sent
    assert cost_model.optimizer_seconds(sizes, one, muon, cluster) == pytest.approx(_ns_flops_by_hand(args) / rate)
    assert cost_model.optimizer_seconds(sizes, one, adamw, cluster) == 0
    # dp2 x ep2: half the FLOPs each, and each local element of a Muon matrix to its owner and back
    folded = cost_model.Mapping(1, 1, 2, 1, 1, 2, 1, 1)
    local = cost_model.muon_local(sizes, folded, muon)
    sent = 2 * local * 2 * (1 / 2) / (cluster.intra_node_gbps * 1e9 * cluster.comm_efficiency)
    assert cost_model.optimizer_seconds(sizes, folded, muon, cluster) == pytest.approx(
        _ns_flops_by_hand(args) / 2 / rate + sent
    )
    est_a, est_m = (cost_model.estimate(sizes, folded, w, cluster) for w in (adamw, muon))
    assert est_m.step_s - est_a.step_s == pytest.approx(est_m.optimizer_s)
    # one fp32 momentum in place of two moments for every local Muon element
    assert est_a.memory.optimizer - est_m.memory.optimizer == pytest.approx(4 * local)


def test_dry_run_shows_muon_state_and_optimizer_collectives():
    config = parse_args(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--comm.mode",
            "fake_backend",
            "--optimizer.name",
            "Muon",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
        ]
    )
    report = dryrun.dry_run(config, 2, collectives=True)
    rank = report["ranks"][0]
    assert rank["muon"]["numel"] == rank["muon_numel"] > 0
    row = next(r for r in rank["compare"] if r["what"] == "optimizer")
    assert row["dry_run"] == pytest.approx(row["cost_model"], rel=0.02)
    ops = report["collectives"]["optimizer_calls"]
    assert any(op.startswith("alltoall") or op.startswith("all_to_all") for op in ops), ops
    text = format_report(report)
    assert "optimizer: Muon orthogonalizes" in text and "the optimizer step's own" in text
