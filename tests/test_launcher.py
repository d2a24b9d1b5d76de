"""tests/launcher.py, which most trainer tests launch through: every rank gets its own RANK,
a failure reaches the test as torchrun reports it, and a dead rank does not hang the launch."""

import signal

from launcher import ZYGOTE


def launch(tmp_path, nproc, *args, env=None):
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    codes = ZYGOTE.launch(nproc, ["--job.config_file", "debug_moe.toml", *args], str(out), str(err), env=env)
    return codes, err.read_text()


def test_user_error_exits_2_and_is_printed_once(tmp_path):
    codes, err = launch(tmp_path, 2, "--parallelism.expert_parallel_degree", "3")
    # rank 1 exits 2 too, unless (as under torchrun) it is stopped once rank 0 has failed
    assert codes[0] == 2 and codes[1] in (2, -signal.SIGTERM), (codes, err[-3000:])
    assert len([line for line in err.splitlines() if line.startswith("error: ")]) == 1, err[-3000:]


def test_killed_rank_ends_the_launch(tmp_path):
    # rank 1 SIGKILLs itself in step 1; rank 0 fails in (or is stopped while in) a collective
    codes, err = launch(tmp_path, 2, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2",
                        "--parallelism.expert_parallel_degree", "2",
                        env={"TITAN_FOLD_FAULT_AT_STEP": "1", "TITAN_FOLD_FAULT_RANK": "1"})
    assert codes[1] == -9 and codes[0] != 0, (codes, err[-3000:])
