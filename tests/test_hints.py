"""Hints: a mistyped key or value, a forgotten config file, a dry-run-only key on a real run,
each one line with exit code 2."""

import pytest
from conftest import python_m


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
