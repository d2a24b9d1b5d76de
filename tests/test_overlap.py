"""Two micro-batches overlapped layer by layer (moe.ep_overlap = "batch", parallel/overlap.py), and
the trainer with it and with the weight-gradient split (its "wgrad" values).

On 4 gloo ranks in fp32, a small Qwen2-MoE (a dense first layer, shared expert with gate,
aux and z losses) whose experts are spread over ep 2 (edp 2), ep 4 and ep 2 x etp 2: the
overlapped schedule over 3 accumulated micro-batches gives every rank the losses and every
parameter gradient of plain gradient accumulation, with the weight-gradient split on and
off. The recorded order of the pieces is the interleaving the schedule promises. Under pp 2
x ep 2, a 4-layer model's Schedule1F1B and ScheduleInterleaved1F1B with their steady state
overlapped give the plain schedule's losses and every gradient. The trainer with either key
gives the one-rank run's losses and gradient norms (FSDP2, sequence and context parallel
attention, etp, edp, both under the pipeline schedules); bad combinations end in one line
naming the key; the dry runs of qwen2.toml (64 ranks, pp 1 and pp 2) and mixtral_8x22b.toml
(128 ranks, pp 2) with the overlap match their collectives and pipeline sends.
"""

import dataclasses
import functools
import itertools
import re

import pytest
import torch
import torch.distributed as dist
from helpers import assert_matches_one_rank, train_from_seed
from launcher import end_rank_checks, expert_meshes, fork_ranks, run_checks, start_rank

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

WORLD = 4
LAYOUTS = [(2, 1), (4, 1), (2, 2)]  # (ep, etp)
MICRO_BATCHES = 3


def build(ep_mesh, etp_mesh, delay, n_layers=3):
    """The model, its experts spread over ep_mesh x etp_mesh (None: not yet)."""
    from titan_fold.models import FLAVORS, Transformer
    from titan_fold.parallel.experts import shard_moe

    args = FLAVORS["qwen2_moe"]["debug"]
    moe_args = dataclasses.replace(args.moe, z_loss_coeff=1e-3, ep_overlap="batch_wgrad" if delay else "batch")
    args = dataclasses.replace(args, n_layers=n_layers, first_k_dense=1, moe=moe_args)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    for block in model.layers.values():
        if block.moe_enabled and ep_mesh is not None:
            shard_moe(block.moe, ep_mesh, etp_mesh)
    return model


def batches():
    g = torch.Generator().manual_seed(dist.get_rank())
    return [
        (torch.randint(0, 512, (2, 16), generator=g), torch.randint(0, 512, (2, 16), generator=g))
        for _ in range(MICRO_BATCHES)
    ]


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def reference(ep_mesh, etp_mesh):
    model = build(ep_mesh, etp_mesh, delay=False)
    losses = []
    for tokens, labels in batches():
        loss = loss_fn(model(tokens), labels) / 100.0
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}


def overlapped(ep_mesh, etp_mesh, delay):
    from titan_fold.moe.wgrad import flush_wgrad
    from titan_fold.parallel.overlap import OverlapSchedule

    model = build(ep_mesh, etp_mesh, delay)
    schedule = OverlapSchedule(model, MICRO_BATCHES)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        losses = [schedule.step(tokens, labels, lambda x, y: loss_fn(x, y) / 100.0) for tokens, labels in batches()]
    flush_wgrad(model)
    order = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.name.startswith("overlap:")]
    return losses, {n: p.grad for n, p in model.named_parameters()}, order


def check_order(order, ep):
    """Between micro-batch 0's backward and 1's forward: each all-to-all of one is issued
    before the other's next compute piece, which runs while it travels."""
    assert order[0] == "overlap:mb0 forward embed", order[:3]
    pair = order[order.index("overlap:mb0 backward head") :]
    pair = pair[: pair.index("overlap:mb1 forward head") + 1]
    if ep == 1:
        return
    expected_start = [
        "overlap:mb0 backward head",
        "overlap:mb0 backward layer2 post",
        "overlap:mb0 backward layer2 combine a2a",  # issued ...
        "overlap:mb1 forward embed",  # ... then the other micro-batch computes
        "overlap:mb1 forward layer0 dense",
        "overlap:mb1 forward layer1 attention",
        "overlap:mb1 forward layer1 dispatch a2a",
        "overlap:mb0 backward layer2 experts",
        "overlap:mb0 backward layer2 dispatch a2a",
        "overlap:mb1 forward layer1 experts",
        "overlap:mb1 forward layer1 combine a2a",
    ]
    assert pair[: len(expected_start)] == expected_start, pair


