"""metrics.expert_load: each MoE layer's routed tokens per expert, summed over the ranks.

A run at dp2 x ep2 (2 gloo ranks) against one rank on the same global batch: every logged step's
counts sum, per layer, to the batch's tokens times top_k; the first step's counts (same weights,
same tokens) equal the one-rank run's, expert for expert; metrics.jsonl's summary is what the
counts say; TensorBoard gets the histograms; the plot draws the heat maps."""

import json

import torch
from helpers import python_m, train_from_seed

from titan_fold.trainer.expert_load import summary

ARGS = (
    "--metrics.expert_load",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "4",
)


def _read(folder):
    load = [json.loads(line) for line in (folder / "expert_load.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return load, metrics


def test_expert_load_sums_over_ranks_and_matches_one_rank(tmp_path, seed_checkpoint):
    """Both runs start from the seed checkpoint (the same weights whatever the layout)."""
    folded, one = tmp_path / "dp2_ep2", tmp_path / "one"
    train_from_seed(
        folded,
        2,
        seed_checkpoint,
        3,
        *ARGS,
        "--parallelism.expert_parallel_degree",
        "2",
        "--metrics.enable_tensorboard",
    )
    train_from_seed(one, 1, seed_checkpoint, 3, *ARGS)
    load, metrics = _read(folded)
    load_one, _ = _read(one)
    top_k = 2  # debug_moe's
    assert [r["step"] for r in load] == [1, 2, 3] and load[0]["layers"] == load_one[0]["layers"]
    for record in load:
        for name, row in zip(record["layers"], record["counts"], strict=True):
            assert sum(row) == 4 * 64 * top_k, (record["step"], name, sum(row))
    assert load[0]["counts"] == load_one[0]["counts"], "step 1: the folded run's counts differ from one rank's"
    for record, logged in zip(load, metrics, strict=True):
        want = summary(record["layers"], torch.tensor(record["counts"], dtype=torch.float64), ep=2)
        assert logged["expert_load"] == want, (logged["expert_load"], want)
    assert any(p.name.startswith("events.") for p in (folded / "tb" / "expert_load").iterdir())
    done = python_m("titan_fold.plot", str(folded), "--expert-load")
    assert done.returncode == 0 and (folded / "expert_load.png").stat().st_size > 0, done.stderr[-2000:]


def test_summary_names_the_busiest_expert_and_ep_rank():
    counts = torch.tensor([[11.0, 0, 0, 9, 40, 20, 0, 0], [0] * 8], dtype=torch.float64)
    got = summary(["layers.0", "layers.1"], counts, ep=2)
    assert got["layers.1"] is None  # the layer did not run
    assert got["layers.0"] == {"max_over_mean": 4.0, "ep_max_over_mean": 1.5, "hottest": [4, 5, 0]}


def test_layers_are_named_without_the_compile_and_checkpoint_wrappers():
    """A compiled block's MoE sits under `_orig_mod`, a recomputed one under
    `_checkpoint_wrapped_module`: the layer is still `layers.N` in the counts and the summary."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from titan_fold.models import FLAVORS, Transformer
    from titan_fold.trainer.expert_load import _moe_modules

    with torch.device("meta"):
        model = Transformer(FLAVORS["qwen2_moe"]["debug"])
    model.layers.register_module("0", torch.compile(model.layers["0"]))
    model.layers.register_module("1", checkpoint_wrapper(model.layers["1"]))
    names = sorted(_moe_modules([model]))
    assert names == sorted(f"layers.{i}" for i in range(len(model.layers))), names
