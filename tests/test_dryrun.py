"""Dry run (`--comm.mode fake_backend`): every packaged job config and the paper's 1024-rank
layouts at their real world size in one process; per-rank memory against independent counts;
matched collectives, and a deliberately mismatched dispatcher caught."""

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import PAPER_1024, WORLD, config, python_m
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_fold import dryrun
from titan_fold.common.tensors import local
from titan_fold.common.values import PACKAGED_CONFIGS
from titan_fold.dryrun.measure import LiveBytes, _dry_config
from titan_fold.models import FLAVORS, Transformer
from titan_fold.moe.experts import GroupedExperts
from titan_fold.trainer.banner import banner

ROOT = Path(__file__).resolve().parents[1]


# world size each packaged config is written for (a new config must be added here)
@pytest.fixture(autouse=True)
def no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_packaged_config_has_a_world_size():
    assert sorted(p.name for p in PACKAGED_CONFIGS.glob("*.toml")) == sorted(WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WORLD))
def test_packaged_config_dry_runs(name):
    """Every rank position of the config at its world size: built and counted (the
    collectives of all its ranks: tests/test_dryrun_match.py)."""
    # deepseek_v3_671b.toml: its first rank only (each rank's fake step of a 170B stage takes ~1 CPU min)
    every = WORLD[name] <= 128
    c = config(name, "--comm.mode", "fake_backend", "--comm.dry_run_rank", "-1" if every else "0")
    start = time.process_time()
    report = dryrun.dry_run(c, WORLD[name], collectives=False)
    memory_s = sum(r["cpu_seconds"] for r in report["ranks"])
    per_stage = WORLD[name] // c.parallelism.pipeline_parallel_degree
    assert [r["rank"] for r in report["ranks"]] == (
        sorted(
            {r for p in range(c.parallelism.pipeline_parallel_degree) for r in (p * per_stage, (p + 1) * per_stage - 1)}
        )
        if every
        else [0]
    )
    for rep in report["ranks"]:
        # the pp coordinate of each rank is its block of world / pp consecutive ranks
        assert rep["coordinates"]["attention"]["pp"] == rep["rank"] // per_stage
        assert rep["coordinates"]["expert"]["pp"] == rep["rank"] // per_stage
        assert rep["activations"]["source"] == "fake-tensor step", rep["activations"]
        assert rep["activations"]["per_microbatch"] > 0
    assert memory_s / len(report["ranks"]) < 60
    print(f"{name}: {time.process_time() - start:.1f} CPU s")


@pytest.mark.slow
def test_fake_float32_experts_keep_what_real_ones_keep():
    """float32 experts under fake tensors (the debug configs' dry run) run one GEMM chain over
    every row, as fake grouped GEMMs take bf16 only and the per-expert chains need the row
    counts on the host: they keep for backward the bytes the real grouped GEMMs keep, less
    those GEMMs' [E] int32 group offsets."""
    torch.manual_seed(0)
    experts = GroupedExperts(dim=32, ffn_dim=16, num_experts=4)
    experts.init_weights(0.02)
    counts = [5, 0, 9, 2]

    def kept() -> int:
        x, probs = torch.randn(16, 32, requires_grad=True), torch.rand(16)  # [R, dim], [R]
        with LiveBytes() as live:
            y = experts(x, torch.tensor(counts), probs, prob_before_w2=False)
        assert y.shape == x.shape
        return live.live

    real = kept()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = kept()
    assert fake == real - 4 * len(counts)


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(PAPER_1024))
def test_paper_1024_rank_layouts(label):
    name, overrides = PAPER_1024[label]
    c = config(name, *overrides)
    report = dryrun.dry_run(c, 1024, collectives=False)
    rep = report["ranks"][0]
    assert rep["activations"]["source"] == "fake-tensor step"
    assert rep["cpu_seconds"] < 60
    # params of rank 0 against the flavor's own count: its blocks' parameters over the degrees
    args = FLAVORS[c.model.name][c.model.flavor]
    assert rep["bytes"]["params"] == 4 * rep["numel"]
    assert rep["kinds"]["routed experts"]["numel"] == rep["moe_layers"] * 3 * (
        args.moe.num_experts // c.parallelism.expert_parallel_degree
    ) * args.dim * args.moe.moe_ffn_dim // (c.parallelism.expert_tensor_parallel_degree * report["expert_mesh"]["edp"])


