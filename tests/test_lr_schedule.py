"""The lr the trainer logs at every step against the schedule's closed form, written out here:
a warm-up longer than the run, the decay to the minimum, and a run resumed with more steps.

Every other lr check compares two runs of one config, which a schedule wrong in both passes.
"""

import shutil

import pytest
from helpers import forked, read_metrics

pytestmark = pytest.mark.slow  # trainer runs

LR, WARMUP, MIN_FACTOR = 3e-3, 5, 0.1
RUN = (
    "--job.config_file",
    "debug_moe.toml",
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    "1",
    "--training.seq_len",
    "32",
    "--metrics.log_freq",
    "1",
    "--optimizer.lr",
    str(LR),
    "--lr_scheduler.warmup_steps",
    str(WARMUP),
    "--lr_scheduler.min_lr_factor",
    str(MIN_FACTOR),
    "--checkpoint.enable",
    "--checkpoint.no-last_save_model_only",
)


def closed_form(step: int, steps: int) -> float:
    """The lr of `step` (1-based) in a run of `steps`: linear warm-up to LR over WARMUP steps (over
    the whole run where it is shorter), one step at LR, then linear decay towards LR * MIN_FACTOR,
    which the step after the last would reach."""
    warmup = min(WARMUP, steps)
    if step <= warmup:
        return LR * step / warmup
    left = (steps + 1 - step) / (steps - warmup)  # 1 at the step after the peak, 1 / decay at the last
    return LR * (MIN_FACTOR + (1 - MIN_FACTOR) * left)


def logged_lrs(folder, *args) -> dict[int, float]:
    codes, out, err = forked(1, "titan_fold.train", *RUN, "--job.dump_folder", str(folder), *args)
    assert codes == [0], (out + err)[-4000:]
    return {r["step"]: r["lr"] for r in read_metrics(folder)}


def test_logged_lr_is_the_closed_form_through_a_short_warmup_and_a_resume(tmp_path):
    """3 steps with a 5-step warm-up: warmed up over the 3 (1/3, 2/3, 1 of the lr); resumed from
    its last checkpoint with 9 steps: the 9-step schedule from step 4 on (warm-up to 5, the peak,
    the decay towards the minimum), not the 3-step one's."""
    short = logged_lrs(tmp_path / "a", "--training.steps", "3")
    assert sorted(short) == [1, 2, 3]
    for step, lr in short.items():
        assert lr == pytest.approx(closed_form(step, 3), rel=1e-12, abs=0), step
    shutil.copytree(tmp_path / "a" / "checkpoint", tmp_path / "b" / "checkpoint")
    resumed = logged_lrs(tmp_path / "b", "--training.steps", "9")
    assert sorted(resumed) == list(range(4, 10))
    for step, lr in resumed.items():
        assert lr == pytest.approx(closed_form(step, 9), rel=1e-12, abs=0), step
    assert resumed[9] > LR * MIN_FACTOR  # the minimum is approached, not passed
