"""Hints: a mistyped key or value, a forgotten config file, a Hub folder unlike the flavor, a
dry-run-only key on a real run, each one line with exit code 2; `--help` names the command."""

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import python_m
from torchtitan.config.job_config import Comm as TitanComm

from titan_fold.common.config import (
    DRY_RUN_ONLY,
    Comm,
    ConfigError,
    JobConfig,
    _field,
    _keys,
    parse_args,
)
from titan_fold.common.values import PACKAGED_CONFIGS, hint_text, parse_hint
from titan_fold.models import FLAVORS
from titan_fold.models.hf_adapter import hf_config
from titan_fold.train import HELP_FILE, KEYS_FILE, job_config_help, job_config_keys, usage_problem

ROOT = Path(__file__).parent.parent


def one_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    return lines[0]


# per dry-run-only key, a command-line use of it and the value the error line shows
DRY_RUN_USES = {
    "comm.check_gradients": (["--comm.check_gradients"], "true"),
    "comm.dry_run_rank": (["--comm.dry_run_rank", "0"], "0"),
    "comm.dry_run_collectives": (["--comm.no-dry_run_collectives"], "false"),
    "comm.dry_run_json": (["--comm.dry_run_json", "dry.json"], "'dry.json'"),
    "comm.dry_run_verbose": (["--comm.dry_run_verbose"], "true"),
}


def test_every_dry_run_key_is_listed():
    """The keys titan_fold adds to torchtitan's [comm] are the dry run's: all in DRY_RUN_ONLY."""
    added = {f.name for f in dataclasses.fields(Comm)} - {f.name for f in dataclasses.fields(TitanComm)}
    assert sorted(DRY_RUN_ONLY) == sorted(f"comm.{name}" for name in added) == sorted(DRY_RUN_USES)


@pytest.mark.parametrize("key", sorted(DRY_RUN_USES))
def test_dry_run_key_refused_on_a_real_run(tmp_path, key):
    args, shown = DRY_RUN_USES[key]
    line = one_error(
        python_m(
            "titan_fold.train", "--job.config_file", "debug_moe.toml", *args, "--job.dump_folder", str(tmp_path / "run")
        )
    )
    assert line == (
        f'error: {key} = {shown}: only with comm.mode = "fake_backend" (the dry run); '
        f"comm.mode is 'default', where {DRY_RUN_ONLY[key]}"
    ), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "text, refused",
    [
        pytest.param("[comm]\ncheck_gradients = true\n", "comm.check_gradients = true", id="check_gradients"),
        pytest.param("[comm]\ndry_run_rank = -1\n", "comm.dry_run_rank = -1", id="dry_run_rank"),
        # turns a part of the config's dry run off (deepseek_v3_671b.toml's): nothing a real run misses
        pytest.param("[comm]\ndry_run_collectives = false\n", None, id="no_collectives"),
    ],
)
def test_dry_run_key_in_the_config_file(tmp_path, text, refused):
    path = tmp_path / "job.toml"
    path.write_text((PACKAGED_CONFIGS / "debug_moe.toml").read_text() + "\n" + text)
    if refused is None:
        assert parse_args(["--job.config_file", str(path)]).comm.mode == "default"
        assert parse_args(["--job.config_file", "deepseek_v3_671b.toml"]).comm.dry_run_collectives is False
    else:
        with pytest.raises(ConfigError, match=f"^{re.escape(refused)}: only with comm.mode"):
            parse_args(["--job.config_file", str(path)])
    assert parse_args(["--job.config_file", str(path), "--comm.mode", "fake_backend"]).comm.mode == "fake_backend"


@pytest.mark.parametrize(
    "args, hint",
    [
        pytest.param(["--training.stepz", "10"], "did you mean --training.steps?", id="key"),
        pytest.param(["--trainng.steps", "10"], "did you mean --training.steps?", id="section"),
        pytest.param(["--moe.load_balance", "aux_fre"], "did you mean 'aux_free'?", id="literal"),
        pytest.param(["--model.flavour", "debug"], "did you mean --model.flavor?", id="spelling"),
    ],
)
def test_did_you_mean(args, hint):
    line = one_error(python_m("titan_fold.train", "--job.config_file", "debug_moe.toml", *args))
    assert line.endswith(hint), line


@pytest.mark.parametrize(
    "text, hint",
    [
        pytest.param("[training]\nstepz = 10\n", "did you mean training.steps?", id="key"),
        pytest.param('[moe]\nload_balance = "aux_fre"\n', "did you mean 'aux_free'?", id="literal"),
    ],
)
def test_did_you_mean_in_the_config_file(tmp_path, text, hint):
    path = tmp_path / "job.toml"
    path.write_text(text)
    line = one_error(python_m("titan_fold.train", "--job.config_file", str(path)))
    assert line.endswith(hint), line


def test_missing_config_file_is_named():
    line = one_error(python_m("titan_fold.train", "--training.steps", "10"))
    assert line.startswith("error: no --job.config_file: "), line
    assert "debug_moe.toml" in line and "qwen2.toml" in line, line


