"""GPT-OSS under folded layouts reproduces the one-rank run: sinks sharded with the heads on tp,
sliding-window and full layers over packed documents under cp (the window's mask built from each
token's place in its sample), biases on the attention projections (wo's added once after tp's
reduction) and on the experts (w2's added once to the etp sum), the clamped SwiGLU and the
router's bias, with sequence parallelism, ep x etp and FSDP over edp; under pp the stages split
sliding and full layers.

As tests/test_equivalence.py: one seed checkpoint, the same global batch of 8 sequences in
micro-batches of one, fp32, dropless, packed documents (training.document_masking) in every run;
loss, gradient norm, aux loss and each parameter group's gradient and update norms within 1e-4.
Two folded launches cover the five foldings.
"""

import pytest
from helpers import BATCH, STEPS, assert_matches_one_rank, degrees, torchrun, train_from_seed

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

CONFIG = "debug_gpt_oss.toml"
PACKED = ("--training.document_masking", "True")
PP2 = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "2",
    "--parallelism.pipeline_parallel_microbatch_size",
    "1",
)

LAYOUTS = {
    # tp 2 with sequence parallelism, cp 2 over packed documents, ep 2 x etp 2 folded over them,
    # edp 2 (the experts FSDP-sharded)
    "tp2_cp2_dp2_ep2_etp2": (8, degrees(tp=2, cp=2, ep=2, etp=2)),
    "pp2_tp2_ep2": (4, (*PP2, *degrees(tp=2, ep=2))),
}


def run(folder, nproc, seed_checkpoint, *args) -> list[dict]:
    return train_from_seed(folder, nproc, seed_checkpoint, STEPS, *BATCH, *PACKED, *args, config=CONFIG)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("seed_gpt_oss")
    torchrun(
        1, "--job.dump_folder", str(root), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", config=CONFIG
    )
    return str(root / "checkpoint" / "step-0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, seed) -> list[dict]:
    return run(tmp_path_factory.mktemp("ref_gpt_oss"), 1, seed)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_gpt_oss_layout_matches_one_rank(name, reference, tmp_path, seed):
    nproc, args = LAYOUTS[name]
    folded = run(tmp_path, nproc, seed, *args)
    assert len(folded) == STEPS
    assert {"routed_experts"} <= set(reference[0]["group_grad_norms"])
    assert_matches_one_rank(reference, folded, name)
