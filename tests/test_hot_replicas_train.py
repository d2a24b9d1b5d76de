"""moe.hot_expert_replicas in the trainer: runs with copies of hot experts equal the one-rank run
without them, step for step, under a forced skew; a run resumed under another folding with
copies on equals it too; and the checkpoints hold no copy.

The skew is a fixed aux-free router bias in the seed checkpoint: experts 0 and 1 (both on ep
rank 0) win most tokens. The bias moves by the aux-free rate (1e-3) per step only, so the skew
lasts the run. Runs (fp32, micro-batches of one sequence, as tests/test_checkpoint.py):

    R1 = 1 rank, no copies                                       the reference, 6 steps
    PP = 4 ranks, pp 2 x ep 2, 2 copies per layer                steps 1..6, saves step 3
    DP = 4 ranks, dp 4 x ep 2 x edp 2, 2 copies, from PP's step 3   steps 4..6

and what the copies are for: one step on 2 ranks, dp 2 x ep 2, with and without copies, each
ep rank's experts counting the rows they run.
"""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_matches_one_rank, checkpointed_run, read_metrics, torchrun
from launcher import run_ranks

from titan_fold.checkpoint.trusted import read_metadata

pytestmark = pytest.mark.slow

STEPS = 6
SKEW = [0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # the debug model's 8 experts
COMMON = (*checkpointed_run(STEPS), "--metrics.group_grad_norms", "--metrics.expert_load")
COPIES = ("--moe.hot_expert_replicas", "2")
EP2 = ("--parallelism.expert_parallel_degree", "2")
# no aux loss: its statistics are not compared here (aux_free), the group norms and losses are
KEYS = ("loss", "grad_norm")


def _state(checkpoint) -> dict[str, torch.Tensor]:
    md = read_metadata(str(checkpoint)).state_dict_metadata
    state = {k: torch.zeros(list(m.size), dtype=m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    dcp.load(state, checkpoint_id=str(checkpoint))
    return state


@pytest.fixture(scope="module")
def skewed_seed(tmp_path_factory, seed_checkpoint) -> str:
    """The seed checkpoint with every router's aux-free bias set to SKEW."""
    state = _state(seed_checkpoint)
    biases = [k for k in state if k.endswith("router.expert_bias")]
    assert biases
    for k in biases:
        state[k] = torch.tensor(SKEW, dtype=state[k].dtype)
    folder = tmp_path_factory.mktemp("skewed") / "step-0"
    dcp.save(state, checkpoint_id=str(folder))
    return str(folder)


def run(folder, nproc, *args, seed=None):
    extra = ("--checkpoint.initial_load_path", seed) if seed else ()
    torchrun(nproc, "--job.dump_folder", str(folder), *COMMON, *extra, *args)
    return read_metrics(folder)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, skewed_seed):
    folder = tmp_path_factory.mktemp("r1")
    return folder, run(folder, 1, seed=skewed_seed)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, skewed_seed):
    folder = tmp_path_factory.mktemp("pp")
    pp = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2")
    return folder, run(folder, 4, *pp, "--training.local_batch_size", "4", *COPIES, seed=skewed_seed)


def test_the_skew_bites(reference):
    """At ep 2, rank 0 (experts 0-3) gets far more than half the rows in every layer and step:
    copies have rows to move."""
    for line in (reference[0] / "expert_load.jsonl").read_text().splitlines():
        record = json.loads(line)
        for layer, counts in zip(record["layers"], record["counts"], strict=True):
            per_rank = torch.tensor(counts).view(2, -1).sum(1)
            assert per_rank[0] > 1.4 * per_rank.float().mean(), (record["step"], layer, counts)


def test_pp2_ep2_with_copies_matches_one_rank(reference, pipelined):
    assert_matches_one_rank(reference[1], pipelined[1], "pp2_ep2 copies", keys=KEYS)


def test_resumed_dp4_ep2_edp2_with_copies_matches_one_rank(reference, pipelined, tmp_path):
    """PP's step 3 resumed at dp 4 x ep 2 x edp 2 (pp 2 -> 1, expert weights and moments from
    ep shards per stage to ep x edp shards); the checkpoints hold the model's state only."""
    import os
    import shutil

    step3 = pipelined[0] / "checkpoint" / "step-3"
    assert _state(step3).keys() == _state(reference[0] / "checkpoint" / "step-3").keys()
    os.makedirs(tmp_path / "checkpoint")
    shutil.copytree(step3, tmp_path / "checkpoint" / "step-3")
    got = run(tmp_path, 4, "--parallelism.expert_parallel_degree", "2", *COPIES)
    assert [r["step"] for r in got] == [4, 5, 6]
    assert_matches_one_rank(reference[1][3:], got, "dp4_ep2_edp2 copies, resumed", keys=KEYS)
    last = f"step-{STEPS}"
    want = _state(reference[0] / "checkpoint" / last)
    have = _state(tmp_path / "checkpoint" / last)
    for k in want:
        if k.endswith("router.expert_bias"):
            assert torch.equal(have[k], want[k]), k


def count_rows(rank: int, port: int, out_dir: str, *args: str) -> None:
    """The trainer on this rank with every routed-experts call's rows (home experts and copies)
    written to out_dir/rows_<rank>.json, in call order."""
    from titan_fold.moe.experts import GroupedExperts
    from titan_fold.trainer.fold_trainer import main

    rows, forward = [], GroupedExperts.forward

    def counting(self, x, counts, *rest, **kwargs):
        assert isinstance(counts, torch.Tensor)  # the exact exchange: rows per physical expert
        rows.append(int(counts.sum()))
        return forward(self, x, counts, *rest, **kwargs)

    GroupedExperts.forward = counting  # this forked rank's class only
    assert main(list(args)) == 0
    with open(f"{out_dir}/rows_{rank}.json", "w") as f:
        json.dump(rows, f)


def test_copies_lower_the_busiest_ep_ranks_rows(skewed_seed, tmp_path):
    """The same step (same weights, batch and routing: the logged per-expert loads are equal) on
    dp 2 x ep 2 with and without 2 copies per layer: in every MoE layer the ep ranks run every
    routed row once between them, and the busiest rank runs fewer with the copies, at most the
    level the copies' planner fills to plus one."""
    got = {}
    for name, copies in (("without", ()), ("with", COPIES)):
        folder = tmp_path / name
        folder.mkdir()
        args = ("--job.config_file", "debug_moe.toml", *COMMON, "--training.steps", "1", *EP2, *copies)
        run_ranks(
            count_rows,
            2,
            folder,
            "--job.dump_folder",
            str(folder),
            "--checkpoint.initial_load_path",
            skewed_seed,
            *args,
        )
        per_rank = [json.loads((folder / f"rows_{r}.json").read_text()) for r in range(2)]
        got[name] = torch.tensor(per_rank)  # [ep rank, MoE layer call]
        got[name + " load"] = json.loads((folder / "expert_load.jsonl").read_text().splitlines()[0])["counts"]
    assert got["with load"] == got["without load"]  # the same routing
    without, with_copies = got["without"], got["with"]
    assert without.shape == with_copies.shape and without.shape[1] > 0
    assert torch.equal(with_copies.sum(0), without.sum(0))  # every row runs once
    busiest_without, busiest_with = without.max(0).values, with_copies.max(0).values
    assert (busiest_with < busiest_without).all(), (busiest_with, busiest_without)
    # both copies' experts (0 and 1) live on rank 0: moved rows can level the two ranks
    assert (busiest_with <= (with_copies.sum(0) + 1) // 2 + 1).all(), with_copies