def hub_folder_unlike_debug(folder):
    """An HF folder of qwen2_moe with one layer more than the debug flavor, and a tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    args = copy.deepcopy(FLAVORS["qwen2_moe"]["debug"])
    args.n_layers += 1
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config("qwen2_moe", args)))
    Tokenizer(WordLevel({f"t{i}": i for i in range(100)}, unk_token="t0")).save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.mark.parametrize(
    "module, args",
    [
        pytest.param("titan_fold.train", ["--checkpoint.initial_load_path", "HUB"], id="initial_load_path"),
        pytest.param("titan_fold.train", ["--model.hf_assets_path", "HUB"], id="hf_assets_path"),
        pytest.param(
            "titan_fold.hf",
            ["import", "HUB", "OUT", "--model.name", "qwen2_moe", "--model.flavor", "debug"],
            id="hf_import",
        ),
    ],
)
def test_hub_folder_unlike_the_flavor_suggests_flavor_hf(tmp_path, module, args):
    hub = hub_folder_unlike_debug(tmp_path / "hub")
    args = [{"HUB": hub, "OUT": str(tmp_path / "out")}.get(a, a) for a in args]
    if module == "titan_fold.train":
        args = [
            "--job.config_file",
            "debug_moe.toml",
            "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf",
            "--job.dump_folder",
            str(tmp_path / "run"),
            *args,
        ]
    line = one_error(python_m(module, *args))
    assert "config.json does not match the model" in line and "num_hidden_layers: config.json 5, model 4" in line, line
    assert line.endswith("; --model.flavor hf takes the model's sizes from this config.json"), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


COMMANDS = ("train", "hf", "upcycle", "layout", "plan", "plot")
# per argparse command, a usage error (train's options are the job config's: its classes need torchtitan)
USAGE_ERRORS = {
    "hf": ["import"],
    "upcycle": ["--dense", "dense"],
    "layout": ["--pp", "2"],
    "plan": ["--gpus", "8"],
    "plot": [],
}


@pytest.mark.parametrize("module", [pytest.param(f"titan_fold.{m}", id=m) for m in COMMANDS])
def test_help_names_the_command(module):
    result = python_m(module, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"usage: python -m {module} " in result.stdout, result.stdout[:500]


@pytest.mark.parametrize(
    "module, args",
    [
        *(pytest.param(f"titan_fold.{m}", ["--help"], id=f"{m}-help") for m in COMMANDS),
        *(pytest.param(f"titan_fold.{m}", args, id=f"{m}-usage-error") for m, args in USAGE_ERRORS.items()),
    ],
)
def test_help_and_usage_errors_import_neither_torch_nor_torchtitan(module, args):
    """A fresh interpreter, as the user runs it: what it imports, from -X importtime."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == (0 if args == ["--help"] else 2), r.stderr[-3000:]
    assert f"usage: python -m {module} " in r.stdout + r.stderr
    packages = {
        line.rpartition("|")[2].strip().partition(".")[0]
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "argparse" in packages or module == "titan_fold.train"  # the import times were read
    assert not packages & {"torch", "torchtitan"}, sorted(packages & {"torch", "torchtitan"})


def test_stored_train_keys_are_current():
    assert KEYS_FILE.read_text(encoding="utf-8") == job_config_keys(), (
        "run python docs/gen.py titan_fold/train_keys.txt"
    )


CONFIG = ["--job.config_file", "debug_moe.toml", "--training.seq_len", "64"]


@pytest.mark.parametrize(
    "args",
    [
        CONFIG + ["--trainig.steps", "3"],
        CONFIG + ["--training.steps", "abc"],
        CONFIG + ["--moe.exchange", "devic"],
        CONFIG + ["--compile.enable", "off"],
        CONFIG + ["--optimizer.muon_ns_coefficients", "1", "x"],
        ["--training.steps", "3"],
        ["--job.config_file", "nope.toml"],
    ],
    ids=[
        "unknown-key",
        "bad-int",
        "bad-choice",
        "bool-not-true-or-false",
        "bad-list-element",
        "no-config-file",
        "config-file-not-there",
    ],
)
def test_train_usage_error_is_one_line_without_torch(args):
    """A mistyped key or value, or a config file missing: the line the full checks give (parse_args,
    then the model's), in a fresh interpreter that imports neither torch nor torchtitan."""
    from titan_fold.trainer.preflight import model_args_from_config

    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "titan_fold.train", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    lines = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    with pytest.raises(ConfigError) as slow:
        model_args_from_config(parse_args(args))
    assert r.returncode == 2 and lines == [f"error: {slow.value}"], r.stderr[-3000:]
    packages = {
        line.rpartition("|")[2].strip().partition(".")[0]
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert packages and not packages & {"torch", "torchtitan"}, sorted(packages & {"torch", "torchtitan"})


def test_stored_types_read_back_and_good_options_pass():
    for key in _keys(JobConfig):
        hint = _field(JobConfig, key)
        assert parse_hint(hint_text(hint)) == hint, key
    assert (
        usage_problem(
            [
                "--job.config_file=debug_moe.toml",
                "--compile.no-enable",
                "--training.steps=3",
                "--moe.exchange",
                "device",
                "--optimizer.muon_ns_coefficients",
                "1",
                "2",
                "3",
                "--training.max_norm",
                "inf",
            ]
        )
        is None
    )


def test_stored_train_help_is_current():
    assert HELP_FILE.read_text(encoding="utf-8") == job_config_help(), (
        "run python docs/gen.py titan_fold/train_help.txt"
    )
