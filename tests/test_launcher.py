"""tests/launcher.py, which most trainer tests launch through: every rank gets its own RANK,
a failure reaches the test as torchrun reports it, a dead rank does not hang the launch, a
hung one is killed at the timeout with its stack on record, a rank that crashes in native code
is named with its stack, and a worker's rank that fails a test's assertion is told apart from
one that crashes."""

import json
import os
import re
import signal
import time

import pytest
from launcher import ZYGOTE, RanksFailed, run_ranks


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
    codes, err = launch(
        tmp_path,
        2,
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        env={"TITAN_FOLD_FAULT_AT_STEP": "1", "TITAN_FOLD_FAULT_RANK": "1"},
    )
    assert codes[1] == -9 and codes[0] != 0, (codes, err[-3000:])


def _echo(rank, port, out_dir, items):
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump([rank, port, os.getpid(), items], f)


def _hang_on_rank_1(rank, port, out_dir):
    if rank == 1:
        time.sleep(600)  # a rank stuck, as in a lock a forked child inherited held


def _segfault_on_rank_1(rank, port, out_dir):
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # a read of address 0, as a native bug would do


def _fail_on_rank_1(rank, port, out_dir, how):
    if rank == 1:
        if how == "assert":
            assert rank == 0, "a wrong value"
        raise RuntimeError("a crash")


def test_rank_assertion_and_rank_crash_are_told_apart(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # rank 0 exits 0, unless it is stopped (SIGTERM) once rank 1 has failed
    with pytest.raises(AssertionError, match=r"exit codes \[(0|-15), 3\]") as failure:
        run_ranks(_fail_on_rank_1, 2, tmp_path / "a", "assert")
    assert "a wrong value" in str(failure.value)
    with pytest.raises(RanksFailed, match=r"exit codes \[(0|-15), 1\]") as crash:
        run_ranks(_fail_on_rank_1, 2, tmp_path / "b", "crash")
    assert "RuntimeError: a crash" in str(crash.value)


def test_worker_runs_in_ranks_apart_from_this_process(tmp_path):
    run_ranks(_echo, 2, tmp_path, {"ep": [2, 1]})
    got = [json.load(open(tmp_path / f"{r}.json")) for r in range(2)]
    assert [(r, items) for r, _, _, items in got] == [(0, {"ep": [2, 1]}), (1, {"ep": [2, 1]})]
    assert got[0][1] == got[1][1]  # one rendezvous port
    assert os.getpid() not in {pid for _, _, pid, _ in got} and got[0][2] != got[1][2]


def test_hung_rank_is_killed_with_its_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as failure:
        run_ranks(_hang_on_rank_1, 2, tmp_path, timeout=3)
    assert time.monotonic() - start < 60
    message = str(failure.value)
    assert f"exit codes [0, -{int(signal.SIGABRT)}]" in message, message
    assert "in _hang_on_rank_1" in message, message  # faulthandler's dump of the hung rank


def test_crashed_rank_is_named_with_its_stack(tmp_path):
    with pytest.raises(RanksFailed) as failure:
        run_ranks(_segfault_on_rank_1, 2, tmp_path)
    message = str(failure.value)
    # rank 0 exits 0, unless it is stopped (SIGTERM) once rank 1 has failed
    assert re.search(rf"exit codes \[(0|-15), -{int(signal.SIGSEGV)}\]", message), message
    assert "rank 1 ended by SIGSEGV" in message, message
    assert "in _segfault_on_rank_1" in message, message  # the crashed rank's own stack
