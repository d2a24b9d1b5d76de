"""End to end: `torchrun -m titan_fold.train` on the debug config, on 1 and 2 CPU ranks.

One seed checkpoint (made on one rank) gives both layouts the same initial weights; the
data pipeline gives them the same global batch; FSDP sums gradients and the loss is
divided by the global token count. So the 2-rank run must reproduce the 1-rank losses
and gradient norms, not just run.
"""

import itertools
import re

import pytest
import torch
from helpers import assert_matches_one_rank, forked, read_metrics, train_from_seed

from titan_fold.common.config import ConfigError, parse_args
from titan_fold.parallel.mesh import LayoutError
from titan_fold.trainer.preflight import preflight

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

STEPS = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed_checkpoint):
    root = tmp_path_factory.mktemp("train")
    # the 2-rank run times its steps' phases too: its losses must still be the 1-rank run's
    return (
        train_from_seed(root / "r1", 1, seed_checkpoint, STEPS),
        train_from_seed(root / "r2", 2, seed_checkpoint, STEPS, "--metrics.step_phases"),
    )


def test_metrics_file_has_every_field(runs):
    one, _ = runs
    assert [m["step"] for m in one] == list(range(1, STEPS + 1))
    for key in (
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_sec",
        "mfu",
        "max_memory_gib",
        "moe_aux_loss",
        "dropped_token_frac",
        "expert_load_imbalance",
    ):
        assert key in one[0], key
    assert one[0]["mfu"] is None  # no peak FLOP/s on a CPU
    assert one[0]["tokens_per_sec"] > 0 and one[0]["max_memory_gib"] > 0
    assert one[0]["moe_aux_loss"] > 0 and one[0]["expert_load_imbalance"] >= 1.0
    assert one[0]["dropped_token_frac"] == 0.0  # dropless


def test_step_phases_account_for_the_logged_steps(runs):
    """metrics.step_phases: every logged step's phases in the order they ran, host times only on
    the CPU, together most of the step and no more than it (they run from the step's start to
    its log; the step's time runs from the log before)."""
    one, two = runs
    assert "phases" not in one[0]
    for m in two:
        phases = m["phases"]
        assert list(phases) == ["data", "forward", "backward", "clip", "optimizer", "rest"], m["step"]
        assert all(p["gpu_ms"] is None and p["host_ms"] >= 0 for p in phases.values())
        assert phases["forward"]["host_ms"] > 0 and phases["backward"]["host_ms"] > 0
        if m["step"] > 1:
            total, step_ms = sum(p["host_ms"] for p in phases.values()), 1e3 * m["time_per_step_s"]
            assert 0.5 * step_ms < total <= step_ms, (m["step"], total, step_ms)


def test_step_phases_sum_each_phase_over_its_stretches():
    """StepPhases: a phase that recurs (each micro-batch's data and forward) adds up; marks
    outside a started step and a finish without one record nothing."""
    import time

    import torch

    from titan_fold.trainer.phases import StepPhases, phases_text

    phases = StepPhases(torch.device("cpu"))
    phases.mark("forward")
    assert phases.finish() is None
    phases.start()
    for _ in range(2):
        phases.mark("forward")
        time.sleep(0.02)
        phases.mark("data")
    got = phases.finish()
    assert list(got) == ["data", "forward"] and got["forward"]["gpu_ms"] is None
    assert got["forward"]["host_ms"] >= 40 and got["data"]["host_ms"] < got["forward"]["host_ms"]
    assert phases.finish() is None
    assert re.fullmatch(r"phases ms host data \d+(\.\d)? forward \d+", phases_text(got)), phases_text(got)


def test_loss_falls(runs):
    one, _ = runs
    first, last = one[0]["loss"], sum(m["loss"] for m in one[-3:]) / 3
    assert last < 0.8 * first, (first, last)