def assert_same_numbers(losses, grads, ref_losses, ref_grads, label):
    """The losses (a rank without the last stage has none) and every gradient of a run equal the
    reference run's, in fp32."""
    assert len(losses) == len(ref_losses), label
    if losses:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-7)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref is not None and grads[name] is not None, name
        torch.testing.assert_close(
            grads[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{label} grad of {name}: {m}"
        )


def case(ep_mesh, etp_mesh, ep):
    ref_losses, ref_grads = reference(ep_mesh, etp_mesh)
    for delay in (False, True):
        losses, grads, order = overlapped(ep_mesh, etp_mesh, delay)
        assert_same_numbers(losses, grads, ref_losses, ref_grads, f"delay={delay}")
        check_order(order, ep)
        if delay:
            flushes = [i for i, e in enumerate(order) if e.endswith("experts W")]
            assert flushes, "no weight gradient was delayed"
            assert all(order[i + 1].endswith("attention") and "backward" in order[i + 1] for i in flushes), order


def worker(rank, port, out_dir):
    start_rank(rank, port, WORLD)
    failures = []
    for ep, etp, _, ep_mesh, etp_mesh in expert_meshes(LAYOUTS, WORLD):
        failures += run_checks([("", functools.partial(case, ep_mesh, etp_mesh, ep))], f"ep={ep} etp={etp}")
    end_rank_checks(out_dir, rank, failures)


def test_overlapped_micro_batches_match_gradient_accumulation(tmp_path):
    failures = fork_ranks(worker, WORLD, tmp_path)
    assert not failures, "\n".join(failures)[:20000]


# ---- under the pipeline schedules: pp 2 x ep 2 -------------------------------------------

PP_MICRO_BATCHES = 4


def pipeline_run(pp_mesh, ep_mesh, schedule_name, overlap, delay):
    """One step of a 4-layer model cut into stages over pp 2, the experts over ep 2, by the
    schedule alone or with its steady state overlapped; -> (losses on the last stage, every
    parameter gradient of this rank's stages by name)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    from titan_fold.moe.wgrad import flush_wgrad
    from titan_fold.parallel.experts import shard_moe
    from titan_fold.parallel.overlap import overlapped_pipeline
    from titan_fold.parallel.pipeline import StageHooks, split_layers, stage_model

    cls = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}[schedule_name]
    model = build(None, None, delay, n_layers=4)
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp * (1 if cls is Schedule1F1B else 2)
    fqns = split_layers(4, num_stages)
    meta = torch.device("meta")
    hidden = torch.empty(1, 16, model.args.dim, device=meta, requires_grad=True)
    stages, parts, hooks = [], [], []
    for s in range(rank, num_stages, pp):
        part = stage_model(model, fqns[s])
        for block in part.layers.values():
            if block.moe_enabled:
                shard_moe(block.moe, ep_mesh, None)
        parts.append(part)
        hooks.append(StageHooks(part))
        first = torch.empty(1, 16, dtype=torch.int64, device=meta) if s == 0 else hidden
        last = torch.empty(1, 16, 512, device=meta, requires_grad=True) if s == num_stages - 1 else hidden
        stages.append(
            PipelineStage(
                part, s, num_stages, torch.device("cpu"), input_args=first, output_args=last, group=pp_mesh.get_group()
            )
        )

    def loss(x, y):
        return loss_fn(x, y) / 100.0

    if overlap:
        schedule = overlapped_pipeline(cls, stages, PP_MICRO_BATCHES, loss, [h.pre_forward for h in hooks])
    else:
        schedule = cls(
            stages[0] if cls is Schedule1F1B else stages,
            n_microbatches=PP_MICRO_BATCHES,
            loss_fn=loss,
            scale_grads=False,
        )
    g = torch.Generator().manual_seed(dist.get_rank() // pp)  # the ep ranks see different batches
    tokens = torch.randint(0, 512, (PP_MICRO_BATCHES, 16), generator=g)
    labels = torch.randint(0, 512, (PP_MICRO_BATCHES, 16), generator=g)
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        schedule.step(
            *((tokens,) if has_first else ()),
            aux_loss_scale=torch.full((PP_MICRO_BATCHES,), 0.125),
            target=labels if has_last else None,
            losses=losses,
            return_outputs=False,
        )
    flush_wgrad(parts)
    grads = {
        f"stage{st.stage_index}.{n}": p.grad
        for st, part in zip(stages, parts, strict=True)
        for n, p in part.named_parameters()
    }
    order = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.name.startswith("overlap:")]
    return losses, grads, order


def interleaved(order) -> bool:
    """Some micro-batch's backward all-to-all is followed by another micro-batch's forward."""
    pattern = re.compile(r"overlap:mb(\d+) (backward|forward) ")
    steps = [(m.group(1), m.group(2), name) for name in order if (m := pattern.match(name))]
    return any(
        a[1] == "backward" and a[2].endswith("a2a") and b[1] == "forward" and b[0] != a[0]
        for a, b in itertools.pairwise(steps)
    )


def pipeline_case(pp_mesh, ep_mesh, schedule_name):
    # every run before any check: a rank's failed check must not skip collectives the others issue
    ref_losses, ref_grads, ref_order = pipeline_run(pp_mesh, ep_mesh, schedule_name, overlap=False, delay=False)
    assert not ref_order
    runs = {delay: pipeline_run(pp_mesh, ep_mesh, schedule_name, overlap=True, delay=delay) for delay in (False, True)}
    for delay, (losses, grads, order) in runs.items():
        assert interleaved(order), order
        assert_same_numbers(losses, grads, ref_losses, ref_grads, f"{schedule_name} delay={delay}")


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_paired_pipeline_orders_lower(pp):
    """Schedule1F1B's and ScheduleInterleaved1F1B's orders at pp 2 .. 8, their steady state
    paired: each pair is a forward and a backward of other micro-batches or stages, and
    torch's lowering places every send and recv (it raises on an order it cannot)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import (
        FORWARD,
        OVERLAP_F_B,
        ScheduleInterleaved1F1B,
        _add_send_recv,
    )

    from titan_fold.parallel.overlap import one_f_one_b, pair_steady_state

    n = 2 * pp
    # the interleaved order as ScheduleInterleaved1F1B computes it, without building stages
    looped = SimpleNamespace(
        pp_group_size=pp, n_local_stages=2, _n_microbatches=n, number_of_rounds=2, microbatches_per_round=pp
    )
    for stages, order in (
        (pp, lambda r: one_f_one_b(r, pp, n)),
        (2 * pp, lambda r: ScheduleInterleaved1F1B._calculate_single_rank_operations(looped, r)),
    ):
        paired = {r: [a for a in pair_steady_state(order(r)) if a is not None] for r in range(pp)}
        for r, actions in paired.items():
            pairs = [a.sub_actions for a in actions if a.computation_type == OVERLAP_F_B]
            assert pairs, (stages, r)  # a steady state on every pp rank
            for f, b in pairs:
                assert f.computation_type == FORWARD and (f.stage_index, f.microbatch_index) != (
                    b.stage_index,
                    b.microbatch_index,
                )
        _add_send_recv(paired, stage_to_rank=lambda s: s % pp, num_stages=stages)


