"""Hints: a mistyped key or value, a forgotten config file, a Hub folder unlike the flavor, a
dry-run-only key on a real run, each one line with exit code 2; `--help` names the command."""

import copy
import json

import pytest
from conftest import python_m

from titan_fold.models import FLAVORS
from titan_fold.models.hf_adapter import hf_config


def one_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    return lines[0]


def test_check_gradients_refused_on_a_real_run(tmp_path):
    line = one_error(python_m("titan_fold.train", "--job.config_file", "debug_moe.toml", "--comm.check_gradients",
                              "--job.dump_folder", str(tmp_path / "run")))
    assert line.startswith("error: comm.check_gradients = true: only with comm.mode = \"fake_backend\" (the dry run)"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, hint", [
    pytest.param(["--training.stepz", "10"], "did you mean --training.steps?", id="key"),
    pytest.param(["--trainng.steps", "10"], "did you mean --training.steps?", id="section"),
    pytest.param(["--moe.load_balance", "aux_fre"], "did you mean 'aux_free'?", id="literal"),
    pytest.param(["--model.flavour", "debug"], "did you mean --model.flavor?", id="spelling"),
])
def test_did_you_mean(args, hint):
    line = one_error(python_m("titan_fold.train", "--job.config_file", "debug_moe.toml", *args))
    assert line.endswith(hint), line


@pytest.mark.parametrize("text, hint", [
    pytest.param("[training]\nstepz = 10\n", "did you mean training.steps?", id="key"),
    pytest.param('[moe]\nload_balance = "aux_fre"\n', "did you mean 'aux_free'?", id="literal"),
])
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


@pytest.mark.parametrize("module, args", [
    pytest.param("titan_fold.train", ["--checkpoint.initial_load_path", "HUB"], id="initial_load_path"),
    pytest.param("titan_fold.train", ["--model.hf_assets_path", "HUB"], id="hf_assets_path"),
    pytest.param("titan_fold.hf", ["import", "HUB", "OUT", "--model.name", "qwen2_moe", "--model.flavor", "debug"],
                 id="hf_import"),
])
def test_hub_folder_unlike_the_flavor_suggests_flavor_hf(tmp_path, module, args):
    hub = hub_folder_unlike_debug(tmp_path / "hub")
    args = [{"HUB": hub, "OUT": str(tmp_path / "out")}.get(a, a) for a in args]
    if module == "titan_fold.train":
        args = ["--job.config_file", "debug_moe.toml", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                "--job.dump_folder", str(tmp_path / "run"), *args]
    line = one_error(python_m(module, *args))
    assert "config.json does not match the model" in line and "num_hidden_layers: config.json 5, model 4" in line, line
    assert line.endswith("; --model.flavor hf takes the model's sizes from this config.json"), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", [
    pytest.param(f"titan_fold.{m}", id=m) for m in ("train", "hf", "upcycle", "layout", "plan", "plot")
])
def test_help_names_the_command(module):
    result = python_m(module, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"usage: python -m {module} " in result.stdout, result.stdout[:500]
