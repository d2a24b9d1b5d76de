"""Pipeline parallelism: where the layers go, stage models, and PP runs equal to one rank.

The trainer runs start from the shared seed checkpoint and see the same global batch (8
sequences) in micro-batches of one sequence (so every MoE aux loss sees the same tokens),
in fp32, dropless; loss, grad norm and aux loss of 5 steps equal the one-rank run.
"""

from types import SimpleNamespace

import pytest
import torch
from helpers import assert_matches_one_rank, train_from_seed

from titan_fold.models import FLAVORS, Transformer
from titan_fold.moe import MoE
from titan_fold.parallel.mesh import LayoutError
from titan_fold.parallel.pipeline import StageHooks, TokenNormalizedLoss, stage_fqns, stage_model

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

EMB, HEAD = ["tok_embeddings"], ["norm", "output"]


def layers(*ids):
    return [f"layers.{i}" for i in ids]


def parallelism(schedule="1F1B", layers_per_stage=None, fqns=None, first_less=1, last_less=1):
    # the [parallelism] keys stage_fqns reads, with torchtitan's defaults
    return SimpleNamespace(
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_layers_per_stage=layers_per_stage,
        module_fqns_per_model_part=fqns,
        pipeline_parallel_first_stage_less_layers=first_less,
        pipeline_parallel_last_stage_less_layers=last_less,
    )


@pytest.mark.parametrize(
    "config, n_layers, pp, expected",
    [
        # one stage per rank; embedding and head each weigh one block
        (parallelism("1F1B"), 4, 2, [EMB + layers(0, 1), layers(2, 3) + HEAD]),
        (parallelism("GPipe"), 5, 2, [EMB + layers(0, 1, 2), layers(3, 4) + HEAD]),  # ties: the earlier stage
        (parallelism("GPipe", first_less=0, last_less=2), 5, 2, [EMB + layers(0, 1, 2, 3), layers(4) + HEAD]),
        (parallelism("1F1B"), 8, 4, [EMB + layers(0, 1), layers(2, 3, 4), layers(5, 6), layers(7) + HEAD]),
        # looped: two stages per rank by default, every stage at least one block
        (parallelism("Interleaved1F1B"), 4, 2, [EMB + layers(0), layers(1), layers(2), layers(3) + HEAD]),
        (parallelism("Interleaved1F1B"), 6, 2, [EMB + layers(0), layers(1, 2), layers(3, 4), layers(5) + HEAD]),
        # ceil((8 + 1 + 1) / 3) = 4 stages
        (
            parallelism("Interleaved1F1B", layers_per_stage=3),
            8,
            2,
            [EMB + layers(0, 1), layers(2, 3, 4), layers(5, 6), layers(7) + HEAD],
        ),
        (
            parallelism("1F1B", fqns=[EMB, layers(0, 1, 2), layers(3) + HEAD]),
            4,
            3,
            [EMB, layers(0, 1, 2), layers(3) + HEAD],
        ),
    ],
)
def test_stage_split(config, n_layers, pp, expected):
    assert stage_fqns(config, n_layers, pp) == expected


@pytest.mark.parametrize(
    "config, n_layers, pp, match",
    [
        (parallelism("1F1B"), 3, 4, "at least as many layers"),
        (parallelism("Interleaved1F1B"), 3, 2, "at least as many layers"),
        (parallelism("1F1B", layers_per_stage=2), 4, 2, "one stage per rank"),  # 3 stages
        (parallelism("Interleaved1F1B", layers_per_stage=4), 8, 4, "multiple of pp"),  # 3 stages
        (parallelism("1F1B", fqns=[EMB + layers(1), layers(0) + HEAD]), 2, 2, "in this order"),
        (parallelism("1F1B", fqns=[EMB + layers(0, 1), HEAD]), 3, 2, "once each"),
        (parallelism("ZBVZeroBubble"), 4, 2, "supported are"),
    ],
)
def test_stage_split_rejects(config, n_layers, pp, match):
    with pytest.raises(LayoutError, match=match):
        stage_fqns(config, n_layers, pp)


@pytest.mark.parametrize(
    "args, match",
    [
        (("--training.local_batch_size", "1"), "1 pipeline micro-batches .* 1F1B needs at least pp = 2"),
        (
            ("--training.local_batch_size", "5", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
            "Interleaved1F1B needs a multiple of 2",
        ),
        (
            ("--training.local_batch_size", "3", "--parallelism.pipeline_parallel_microbatch_size", "2"),
            "not a multiple",
        ),
        (("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"), "supported are"),
    ],
)
def test_preflight_checks_the_pipeline(args, match):
    import torch.distributed as dist

    from titan_fold.common.config import parse_args
    from titan_fold.trainer.preflight import preflight

    config = parse_args(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.global_batch_size",
            "40",
            *args,
        ]
    )
    with pytest.raises(LayoutError, match=match):
        preflight(config, 2)
    assert not dist.is_initialized()


