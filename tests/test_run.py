"""`python -m titan_fold.run`'s output contract, through the real launcher and torch's elastic
agent: bad input is one `error:` line and exit code 2 whichever rank fails first, a rank's
crash one line naming it, `--help` printed once, and nothing of torchrun's failure report."""

import json
import os
import signal
import subprocess
import sys

import pytest

from titan_fold.run import USAGE, first_failure
from titan_fold.train import HELP_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# imported by every process the launch starts (PYTHONPATH): the rank named by SLOW_RANK waits,
# so that the other one fails first
SLOW_RANK_SITE = 'import os, time\nif os.environ.get("RANK", "") == os.environ.get("SLOW_RANK"):\n    time.sleep(60)\n'
EP3_REFUSAL = (
    "error: --parallelism.expert_parallel_degree 3, --parallelism.expert_tensor_parallel_degree 1 (world size 2): "
    "expert mesh: ep(3) * etp(1) = 3 must divide world_size / pp = 2 / 1 = 2 so that edp can be derived; "
    "valid neighbours: ep in {1, 2} (with etp=1)"
)


def launch(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW_RANK_SITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]), OMP_NUM_THREADS="1", **(env or {}))
    env.pop("LOG_RANK", None)
    command = [sys.executable, "-m", "titan_fold.run", "--nproc_per_node", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.slow  # a launch of 2 ranks
@pytest.mark.parametrize("slow_rank", [0, 1], ids=["rank_1_fails_first", "rank_0_fails_first"])
def test_refusal_is_one_line_exit_2_whichever_rank_fails_first(tmp_path, slow_rank):
    run = launch(
        tmp_path,
        "--job.config_file",
        "debug_moe.toml",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--parallelism.expert_parallel_degree",
        "3",
        env={"SLOW_RANK": str(slow_rank)},
    )
    # the line, once, and nothing else: no traceback, no ChildFailedError report, no agent log
    assert (run.returncode, run.stdout, run.stderr) == (2, "", EP3_REFUSAL + "\n"), run.stderr[-4000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a launch of 2 ranks that trains
def test_killed_rank_is_named_in_one_line(tmp_path):
    # rank 1 SIGKILLs itself in step 1 (checkpoint/saves.py's fault hook); rank 0 is stopped
    run = launch(
        tmp_path,
        "--job.config_file",
        "debug_moe.toml",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "2",
        env={"TITAN_FOLD_FAULT_AT_STEP": "1", "TITAN_FOLD_FAULT_RANK": "1"},
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 128 + 9 and errors == ["error: rank 1 was killed by SIGKILL"], run.stderr[-4000:]
    assert "ChildFailedError" not in run.stderr and "Root Cause" not in run.stderr, run.stderr[-4000:]


def test_help_is_printed_once(tmp_path):
    run = launch(tmp_path, "--job.config_file", "debug_moe.toml", "--help")
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout == USAGE + HELP_FILE.read_text(encoding="utf-8")
    assert run.stdout.count("usage: python -m titan_fold.train") == 1


@pytest.mark.parametrize(
    "args, line",
    [
        pytest.param(
            ["--job.config_file", "debug_moe.toml", "--training.stepz", "3"],
            "error: --training.stepz: unknown option; did you mean --training.steps?",
            id="unknown_key",
        ),
        pytest.param(
            ["--max-restart", "x", "--job.config_file", "debug_moe.toml"],
            "error: argument --max-restarts/--max_restarts: invalid int value: 'x' "
            "(torchrun's options: python -m torch.distributed.run --help)",
            id="bad_torchrun_option",
        ),
        pytest.param(
            ["-m", "titan_fold.train", "--job.config_file", "debug_moe.toml"],
            "error: python -m titan_fold.run runs titan_fold.train itself: give torchrun's options, then the "
            "trainer's, without a script or -m MODULE (got: --nproc_per_node 2 -m titan_fold.train)",
            id="module_given",
        ),
    ],
)
def test_usage_error_is_one_line_before_any_rank(tmp_path, args, line):
    run = launch(tmp_path, *args)
    assert (run.returncode, run.stdout, run.stderr) == (2, "", line + "\n")


def _failure(tmp_path, rank: int, exitcode: int, data: dict | None):
    """The agent's record of a rank that ended with exitcode, its error file holding data (None: no file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"{rank}.json"
    if data is not None:
        error_file.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def _line(text: str, time_ns: int) -> dict:
    """An error file as common/errors.py writes it."""
    return {
        "message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": "1"}},
        "line": text,
        "time_ns": time_ns,
    }


@pytest.mark.parametrize(
    "failures, first",
    [
        # both wrote their line within the same second: the earlier clock wins, not the lower rank
        pytest.param(
            {
                0: (2, _line("error: b", 1_700_000_000_900_000_000)),
                1: (2, _line("error: a", 1_700_000_000_100_000_000)),
            },
            1,
            id="earlier_line",
        ),
        pytest.param({1: (2, _line("error: b", 2)), 0: (2, _line("error: a", 1))}, 0, id="earlier_line_found_later"),
        # a line beats a rank SIGTERMed by the agent after it (found in the same pass or the next)
        pytest.param({0: (-signal.SIGTERM, None), 1: (2, _line("error: a", 5))}, 1, id="line_before_sigterm"),
        # no line: the order the agent found them ended in
        pytest.param(
            {
                1: (-signal.SIGKILL, None),
                0: (1, {"message": {"message": "bug", "extraInfo": {"py_callstack": "tb", "timestamp": "1"}}}),
            },
            1,
            id="agent_order",
        ),
    ],
)
def test_first_failure(tmp_path, failures, first):
    got = first_failure({r: _failure(tmp_path, r, code, data) for r, (code, data) in failures.items()})
    assert got == first


BAD_UTF8_CHAT = (
    b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}\n'
    b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}\n'
)


@pytest.mark.slow  # a launch of 2 ranks per case
@pytest.mark.parametrize("fault", ["chat_not_utf8", "checkpoint_folder_under_a_file", "copies_at_ep1", "bool_value"])
def test_first_hour_faults_are_one_line_through_the_launcher(tmp_path, fault):
    """The faults a new user met, as the documented launcher shows them: exactly one `error:`
    line naming the cause, exit code 2, nothing trained."""
    run_dir = tmp_path / "run"
    args = ["--job.config_file", "debug_moe.toml", "--job.dump_folder", str(run_dir), "--training.steps", "2"]
    if fault == "chat_not_utf8":
        path = tmp_path / "chat.jsonl"
        path.write_bytes(BAD_UTF8_CHAT)
        args[1] = "debug_sft.toml"
        args += ["--training.dataset", "hf", "--training.dataset_path", str(path)]
        cause = f"training.dataset_path = '{path}': record 1 (line 2): not UTF-8 (byte 0xe9 at column 47)"
    elif fault == "checkpoint_folder_under_a_file":
        (tmp_path / "file").write_text("x")
        args += ["--checkpoint.enable", "--checkpoint.folder", "../file/ckpt"]
        cause = f"{tmp_path / 'file'} is a file, not a folder"
    elif fault == "copies_at_ep1":
        args += ["--moe.hot_expert_replicas", "1"]
        cause = "moe.hot_expert_replicas"
    else:
        args += ["--training.document_masking", "maybe"]
        cause = "--training.document_masking"
    run = launch(tmp_path, *args)
    lines = run.stderr.splitlines()
    assert (run.returncode, run.stdout, len(lines)) == (2, "", 1), run.stderr[-4000:]
    assert lines[0].startswith("error: ") and cause in lines[0], lines[0]
    assert not (run_dir / "checkpoint").exists() and not (run_dir / "metrics.jsonl").exists()
