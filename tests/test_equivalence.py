"""Folded layouts reproduce the one-rank run: loss and gradient norm of the first steps.

Every run starts from the same seed checkpoint, sees the same global batch (8 sequences)
in micro-batches of one sequence (so the per-micro-batch aux loss sees the same tokens in
every layout), in fp32, dropless. The one-rank run accumulates 8 micro-batches per step.
"""

import pytest
from conftest import read_metrics, torchrun

STEPS = 5
BATCH = ("--training.local_batch_size", "1", "--training.global_batch_size", "8")

LAYOUTS = {
    # attention dp 4; experts ep 2 x etp 1 x edp 2
    "dp4_ep2_edp2": (4, ("--parallelism.expert_parallel_degree", "2")),
    # attention dp 8; experts ep 4 x etp 2 x edp 1: EP and ETP fold over data-parallel ranks
    "dp8_ep4_etp2": (8, ("--parallelism.expert_parallel_degree", "4", "--parallelism.expert_tensor_parallel_degree", "2")),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, seed_checkpoint):
    return run(tmp_path_factory.mktemp("ref"), 1, (), seed_checkpoint)


def run(folder, nproc, args, seed_checkpoint) -> list[dict]:
    torchrun(nproc, "--job.dump_folder", str(folder), "--checkpoint.enable", "--checkpoint.initial_load_path",
             seed_checkpoint, "--checkpoint.interval", "1000", "--training.steps", str(STEPS),
             "--metrics.log_freq", "1", *BATCH, *args)
    return read_metrics(folder)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_one_rank(name, reference, tmp_path, seed_checkpoint):
    nproc, args = LAYOUTS[name]
    folded = run(tmp_path, nproc, args, seed_checkpoint)
    assert len(folded) == len(reference) == STEPS
    for ref, got in zip(reference, folded):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (name, ref["step"])
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (name, ref["step"])
        assert got["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=1e-4), (name, ref["step"])
