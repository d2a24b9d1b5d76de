"""Hints: a dry-run-only key on a real run is one line with exit code 2."""

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
