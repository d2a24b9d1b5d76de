"""Qwen3.5-MoE under folded layouts reproduces the one-rank run: Gated DeltaNet layers on tp by heads
with sequence parallelism, the gated full attention, the gated shared expert, pp, ep x etp and
experts sharded over edp, on packed documents (the linear attention's state restarts at each).

As tests/test_equivalence.py: one seed checkpoint, the same global batch of 8 sequences in
micro-batches of one (two pipeline micro-batches under pp), fp32, dropless; loss, gradient norm,
aux loss and each parameter group's gradient and update norms within 1e-4. Two launches cover
the foldings: pp 2 x tp 2 x dp 2 with ep 2 x etp 2, and tp 2 x dp 2 with ep 2 x edp 2. Context
parallelism is refused for these models (test_context_parallelism_is_refused).
"""

import pytest
from helpers import BATCH, STEPS, assert_matches_one_rank, degrees, torchrun, train_from_seed

from titan_fold.common.config import ConfigError, parse_args
from titan_fold.trainer.preflight import check_layout

CONFIG = "debug_qwen3_5_moe.toml"
DOCUMENTS = ("--training.document_masking", "True")
PP2 = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "2",
    "--parallelism.pipeline_parallel_microbatch_size",
    "1",
)
LAYOUTS = {
    # stage 0: layers 0-1 (linear), stage 1: layers 2-3 (linear, full)
    "pp2_tp2_dp2_ep2_etp2": (8, (*degrees(tp=2, ep=2, etp=2), *PP2)),
    "tp2_dp2_ep2_edp2": (4, degrees(tp=2, ep=2)),
}


def run(folder, nproc, seed_checkpoint, *args) -> list[dict]:
    return train_from_seed(folder, nproc, seed_checkpoint, STEPS, *BATCH, *DOCUMENTS, *args, config=CONFIG)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("seed_qwen35")
    torchrun(
        1, "--job.dump_folder", str(root), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", config=CONFIG
    )
    return str(root / "checkpoint" / "step-0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, seed) -> list[dict]:
    return run(tmp_path_factory.mktemp("ref_qwen35"), 1, seed)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_qwen35_layout_matches_one_rank(name, reference, tmp_path, seed):
    nproc, args = LAYOUTS[name]
    folded = run(tmp_path, nproc, seed, *args)
    assert {"attention", "shared_experts", "routed_experts", "norms"} <= set(reference[0]["group_grad_norms"])
    assert_matches_one_rank(reference, folded, name)


def test_context_parallelism_is_refused():
    config = parse_args(["--job.config_file", CONFIG, "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="context_parallel_degree = 2 with qwen3_5_moe debug: linear attention"):
        check_layout(config, 2)
