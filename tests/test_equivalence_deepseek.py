"""DeepSeek-V3 under folded layouts reproduces the one-rank run: multi-head latent attention on
tp (colwise up-projections, replicated down-projections and rotary key) and cp (its rope and
nope key parts gathered with the values), group-limited routing with the aux-free bias, the
shared expert, and a Multi-Token Prediction layer, all at once; under pp the MTP layer sits on
the last stage with a copy of the embedding kept equal to the first stage's.

As tests/test_equivalence.py: one seed checkpoint, the same global batch of 8 sequences in
micro-batches of one, fp32, dropless; loss, gradient norm, aux loss and each parameter group's
gradient and update norms within 1e-4. mtp_loss is
a mean of per-rank means; under cp its ranks hold unequal numbers of valid targets (the last
position of a sequence has none), so there it agrees to 1e-2 only. The aux-free biases of the
last step equal the reference's exactly: each update is a step of the rate (1e-3) by the sign
of an expert's load summed over the stage's tokens, so a load summed over too few ranks (or a
lost update) is a whole step off, where the losses it moves stay near their tolerance.
"""

import pytest
import torch
from helpers import BATCH, STEPS, assert_matches_one_rank, degrees, router_biases, torchrun, train_from_seed

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

CONFIG = "debug_deepseek_v3.toml"
MTP = ("--mtp.num_layers", "1")
PP2 = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "2",
    "--parallelism.pipeline_parallel_microbatch_size",
    "1",
)

LAYOUTS = {
    "tp2": (2, degrees(tp=2)),
    "cp2": (2, degrees(cp=2)),
    "dp8_ep4_etp2": (8, degrees(ep=4, etp=2)),
    "tp2_cp2_dp2_ep4_etp2": (8, degrees(tp=2, cp=2, ep=4, etp=2)),
    # the MTP layer on the last stage with its copy of the first stage's embedding; 2 pipeline
    # micro-batches of one sequence per accumulation step
    "pp2": (2, PP2),
    "pp2_tp2_ep2": (4, (*PP2, *degrees(tp=2, ep=2))),
}


def run(folder, nproc, seed_checkpoint, *args) -> list[dict]:
    return train_from_seed(folder, nproc, seed_checkpoint, STEPS, *BATCH, *MTP, *args, config=CONFIG)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("seed_deepseek")
    torchrun(
        1,
        "--job.dump_folder",
        str(root),
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        *MTP,
        config=CONFIG,
    )
    return str(root / "checkpoint" / "step-0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, seed) -> tuple:
    """(its folder, its metrics)"""
    folder = tmp_path_factory.mktemp("ref_deepseek")
    return folder, run(folder, 1, seed)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_deepseek_layout_matches_one_rank(name, reference, tmp_path, seed):
    nproc, args = LAYOUTS[name]
    reference_folder, reference = reference
    folded = run(tmp_path, nproc, seed, *args)
    assert len(folded) == STEPS
    assert reference[0]["mtp_loss"] > 1.0
    assert {"mtp", "dense_ffn", "routed_experts"} <= set(reference[0]["group_grad_norms"])
    want, got = (router_biases(f / "checkpoint" / f"step-{STEPS}") for f in (reference_folder, tmp_path))
    assert got.keys() == want.keys() and any(b.abs().sum() > 0 for b in want.values())
    for k in want:
        assert torch.equal(got[k], want[k]), (name, k, got[k], want[k])
    assert_matches_one_rank(reference, folded, name)
    for ref, got in zip(reference, folded, strict=True):
        assert got["mtp_loss"] == pytest.approx(ref["mtp_loss"], rel=1e-2 if "cp" in name else 1e-4), (
            name,
            ref["step"],
        )