def test_logged_flops_count_the_attention_within_each_packed_document(tmp_path):
    """With document masking, the logged tflops over tokens_per_sec (the FLOPs per token MFU
    divides by) is the step's batch counted here from the dataloader's own documents: 6 *
    N_active per token and, per document of n tokens, 6 * layers * heads * head_dim * n^2 (its
    causal square), not the sample's."""
    from titan_fold.data import build_dataloader, build_tokenizer
    from titan_fold.models import Transformer
    from titan_fold.trainer.preflight import model_args_from_config

    # the chat example's conversations, packed (document masking is on for chat data)
    args = ["--job.config_file", "debug_sft.toml", "--training.local_batch_size", "2"]
    args += ["--training.global_batch_size", "2", "--training.steps", "2", "--metrics.log_freq", "1"]
    codes, out, err = forked(1, "titan_fold.train", *args, "--job.dump_folder", str(tmp_path))
    assert codes == [0], (out + err)[-4000:]
    config = parse_args(args)
    _, model_args = model_args_from_config(config)
    with torch.device("meta"):
        model = Transformer(model_args)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    active = (
        total - model.tok_embeddings.weight.numel() - routed * (1 - model_args.moe.top_k / model_args.moe.num_experts)
    )
    per_square = 6 * model_args.n_layers * model_args.n_heads * model_args.head_dim
    batches = build_dataloader(1, 0, build_tokenizer(config), config)
    for record, (inputs, labels) in zip(read_metrics(tmp_path), batches, strict=False):
        lengths = [len(list(run)) for row in inputs["document_ids"].tolist() for _, run in itertools.groupby(row)]
        assert len(lengths) > 2  # packed: more documents than samples
        want = 6 * active + per_square * sum(n * n for n in lengths) / labels.numel()
        assert record["tflops"] * 1e12 / record["tokens_per_sec"] == pytest.approx(want, rel=1e-9), record["step"]


def test_two_ranks_match_one_rank(runs):
    one, two = runs
    assert_matches_one_rank(one[:5], two[:5], "dp2", keys=("loss", "grad_norm"), abs=0)


@pytest.mark.parametrize(
    "args, world, error, message",
    [
        (["--parallelism.expert_parallel_degree", "3"], 3, LayoutError, "3"),
        (["--parallelism.data_parallel_shard_degree", "3"], 2, LayoutError, "2"),
        (["--model.flavor", "huge"], 1, ConfigError, "model.flavor = 'huge'"),
        (["--model.name", "gpt"], 1, ConfigError, "model.name = 'gpt'"),
        (["--moe.top_k", "64"], 1, ConfigError, "moe.top_k = 64"),
        # 12 is a multiple of the local batch (4) but not of 4 x dp 2 (dp_shard takes the world)
        (["--training.global_batch_size", "12"], 2, ConfigError, "local_batch_size x dp degree = 4 x 2"),
    ],
)
def test_preflight_rejects_before_any_process_group(args, world, error, message):
    import torch.distributed as dist

    config = parse_args(["--job.config_file", "debug_moe.toml", *args])
    with pytest.raises(error, match=message):
        preflight(config, world)
    assert not dist.is_initialized()


def test_overrides_leave_the_flavor_alone():
    """A job's `[moe]` overrides reach its model args, never FLAVORS (tests run many jobs per process)."""
    from titan_fold.models import FLAVORS
    from titan_fold.trainer.preflight import model_args_from_config

    before = repr(FLAVORS["qwen2_moe"]["debug"])
    config = parse_args(["--job.config_file", "debug_moe.toml", "--moe.top_k", "64"])
    with pytest.raises(ConfigError):
        preflight(config, 1)
    config = parse_args(["--job.config_file", "debug_moe.toml", "--moe.top_k", "3"])
    _, args = model_args_from_config(config)
    args.update_from_config(config)
    assert args.moe.top_k == 3
    assert repr(FLAVORS["qwen2_moe"]["debug"]) == before


@pytest.mark.parametrize(
    "degrees, dtype, autocast",
    [
        (dict(tp=2), "bfloat16", True),  # torchtitan 0.2.2 would compute this in fp32
        (dict(pp=2), "bfloat16", True),
        (dict(), "bfloat16", True),  # one device, or experts on ep only
        (dict(dp_shard=2), "bfloat16", False),  # FSDP2's mixed precision casts
        (dict(tp=2, cp=2), "bfloat16", False),
        (dict(tp=2), "float32", False),
    ],
)
def test_mixed_precision_in_every_layout(degrees, dtype, autocast):
    import math

    import torch

    from titan_fold.parallel.mesh import Layout
    from titan_fold.trainer.world import maybe_enable_amp

    layout = Layout(world_size=math.prod(degrees.values()), **degrees)
    amp = maybe_enable_amp(layout, dtype, "cpu")
    assert isinstance(amp, torch.autocast) == autocast
    if autocast:
        assert amp.fast_dtype == torch.bfloat16


@pytest.mark.parametrize("first, logged", [(1, [1, 5, 10, 12]), (8, [8, 10, 12])])
def test_logged_steps_include_a_resumed_runs_first(first, logged):
    """Step 1, every log_freq-th and the last; a run resumed after step 7 logs step 8 first."""
    from titan_fold.trainer.metrics import FoldMetricsProcessor

    metrics = FoldMetricsProcessor.__new__(FoldMetricsProcessor)  # should_log reads the config alone
    metrics.job_config = parse_args(["--job.config_file", "debug_moe.toml", "--training.steps", "12"])
    metrics._last_logged_step, metrics._first_step = None, 0
    assert [s for s in range(first, 13) if metrics.should_log(s)] == logged
