"""Folded layouts reproduce the one-rank run: loss, gradient norm, aux loss, and each parameter
group's gradient and update norms of the first steps.

Every run starts from the same seed checkpoint, sees the same global batch (8 sequences)
in micro-batches of one sequence (the aux loss is a mean over a micro-batch, gathered over
the cp x tp ranks that hold its pieces), in fp32, dropless, with the aux and z losses on.
The one-rank run accumulates 8 micro-batches per step.
"""

import pytest
from helpers import BATCH, STEPS, assert_matches_one_rank, degrees, train_from_seed

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

LAYOUTS = {
    # attention dp 4; experts ep 2 x etp 1 x edp 2, exchanged with the sizes on the device
    "dp4_ep2_edp2": (4, (*degrees(ep=2), "--moe.exchange", "device")),
    # attention dp 8; experts ep 4 x etp 2 x edp 1: EP and ETP fold over data-parallel ranks
    "dp8_ep4_etp2": (8, degrees(ep=4, etp=2)),
    # 8-rank layouts (a), (b), (c), (e), (f) of tests/test_placement.py
    "a_tp2_cp2_dp2_ep4_etp2": (8, degrees(tp=2, cp=2, ep=4, etp=2)),
    # ... (b) with the MoE layers recomputed in backward: the EP all-to-alls run again
    "b_tp2_dp4_ep8_moe_recompute": (8, (*degrees(tp=2, ep=8), "--activation_checkpoint.mode", "moe_layers")),
    "c_cp4_dp2_ep2_etp2_edp2": (8, degrees(cp=4, ep=2, etp=2)),
    "e_hsdp2x2_tp2_ep2_etp2_edp2": (8, degrees(tp=2, dp_replicate=2, ep=2, etp=2)),
    "f_tp4_dp2_ep2_edp4": (8, degrees(tp=4, ep=2)),
}


# token drop with decisions over whole sequences: must equal the one-rank decisions; by
# position (the first tokens of a sequence win), so the token order must be restored too
FULL_SEQUENCE_DROP = (
    "--moe.capacity_factor",
    "1.0",
    "--moe.drop_scope",
    "full_sequence",
    "--moe.drop_policy",
    "position",
)
DROP_LAYOUTS = {
    # the drop decision gathers each sequence from cp x tp ranks and undoes cp's chunk order
    "cp2_tp2_dp2_ep4_etp2_drop": (8, degrees(tp=2, cp=2, ep=4, etp=2)),
}


def run(folder, nproc, args, seed_checkpoint) -> list[dict]:
    return train_from_seed(folder, nproc, seed_checkpoint, STEPS, *BATCH, *args)


@pytest.fixture(scope="module")
def drop_reference(tmp_path_factory, seed_checkpoint):
    return run(tmp_path_factory.mktemp("ref_drop"), 1, FULL_SEQUENCE_DROP, seed_checkpoint)


def assert_same(reference, folded, name):
    assert len(folded) == STEPS
    assert_matches_one_rank(reference, folded, name, keys=("loss", "grad_norm", "moe_aux_loss", "dropped_token_frac"))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_one_rank(name, one_rank_reference, tmp_path, seed_checkpoint):
    nproc, args = LAYOUTS[name]
    folded = run(tmp_path, nproc, args, seed_checkpoint)
    assert_same(one_rank_reference, folded, name)
    cp = int(args[args.index("--parallelism.context_parallel_degree") + 1])
    for ref, got in zip(one_rank_reference, folded, strict=True):
        # the logged values reduced over the dp x cp ranks as torchtitan reduces them: the tokens
        # every rank saw (each cp rank counts its whole sequences), the largest rank's mean loss
        # (under cp torchtitan divides a rank's share of the loss by its whole sequences' tokens)
        assert got["n_tokens_seen"] == cp * ref["n_tokens_seen"], (name, ref["step"])
        assert ref["max_loss"] == ref["loss"]
        if cp == 1:  # one rank's mean: above the mean over all, far below their sum (dp >= 2)
            assert got["loss"] * (1 - 1e-6) <= got["max_loss"] < 1.5 * got["loss"], (name, ref["step"])


@pytest.mark.parametrize("name", sorted(DROP_LAYOUTS))
def test_full_sequence_dropping_matches_one_rank(name, drop_reference, tmp_path, seed_checkpoint):
    nproc, args = DROP_LAYOUTS[name]
    folded = run(tmp_path, nproc, (*args, *FULL_SEQUENCE_DROP), seed_checkpoint)
    assert drop_reference[0]["dropped_token_frac"] > 0.01  # the capacity really bites
    assert_same(drop_reference, folded, name)


def test_compiled_blocks_match_one_rank(one_rank_reference, tmp_path, seed_checkpoint):
    """torch.compile'd blocks under dp 2 x ep 2 (each block's graph breaks where the
    dispatcher brings the exchanged counts to the host) reproduce the one-rank eager run."""
    run_args = (*degrees(ep=2), "--compile.enable")
    assert_same(one_rank_reference, run(tmp_path, 2, run_args, seed_checkpoint), "dp2_ep2_compiled")