def test_stage_models_chain_to_the_whole_model():
    torch.manual_seed(0)
    model = Transformer(FLAVORS["qwen2_moe"]["debug"])
    model.init_weights()
    fqns = stage_fqns(parallelism("Interleaved1F1B"), model.args.n_layers, 2)
    parts = [stage_model(model, f) for f in fqns]
    # each stage holds exactly its modules' parameters, under the whole model's names
    whole = {n for n, _ in model.named_parameters()}
    held = [{n for n, _ in p.named_parameters()} for p in parts]
    assert set().union(*held) == whole and sum(map(len, held)) == len(whole)
    for names, f in zip(held, fqns, strict=True):
        assert names == {n for n in whole if any(n.startswith(m + ".") for m in f)}
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    h = tokens
    for p in parts:
        h = p(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


def test_stage_hooks_aux_scale():
    torch.manual_seed(0)
    model = stage_model(Transformer(FLAVORS["qwen2_moe"]["debug"]), layers(1, 2))
    model.to_empty(device="cpu")
    model.init_weights()
    StageHooks(model)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    x = torch.randn(2, 8, model.args.dim)
    # the stages get their shapes up front (pipeline.stage_io): the schedule runs no
    # shape-learning pass, so every forward is a real micro-batch whose statistics count
    model(x, aux_loss_scale=torch.tensor([0.25, 0.5])).sum().backward()
    assert all(m.stats[3] == 1 for m in moes)
    scale = torch.tensor([0.125, 0.25])
    model(x, aux_loss_scale=scale)
    model(x, aux_loss_scale=scale)
    for m in moes:
        assert m.stats[3] == 3 and m.aux_loss_scale.item() == 0.375
    # a stage without MoE layers takes the kwarg too
    dense = stage_model(Transformer(FLAVORS["qwen2_moe"]["debug"]), EMB)
    dense.to_empty(device="cpu")
    dense.init_weights()
    StageHooks(dense)
    assert dense(torch.zeros(1, 4, dtype=torch.long), aux_loss_scale=scale).shape == (1, 4, model.args.dim)


def test_token_normalized_loss():
    loss = TokenNormalizedLoss(lambda pred, labels: (pred - labels).square().sum())
    loss.scale = 1 / torch.tensor(8.0)
    assert loss(torch.tensor([3.0, 1.0]), torch.tensor([1.0, 1.0])).item() == 0.5


# ---- trainer runs -------------------------------------------------------------------

STEPS = 5
BATCH = ("--training.global_batch_size", "8", "--parallelism.pipeline_parallel_microbatch_size", "1")

LAYOUTS = {
    # attention pp2 dp1, experts pp2 ep1: 2 grad-accumulation steps of 4 pipeline micro-batches
    # with full activation checkpointing: backward recomputes the MoE layers
    "pp2_1F1B_ac": (2, ("--training.local_batch_size", "4", "--activation_checkpoint.mode", "full"), "1F1B"),
    # attention pp2 dp2, experts pp2 edp2 with op-level selective AC: the experts' FSDP unit runs
    # inside the recompute (parallelize.keep_profiler_ranges_out_of_sac); the reference has no AC
    "pp2_edp2_1F1B_op_sac": (
        4,
        (
            "--training.local_batch_size",
            "4",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ),
        "1F1B",
    ),
    "pp2_GPipe": (2, ("--training.local_batch_size", "4"), "GPipe"),
    # layout (d) of tests/test_placement.py: attention pp2 tp2 dp2, experts pp2 ep4 etp1 (tp folded into ep)
    "d_pp2_tp2_dp2_ep4_1F1B": (
        8,
        (
            "--training.local_batch_size",
            "4",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "4",
        ),
        "1F1B",
    ),
    # attention pp2 cp2, experts pp2 ep2: 8 micro-batches of one sequence cut in cp chunks,
    # two stages per rank
    "pp2_cp2_ep2_Interleaved1F1B": (
        4,
        (
            "--training.local_batch_size",
            "8",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
        ),
        "Interleaved1F1B",
    ),
}


def run(folder, nproc, args, seed_checkpoint) -> list[dict]:
    return train_from_seed(folder, nproc, seed_checkpoint, STEPS, *BATCH, *args)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_one_rank(name, one_rank_reference, tmp_path, seed_checkpoint):
    nproc, args, schedule = LAYOUTS[name]
    got = run(
        tmp_path,
        nproc,
        (*args, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule),
        seed_checkpoint,
    )
    assert len(got) == STEPS
    # the load imbalance is measured on each rank's tokens: a sequence shard under tp (sequence
    # parallel) or cp
    keys = ("loss", "grad_norm", "moe_aux_loss") + (
        () if "tp2" in name or "cp2" in name else ("expert_load_imbalance",)
    )
    assert_matches_one_rank(one_rank_reference, got, name, keys=keys, abs=0)
