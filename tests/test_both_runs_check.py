"""One set of checks for both runs: every check a real run makes before its first step
(preflight.CHECKS) fails a real run (torchrun ranks) and a dry run (`--comm.mode
fake_backend`, NGPU ranks in one process) alike: exit code 2 and the same one line."""

import json
import os

import pytest
from helpers import forked

from titan_fold.checkpoint.manager import SETTINGS_FILE
from titan_fold.checkpoint.settings import run_settings
from titan_fold.common.config import parse_args
from titan_fold.trainer.preflight import CHECKS, model_args_from_config

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

NPROC = 2


def resume_with_other_seq_len(folder) -> tuple[str, ...]:
    """A step-1 checkpoint folder saved with training.seq_len 64 (this run: the config's 128),
    resumed by a run of 1 step (a checkpoint past training.steps is refused for that)."""
    args = ("--job.dump_folder", str(folder), "--checkpoint.enable", "--checkpoint.load_step", "1")
    config = parse_args(["--job.config_file", "debug_moe.toml", *args])
    tokenizer = model_args_from_config(config)[0].build_tokenizer_fn(config)
    settings = run_settings(config, tokenizer, NPROC) | {"training.seq_len": 64}
    step = folder / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    (step / SETTINGS_FILE).write_text(json.dumps(settings))
    return args


def tokenizer_of_600_tokens(folder) -> tuple[str, ...]:
    """A HF tokenizer folder with more tokens than the debug model's vocabulary (512)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder.mkdir(parents=True)
    Tokenizer(WordLevel({f"t{i}": i for i in range(600)}, unk_token="t0")).save(str(folder / "tokenizer.json"))
    return ("--job.dump_folder", str(folder / "run"), "--model.hf_assets_path", str(folder))


# per check (CHECKS' names), a failing input: the arguments, or a function of a tmp folder making them
FAILING = {
    "layout": ("--parallelism.expert_parallel_degree", "3"),
    "batch": ("--training.global_batch_size", "3"),
    "experts": ("--moe.expert_kernels", "quack", "--parallelism.expert_parallel_degree", "2"),
    "paths": ("--checkpoint.initial_load_path", "/nonexistent/step-1"),
    "resume": resume_with_other_seq_len,
    "tokenizer": tokenizer_of_600_tokens,
}
# a check that reads the host: a real run on this CPU machine refuses QuACK for want of it, the
# dry run plans for the cluster's GPUs (where it may be installed) and refuses it for the rows
# that vary under dropless ep 2
HOST_DEPENDENT = {"experts": "moe.expert_kernels = 'quack' "}


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def test_every_check_has_a_failing_case():
    assert sorted(FAILING) == sorted(name for name, _ in CHECKS)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_check_fails_both_runs_alike(name, tmp_path):
    case = FAILING[name]
    args = case(tmp_path / "run") if callable(case) else ("--job.dump_folder", str(tmp_path / "run"), *case)
    common = ("--job.config_file", "debug_moe.toml", "--training.steps", "1", *args)
    codes, _, real_err = forked(NPROC, "titan_fold.train", *common)
    (dry_code,), _, dry_err = forked(
        0,
        "titan_fold.train",
        *common,
        "--comm.mode",
        "fake_backend",
        "--comm.dry_run_json",
        str(tmp_path / "dry.json"),
        env={"NGPU": str(NPROC)},
    )
    real, dry = error_lines(real_err), error_lines(dry_err)
    assert codes == [2] * NPROC and dry_code == 2, (codes, dry_code, real_err[-2000:], dry_err[-2000:])
    assert len(real) == 1 and len(dry) == 1, (real, dry)
    if name in HOST_DEPENDENT:
        assert real[0].startswith(f"error: {HOST_DEPENDENT[name]}") and dry[0].startswith(
            f"error: {HOST_DEPENDENT[name]}"
        ), (real, dry)
    else:
        assert real == dry
    assert not os.path.exists(tmp_path / "dry.json")  # nothing reported as if it had passed
