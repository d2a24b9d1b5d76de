"""Dry run: the collectives of one training step on every rank of each packaged job config at
its real world size (shrunk model, same layout), all members of every group and every pipeline
pair of ranks matched. A file of its own: the 64- and 128-rank worlds are the suite's longest
checks, and pytest-xdist (`--dist loadfile`) runs them beside the rest."""

import pytest
import torch.distributed as dist
from helpers import WORLD, config
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from titan_fold import dryrun

# one step of one rank costs about 0.3-0.6 CPU s (DTensor's sharding decisions shared by the
# ranks, weights initialized on the local shards: dryrun.SharedShardingDecisions, _init_weights):
# qwen2.toml (64 ranks) and both Mixtral configs (128) together about 125 CPU s


@pytest.fixture(autouse=True)
def no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# deepseek_v3_671b.toml's 1024 ranks x 256 pipeline micro-batches take too long here: its dry
# run (memory of every stage) is tests/test_dryrun.py's
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n in WORLD if WORLD[n] <= 128))
def test_packaged_config_collectives_match(name):
    """Every rank of the real world size records its own step; all members of every group
    issue the same sequence, every pipeline send meets its recv, and every parameter's
    gradient is reduced as the placement plan says (dryrun/gradients.py)."""
    c = config(name)
    _, args, _ = dryrun.check_config(c, WORLD[name])
    gradients = dryrun.gradient_check(c, WORLD[name], args)
    per_group = dryrun.record_collectives(c, WORLD[name], args, watch=gradients.watch)
    assert dryrun.first_divergence(per_group) is None
    # the same step: every parameter's reductions and norm share on every rank as the plan says
    report = gradients.report()
    assert report["ranks"] == list(range(WORLD[name])) and report["mismatches"] == []
    assert sum(len(calls) for g in per_group.values() for calls in g.values()) > 0
    # every rank recorded its own sequence, every pp pair its send/recv
    assert set().union(*(g.keys() for g in per_group.values())) == set(range(WORLD[name]))
    # pp pairs: a ring of pp per pp group under a looped schedule (several stages a rank, as
    # Interleaved1F1B), a chain of pp - 1 under a single-stage one (1F1B); one pair at pp 2
    pp = c.parallelism.pipeline_parallel_degree
    looped = issubclass(get_schedule_class(c.parallelism.pipeline_parallel_schedule), PipelineScheduleMulti)
    pairs = WORLD[name] if looped and pp > 2 else WORLD[name] // pp * (pp - 1)
    assert sum(desc == dryrun.P2P for desc, _ in per_group) == pairs


def test_selective_ac_under_pipeline_schedule():
    """qwen2.toml as shipped: rank 0's training step (pp 4, Interleaved1F1B, op-level selective AC
    with the experts' FSDP unit over edp 4 inside the recompute)."""
    c = config("qwen2.toml")
    _, args, _ = dryrun.check_config(c, 64)
    assert dryrun.first_divergence(dryrun.record_collectives(c, 64, args, ranks=[0])) is None


def test_shared_sharding_decisions_change_nothing():
    """Ranks recorded in one pass (DTensor's sharding decisions computed once, handed to each
    rank with its own meshes) issue exactly what each rank recorded alone issues: every call's
    op, shapes, integers, peer and call site (tp, ep, etp, FSDP on both meshes, pp 2 x 2 stages)."""
    c = config(
        "debug_moe.toml",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--training.local_batch_size",
        "2",
    )
    _, args, _ = dryrun.check_config(c, 8)
    together = dryrun.record_collectives(c, 8, args)
    alone: dict = {}
    for r in range(8):
        for key, by_rank in dryrun.record_collectives(c, 8, args, ranks=[r]).items():
            alone.setdefault(key, {}).update(by_rank)
    assert together == alone
    assert any(desc == dryrun.P2P for desc, _ in together) and len(together) > 8