def pipeline_worker(rank, port, out_dir):
    start_rank(rank, port, WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    checks = [
        (name, lambda name=name: pipeline_case(mesh["pp"], mesh["ep"], name)) for name in ("1F1B", "Interleaved1F1B")
    ]
    end_rank_checks(out_dir, rank, run_checks(checks, "schedule"))


def test_overlapped_pipeline_matches_the_schedule(tmp_path):
    """pp 2 x ep 2: Schedule1F1B and ScheduleInterleaved1F1B with their steady state's
    (backward, forward) pairs overlapped give the plain schedule's losses and gradients."""
    failures = fork_ranks(pipeline_worker, WORLD, tmp_path)
    assert not failures, "\n".join(failures)[:20000]


# ---- the trainer: the one-rank run's numbers with the options on ----------------------------

# (ranks, args); every run sees the global batch of 8 sequences in micro-batches of one, as
# the one-rank reference: 4 micro-batches per rank at dp 2, 2 at dp 4
TRAINER_RUNS = {
    # the split alone: W in the dispatch backward, also when the MoE layers are recomputed
    "delay_dp2_ep2_moe_recompute": (
        2,
        (
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "wgrad",
            "--activation_checkpoint.mode",
            "moe_layers",
        ),
    ),
    # under the pipeline schedules, which run each stage's backward in one piece
    "delay_pp2_dp2_ep2_1F1B": (
        4,
        (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "wgrad",
        ),
    ),
    "delay_pp2_cp2_ep2_Interleaved1F1B": (
        4,
        (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "wgrad",
        ),
    ),
    # FSDP2 over edp 2: W before the experts unit's reduce-scatter
    "delay_dp4_ep2_edp2": (4, ("--parallelism.expert_parallel_degree", "2", "--moe.ep_overlap", "wgrad")),
    # the overlap, FSDP2 over dp 2 for the dense layers
    "overlap_dp2_ep2": (
        2,
        ("--parallelism.expert_parallel_degree", "2", "--moe.ep_overlap", "batch_wgrad"),
    ),
    # sequence parallel attention, the MoE on each tp rank's tokens
    "overlap_tp2_ep2": (
        2,
        (
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "batch_wgrad",
        ),
    ),
    "overlap_dp4_ep2_etp2": (
        4,
        (
            "--parallelism.expert_parallel_degree",
            "2",
            "--parallelism.expert_tensor_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "batch_wgrad",
        ),
    ),
    "overlap_dp4_ep2_edp2": (4, ("--parallelism.expert_parallel_degree", "2", "--moe.ep_overlap", "batch")),
    # under the pipeline schedules: each steady-state (backward, forward) pair overlapped, FSDP2
    # over dp 2 for the dense layers of each stage
    "overlap_pp2_dp2_ep2_1F1B": (
        4,
        (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "batch_wgrad",
        ),
    ),
    "overlap_pp2_cp2_ep2_Interleaved1F1B": (
        4,
        (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "batch",
        ),
    ),
    # FSDP2 over edp 2 for the experts too (attention pp2 dp4, experts pp2 ep2 edp2); 2 pipeline
    # micro-batches: one overlapped pair, on the last stage
    "overlap_pp2_dp4_ep2_edp2_1F1B": (
        8,
        (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "batch_wgrad",
        ),
    ),
    # cp's load-balanced chunks: the pieces take the global positions for RoPE
    "overlap_cp2_ep2": (
        2,
        (
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--moe.ep_overlap",
            "batch_wgrad",
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(TRAINER_RUNS))
def test_trainer_matches_one_rank(name, one_rank_reference, tmp_path, seed_checkpoint):
    nproc, args = TRAINER_RUNS[name]
    got = train_from_seed(
        tmp_path,
        nproc,
        seed_checkpoint,
        5,
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "8",
        *args,
    )  # a later --training.local_batch_size wins
    assert len(got) == 5
    assert_matches_one_rank(one_rank_reference, got, name)


@pytest.mark.parametrize(
    "args, match",
    [
        (
            (
                "--moe.ep_overlap",
                "wgrad",
            ),
            "moe.ep_overlap = 'wgrad' with parallelism.expert_parallel_degree = 1",
        ),
        (
            (
                "--moe.ep_overlap",
                "batch",
            ),
            "moe.ep_overlap = 'batch' with parallelism.expert_parallel_degree = 1",
        ),
        (
            (
                "--parallelism.expert_parallel_degree",
                "2",
                "--moe.ep_overlap",
                "batch",
                "--training.global_batch_size",
                "4",
            ),
            "moe.ep_overlap = 'batch' needs at least 2 micro-batches per step",
        ),
        (
            (
                "--parallelism.expert_parallel_degree",
                "2",
                "--moe.ep_overlap",
                "batch",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "4",
                "--parallelism.pipeline_parallel_schedule",
                "GPipe",
            ),
            "moe.ep_overlap = 'batch' with parallelism.pipeline_parallel_schedule = 'GPipe'",
        ),
        (
            (
                "--parallelism.expert_parallel_degree",
                "2",
                "--moe.ep_overlap",
                "batch",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "4",
                "--activation_checkpoint.mode",
                "full",
            ),
            "moe.ep_overlap = 'batch' with activation_checkpoint.mode = 'full'",
        ),
        (
            ("--parallelism.expert_parallel_degree", "2", "--moe.ep_overlap", "wgrad", "--compile.enable"),
            "moe.ep_overlap = 'wgrad' with compile.enable",
        ),
        (
            (
                "--parallelism.expert_parallel_degree",
                "2",
                "--moe.ep_overlap",
                "batch",
                "--training.global_batch_size",
                "16",
                "--activation_checkpoint.mode",
                "full",
            ),
            "moe.ep_overlap = 'batch' with activation_checkpoint.mode = 'full'",
        ),
    ],
)
def test_refused_with_the_key(args, match):
    from titan_fold.common.config import ConfigError, parse_args
    from titan_fold.trainer.preflight import check_layout

    with pytest.raises(ConfigError, match=re.escape(match)):  # parse_args's rules, or the layout's
        check_layout(parse_args(["--job.config_file", "debug_moe.toml", "--training.local_batch_size", "2", *args]), 4)


# (config, world size, overrides): the packaged layouts at a quarter of their world, every group
# kind kept (dp_shard and edp shrink, -1 in the files), global batches cut alike so that each rank
# runs the micro-batches it runs at the full world. qwen2.toml at pp 1 (dp_shard 8 x tp 2, ep 4 x
# edp 4) and at pp 2 with its Interleaved1F1B (dp_shard 4 x tp 2, ep 4 x edp 2); mixtral_8x22b.toml
# at pp 2 1F1B (dp_shard 8 x tp 2, ep 8 x edp 2; 1F1B needs at least pp micro-batches). pp 2:
# every rank's step runs 2 pp pipeline micro-batches, pp 4 would take minutes here
QUARTER = ("--training.global_batch_size", "64")
DRY_RUNS = {
    "qwen2_pp1": ("qwen2.toml", 16, ("--parallelism.pipeline_parallel_degree", "1", *QUARTER)),
    "qwen2_pp2_Interleaved1F1B": ("qwen2.toml", 16, ("--parallelism.pipeline_parallel_degree", "2", *QUARTER)),
    "mixtral_pp2_1F1B": (
        "mixtral_8x22b.toml",
        32,
        (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--training.local_batch_size",
            "4",
            *QUARTER,
        ),
    ),
}


@pytest.mark.parametrize("name", list(DRY_RUNS))
def test_dry_run_collectives_match_with_overlap(name):
    """Every rank's overlapped step (two micro-batches without pp; under pp, a steady state of
    pairs on every pp rank) issues what the other members of each of its groups issue, and
    every pipeline send meets its recv."""
    from helpers import config

    from titan_fold import dryrun

    file, world, overrides = DRY_RUNS[name]
    try:
        c = config(
            file,
            *overrides,
            "--activation_checkpoint.mode",
            "none",
            "--compile.no-enable",
            "--moe.ep_overlap",
            "batch_wgrad",
        )
        _, args, _ = dryrun.check_config(c, world)
        per_group = dryrun.record_collectives(c, world, args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert dryrun.first_divergence(per_group) is None
    assert set().union(*(g.keys() for g in per_group.values())) == set(range(world))
    # the ep all-to-alls of both micro-batches, forward and backward, come from the schedule's pieces
    sites = {call["site"] for g in per_group.values() for calls in g.values() for call in calls}
    assert any("parallel/overlap.py" in site for site in sites), sorted(sites)[:20]
    if c.parallelism.pipeline_parallel_degree > 1:
        assert any(desc == dryrun.P2P for desc, _ in per_group)