@pytest.mark.slow
def test_local_shapes_partition_the_model():
    """On every rank of a pure FSDP x (ep 4, etp 2) world the local parameters are pieces of
    the model: their numels over all ranks add up to the model's parameter count."""
    c = config(
        "debug_moe.toml",
        "--parallelism.expert_parallel_degree",
        "4",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "1",
    )
    _, args, _ = dryrun.check_config(c, 8)
    total = sum(dryrun.simulate_rank(c, 8, r, args, measure=False)["numel"] for r in range(8))
    with torch.device("meta"):
        model = Transformer(args)
    assert total == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_fake_backend_command(tmp_path, monkeypatch, capsys):
    """The fake-backend command as torchtitan documents the dry run (NGPU, one process)."""
    from titan_fold.train import main

    monkeypatch.setenv("NGPU", "8")
    out = tmp_path / "dry.json"
    code = main(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--comm.mode",
            "fake_backend",
            "--parallelism.expert_parallel_degree",
            "4",
            "--parallelism.expert_tensor_parallel_degree",
            "2",
            "--training.local_batch_size",
            "1",
            "--training.steps",
            "2",
            "--comm.dry_run_rank",
            "5",
            "--comm.dry_run_json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["ranks"][0]["rank"] == 5
    # rank 5 = (ep 2, etp 1) on the expert mesh, dp_shard 5 on the attention mesh
    assert report["ranks"][0]["coordinates"]["expert"] == {"pp": 0, "edp": 0, "ep": 2, "etp": 1}
    assert report["ranks"][0]["coordinates"]["attention"]["dp_shard"] == 5
    text = capsys.readouterr().out
    assert "every member of every group issues the same sequence" in text


@pytest.mark.slow
def test_progress_per_phase_on_stderr(tmp_path):
    """A line per phase on stderr (the collective phase's with the ranks recorded so far); the
    report alone on stdout."""
    r = python_m(
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--comm.mode",
        "fake_backend",
        "--comm.dry_run_json",
        str(tmp_path / "dry.json"),
        env={"NGPU": "2"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    progress = [line for line in r.stderr.splitlines() if line.startswith("dry run: ")]
    assert progress == [
        "dry run: checks done",
        "dry run: rank 0: model built on the meta device",
        "dry run: memory measured on 1 rank",
        "dry run: recording one step's collectives on 2 ranks",
        "dry run: collectives recorded on 2 of 2 ranks",
    ], r.stderr[-3000:]
    assert r.stdout.startswith("dry run: qwen2_moe/debug on 2 ranks (debug_moe.toml)\n"), r.stdout[:300]
    assert not set(progress) & set(r.stdout.splitlines())


def test_fake_backend_needs_ngpu(monkeypatch, capsys):
    from titan_fold.train import main

    monkeypatch.delenv("NGPU", raising=False)
    assert main(["--job.config_file", "debug_moe.toml", "--comm.mode", "fake_backend"]) == 2
    assert "NGPU" in capsys.readouterr().err


def test_local_tensor_mode_is_refused(monkeypatch, capsys):
    from titan_fold.train import main

    monkeypatch.setenv("NGPU", "4")
    assert main(["--job.config_file", "debug_moe.toml", "--comm.mode", "local_tensor"]) == 2
    assert "local_tensor" in capsys.readouterr().err


@pytest.mark.slow
def test_mismatched_dispatcher_is_caught(monkeypatch):
    """A dispatcher that skips the counts' all-gather over etp on one rank: the check names
    the etp group, the rank and the call site."""
    from titan_fold.moe import dispatcher as disp
    from titan_fold.parallel import experts

    class SkipsOneExchange(disp.TokenDispatcher):
        def _splits(self, counts, E_loc, rows):
            if dist.get_rank() == 3 and self.etp > 1:
                etp_mesh, self.etp_mesh = self.etp_mesh, None
                etp, self.etp = self.etp, 1
                try:
                    sp, rows_of_source = super()._splits(counts, E_loc, rows)
                finally:
                    self.etp_mesh, self.etp = etp_mesh, etp
                return disp.Splits(sp.send, sp.recv, [sum(sp.recv)] * etp), rows_of_source.repeat(etp, 1)
            return super()._splits(counts, E_loc, rows)

    c = config(
        "debug_moe.toml",
        "--parallelism.expert_parallel_degree",
        "4",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "1",
    )
    _, args, _ = dryrun.check_config(c, 8)
    assert dryrun.first_divergence(dryrun.record_collectives(c, 8, args)) is None
    # parallelize builds the dispatchers (parallel/experts.py)
    monkeypatch.setattr(experts, "TokenDispatcher", SkipsOneExchange)
    div = dryrun.first_divergence(dryrun.record_collectives(c, 8, args))
    assert div is not None
    assert div["rank"] == 3 or div["reference_rank"] == 3
    assert div["ranks"] == [2, 3]  # rank 3's etp group
    assert "dispatcher.py" in div["reference_issued"] + div["rank_issued"]


def test_banner():
    c = config("qwen2.toml")
    layout, args, _ = dryrun.check_config(c, 64)
    dryrun.init_fake_world(64, 0)
    layout.build_mesh("cpu")
    parts, _, fqns, _ = dryrun.build_rank(_dry_config(c), layout, args)
    text = banner(layout, args, parts, c, len(fqns))
    assert "pp 4 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 2" in text
    assert "pp 4 x edp 4 x ep 4 x etp 1; 16 of 64 experts per rank" in text
    assert "pipeline stages: 8 (2 on this rank)" in text
    numel = sum(local(p).numel() for part in parts for p in part.parameters())
    assert f"params {4 * numel / 2**30:.2f} GiB" in text


@pytest.mark.slow
def test_doc_excerpt_is_current():
    doc = (ROOT / "docs" / "dryrun.md").read_text()
    assert dryrun.excerpt_block(dryrun.doc_excerpt()) in doc, "run: python -m titan_fold.dryrun --update-docs"


# debug_moe at pp 2 x (dp_shard 2 | ep 2) on 4 ranks: stage 0 on ranks 0, 1, stage 1 on ranks
# 2, 3 (pp pairs 0-2 and 1-3); the schedules the packaged configs use
PP2 = {
    schedule: (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--training.local_batch_size",
        "2",
    )
    for schedule in ("1F1B", "Interleaved1F1B")
}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(PP2))
def test_pipeline_exchange_is_matched(schedule):
    """The real schedule runs on the fake process group; every send has its recv."""
    c = config("debug_moe.toml", *PP2[schedule])
    _, args, _ = dryrun.check_config(c, 4)
    per_group = dryrun.record_collectives(c, 4, args)
    assert dryrun.first_divergence(per_group) is None
    p2p = {pair: by_rank for (desc, pair), by_rank in per_group.items() if desc == dryrun.P2P}
    assert sorted(p2p) == [(0, 2), (1, 3)]
    stages = 2 * c.parallelism.pipeline_parallel_degree if schedule == "Interleaved1F1B" else 2
    micro = c.training.local_batch_size // c.parallelism.pipeline_parallel_microbatch_size
    small, small_args = dryrun.shrunk_config(c, args)
    hidden = [((c.parallelism.pipeline_parallel_microbatch_size, small.training.seq_len, small_args.dim), "float32")]
    for by_rank in p2p.values():
        # per micro-batch, each of the stages - 1 boundaries (all between the pair at pp 2)
        # carries the hidden states forward and their gradient back
        sends = [call for calls in by_rank.values() for call in calls if call["op"] == "send"]
        assert sum(call["shapes"] == hidden for call in sends) == 2 * (stages - 1) * micro


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["other shape", "skipped send"])
def test_broken_pipeline_exchange_is_caught(fault, monkeypatch):
    """Rank 1 (stage 0) sends its activations one token short, or not at all: the check names
    the pair 1 -> 3 and the pipelining call site."""
    from torch.distributed.pipelining import stage as pp_stage

    real = pp_stage._PipelineStageBase.get_fwd_send_ops

    def broken(self, fwd_chunk_id):
        ops = real(self, fwd_chunk_id)
        if dist.get_rank() != 1:
            return ops
        if fault == "skipped send":
            return []
        return [dist.P2POp(op.op, op.tensor[:, :-1].contiguous(), op.peer, op.group) for op in ops]

    c = config("debug_moe.toml", *PP2["1F1B"])
    _, args, _ = dryrun.check_config(c, 4)
    monkeypatch.setattr(pp_stage._PipelineStageBase, "get_fwd_send_ops", broken)
    div = dryrun.first_divergence(dryrun.record_collectives(c, 4, args))
    assert div is not None
    assert div["group"] == "p2p 1->3" and div["ranks"] == [1, 3] and div["rank"] == 1
    small, small_args = dryrun.shrunk_config(c, args)
    hidden = (c.parallelism.pipeline_parallel_microbatch_size, small.training.seq_len, small_args.dim)
    assert f"recv [({hidden}, 'float32')]" in div["reference_issued"]
    if fault == "skipped send":
        assert div["rank_issued"] == "nothing (sequence ended)"
    else:
        short = (hidden[0], hidden[1] - 1, hidden[2])
        assert f"send [({short}, 'float32')]" in div["rank_issued"] and "pipelining/" in div["rank_issued"]


def test_simulated_ranks_take_the_fake_counts():
    """A fake process group returns no values: every MoE layer of a simulated rank's trainer
    learns the other ranks' counts from dryrun/fake_counts.py, which takes every rank to route
    as this one does: rows spread evenly over the experts, as many back from each source."""
    import contextlib

    from titan_fold.moe import moe_layers

    c = config(
        "debug_moe.toml",
        "--parallelism.expert_parallel_degree",
        "4",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "1",
    )
    _, args, _ = dryrun.check_config(c, 8)
    E, rows = args.moe.num_experts, 3 * args.moe.num_experts + 2
    even = [rows // E + (e < rows % E) for e in range(E)]
    layers = []

    @contextlib.contextmanager
    def watch(trainer, layout, rank):
        for moe in moe_layers(trainer.model_parts):
            d = moe.dispatcher
            counts = torch.zeros(E, dtype=torch.int64)
            counts[0] = rows  # what this rank routed; the others' are made up
            assert d.counts.sources(d, counts, rows).tolist() == even * 2
            assert d.counts.on_host(d, counts, torch.zeros(2 * E, dtype=torch.int64), rows) == (even, even * 2)
            layers.append(rank)
        yield

    dryrun.record_collectives(c, 8, args, ranks=[0, 7], watch=watch)
    assert sorted(set(layers)) == [0, 7]  # both ranks' MoE layers checked
