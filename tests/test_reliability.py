"""Nothing goes wrong silently: bad input, NaN/Inf, signals, a second trainer, metrics.jsonl.

In-process tests check the rules (typed config, preflight, metrics file, lock, storage,
plan/layout CLIs); a few short launches check what only a run shows: every rank stops at
the same step on NaN with nothing saved from it, a NaN checkpoint is refused, SIGTERM saves
and exits 143, Ctrl-C exits 130 with one line, a second trainer into a used folder fails.
"""

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import forked, python_m
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from titan_fold.checkpoint.files import read_model_tensors
from titan_fold.checkpoint.manager import complete
from titan_fold.checkpoint.saves import SaveError, failing_save
from titan_fold.common.config import ConfigError, parse_args
from titan_fold.common.storage import StorageError, storage_problem
from titan_fold.trainer.fold_trainer import lock_dump_folder
from titan_fold.trainer.lock import DumpFolderLock, LockedError
from titan_fold.trainer.metrics_file import MetricsFile, read_records
from titan_fold.trainer.preflight import preflight

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

SMALL = ("--training.local_batch_size", "1", "--training.seq_len", "32", "--metrics.log_freq", "1")
ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="300")


def trainer_args(folder, *args) -> list[str]:
    return ["--job.config_file", "debug_moe.toml", "--job.dump_folder", str(folder), *SMALL, *args]


def trainer_cmd(nproc: int, folder, *args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "titan_fold.train",
        *trainer_args(folder, *args),
    ]


def launch(nproc: int, folder, *args, env=None) -> subprocess.CompletedProcess:
    """Real torchrun with NPROC workers."""
    return subprocess.run(
        trainer_cmd(nproc, folder, *args), capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=900
    )


def one_process(folder, *args, env=None) -> subprocess.CompletedProcess:
    """`python -m titan_fold.train ...` without torchrun (forked: tests/launcher.py)."""
    return python_m("titan_fold.train", *trainer_args(folder, *args), env=env)


def worker_lines(stderr: str, prefix: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


def only_torchruns_traceback(stderr: str) -> bool:
    """torchrun itself, signalled, ends in its own SignalException traceback; no worker may print one."""
    return stderr.count("Traceback (most recent call last)") <= 1 and (
        "Traceback" not in stderr or "elastic.multiprocessing.api.SignalException" in stderr
    )


def steps_saved(folder) -> list[int]:
    ckpt = folder / "checkpoint"
    return sorted(int(d.name[5:]) for d in ckpt.iterdir() if complete(str(d))) if ckpt.exists() else []


def assert_clean_exit(r: subprocess.CompletedProcess, folder) -> None:
    """Teardown: every rank passes a barrier before destroying the process groups, so no
    rank closes its gloo pairs while a peer still has work on them (the cause of an
    intermittent `terminate called without an active exception` at exit), then ends without
    the interpreter's teardown (fold_trainer.end_process)."""
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-4000:]
    assert not (folder / "trainer.lock").exists()


# ---------------------------------------------------------------- typed config


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[checkpoint]\nenable = "false"\n', r"checkpoint.enable = 'false': must be a bool"),
        ("[training]\nsteps = 4.7\n", r"training.steps = 4.7: must be an integer"),
        ('[moe]\ncapacity_factor = "1.25"\n', r"moe.capacity_factor = '1.25': must be a finite number"),
        ('[optimizer]\nlr = "fast"\n', r"optimizer.lr = 'fast': must be a finite number"),
        ("[moe]\ncapacity_factor = nan\n", r"moe.capacity_factor = nan: must be a finite number"),
        ("[moe]\ncapacity_factor = inf\n", r"moe.capacity_factor = inf"),
        ("[training]\nsteps = true\n", r"training.steps = True: must be an integer"),
        ('[model]\nconverters = "float8"\n', r"model.converters = 'float8': must be a list of a string"),
        ('[training]\nnonfinite = "ignore"\n', r"training.nonfinite = 'ignore': must be one of \['stop', 'skip'\]"),
        ("[metrics]\nlog_freq = 0\n", r"metrics.log_freq = 0: must be >= 1"),
        ("[checkpoint]\ninterval = 0\n", r"checkpoint.interval = 0: must be >= 1"),
        ('[checkpoint]\ninitial_load_path = "/x"\n', r"initial_load_path = '/x' needs checkpoint.enable"),
    ],
)
def test_toml_values_are_typed(tmp_path, toml, message):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        parse_args(["--job.config_file", str(path)])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.steps", "4.7"], r"--training.steps 4.7: must be an integer"),
        (["--optimizer.lr", "fast"], r"--optimizer.lr fast: must be a finite number"),
        (["--moe.capacity_factor", "nan"], r"moe.capacity_factor = nan: must be a finite number"),
        (["--checkpoint.enable", "yes"], r"--checkpoint.enable yes: must be true or false \(or alone: true\)"),
        (["--moe.drop_policy", "x"], r"--moe.drop_policy x: must be one of \['probs', 'position'\]"),
        (["--training.stepz", "3"], r"--training.stepz: unknown option"),
        (["--training.steps"], r"--training.steps: needs one value"),
        (["--moe.norm_topk_prob", "on"], r"--moe.norm_topk_prob on: must be true, false or none \(or alone: true\)"),
        (["--moe.norm_topk_prob", "true", "false"], r"--moe.norm_topk_prob: needs one value \(true, false or none\)"),
    ],
)
def test_cli_values_are_typed(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--job.config_file", "debug_moe.toml", *args])


def test_cli_accepts_what_it_should():
    config = parse_args(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--training.max_norm",
            "inf",
            "--checkpoint.no-enable",
            "--lr_scheduler.total_steps",
            "None",
            "--optimizer.lr=1e-4",
            "--parallelism.expert_data_parallel_degree",
            "-1",
        ]
    )
    assert math.isinf(config.training.max_norm) and not config.checkpoint.enable
    assert config.lr_scheduler.total_steps is None and config.optimizer.lr == 1e-4


@pytest.mark.parametrize(
    "text, value", [("true", True), ("TRUE", True), ("True", True), ("false", False), ("FaLsE", False)]
)
def test_cli_bools_as_toml_writes_them(text, value):
    """true / false in any case, as TOML and configuration.md write them, for every bool key:
    a flag (`--checkpoint.enable`, tyro's `--checkpoint.no-enable`) and a key that may be unset
    (bool | None, which also takes none); a bool alone means true. The fast path that checks
    the arguments before torch's import (train.py) accepts the same."""
    from titan_fold.train import usage_problem

    for args in (
        ["--moe.norm_topk_prob", text, "--training.document_masking", text, "--checkpoint.enable", text],
        [f"--moe.norm_topk_prob={text}", f"--training.document_masking={text}", f"--checkpoint.enable={text}"],
    ):
        args = ["--job.config_file", "debug_moe.toml", *args]
        assert usage_problem(args) is None
        config = parse_args(args)
        assert config.moe.norm_topk_prob is value and config.training.document_masking is value
        assert config.checkpoint.enable is value
    config = parse_args(["--job.config_file", "debug_moe.toml", "--checkpoint.enable", "--checkpoint.no-enable", text])
    assert config.checkpoint.enable is not value
    # alone: true, also before another key
    config = parse_args(["--job.config_file", "debug_moe.toml", "--training.document_masking", "--moe.norm_topk_prob"])
    assert config.training.document_masking is True and config.moe.norm_topk_prob is True
    for text in ("none", "None", "NONE"):
        assert (
            parse_args(["--job.config_file", "debug_moe.toml", "--moe.norm_topk_prob", text]).moe.norm_topk_prob is None
        )


# ---------------------------------------------------------------- preflight


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.name", "llama3", "--model.flavor", "debugmodel"],
            r"model.name = 'llama3': not a titan_fold model family",
        ),
        (["--training.global_batch_size", "3"], r"global_batch_size = 3 must be a multiple .* 1 x 2"),
        (["--training.seq_len", "4096"], r"training.seq_len = 4096: longer than qwen2_moe debug's max_seq_len 2048"),
        (["--training.dataset", "c4"], r"training.dataset = 'c4' is unknown"),
        (
            ["--training.dataset", "hf", "--training.dataset_path", "/nonexistent/x.jsonl"],
            r"'/nonexistent/x.jsonl' does not exist",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.initial_load_path", "/nonexistent/step-3"],
            r"initial_load_path = '/nonexistent/step-3' does not exist",
        ),
    ],
)
def test_preflight_rejects_before_any_process_group(tmp_path, args, message):
    import torch.distributed as dist

    config = parse_args(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--training.local_batch_size",
            "1",
            *args,
        ]
    )
    with pytest.raises(Exception, match=message):
        preflight(config, 2)
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_preflight_empty_dataset_and_dump_folder(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = parse_args(
        ["--job.config_file", "debug_moe.toml", "--training.dataset", "hf", "--training.dataset_path", str(empty)]
    )
    with pytest.raises(Exception, match="the file is empty"):
        preflight(config, 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError) as raised:  # a fault after preflight: the same words
        lock_dump_folder(str(tmp_path / "file" / "run"))
    assert str(raised.value) == (
        f"job.dump_folder: cannot write {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file, not a folder"
    )
    assert (
        storage_problem(str(tmp_path / "gone"))
        == f"cannot write {tmp_path / 'gone'}: the folder does not exist (any more)"
    )
    assert storage_problem(str(tmp_path)) is None


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    """The real command, one process (no torchrun needed: it fails before the process group)."""
    r = one_process(tmp_path / "run", "--model.name", "llama3")
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("error: model.name = 'llama3': not a titan_fold model family")
    assert not (tmp_path / "run").exists()
    r = one_process(tmp_path / "run")  # a good config, but no torchrun
    assert r.returncode == 2 and worker_lines(r.stderr, "error:") == [
        "error: start the trainer with its launcher: python -m titan_fold.run --nproc_per_node N ... "
        "(or torchrun --nproc_per_node N -m titan_fold.train ...)"
    ], r.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- metrics.jsonl


def test_metrics_file_resume_new_run_torn_line_and_nan(tmp_path):
    m = MetricsFile(str(tmp_path), run_id="a")
    m.start(0)
    for step in range(1, 6):
        m.write({"step": step, "loss": 1.0 / step})
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"run": "a", "step": 6, "lo')  # a full disk cut the last line

    m = MetricsFile(str(tmp_path), run_id="b")
    m.start(3)  # resumed from step-3: 4 and 5 are dropped, the torn line too
    m.write({"step": 4, "loss": float("nan"), "grad_norm": float("inf")})
    m.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]  # strict: no bare NaN
    assert [(r["run"], r["step"]) for r in records] == [("a", 1), ("a", 2), ("a", 3), ("b", 4)]
    assert records[-1]["loss"] is None and records[-1]["grad_norm"] is None
    assert records[-1]["nonfinite"] == ["loss", "grad_norm"]
    assert "NaN" not in text and "Infinity" not in text

    m = MetricsFile(str(tmp_path), run_id="c")
    m.start(0)  # a new run in a used folder: a new file, the old one kept by its run id
    m.write({"step": 1, "loss": 2.0})
    m.close()
    assert [r["run"] for r in read_records(str(tmp_path / "metrics.jsonl"))] == ["c"]
    assert [r["step"] for r in read_records(str(tmp_path / "metrics.b.jsonl"))] == [1, 2, 3, 4]


# ---------------------------------------------------------------- lock, storage


def test_lock_holder_stale_and_release(tmp_path):
    first = DumpFolderLock(str(tmp_path))
    first.acquire()
    holder = json.loads((tmp_path / "trainer.lock").read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(LockedError, match=rf"{tmp_path} is in use by another trainer \(pid {os.getpid()} on"):
        DumpFolderLock(str(tmp_path)).acquire()
    first.release()
    assert not (tmp_path / "trainer.lock").exists()

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "trainer.lock").write_text(json.dumps({**holder, "pid": dead.pid, "run_id": "other"}))
    taker = DumpFolderLock(str(tmp_path))
    taker.acquire()  # the holder's process is gone: a stale lock is taken over
    assert json.loads((tmp_path / "trainer.lock").read_text())["pid"] == os.getpid()
    taker.release()


@pytest.mark.parametrize(
    "code, cause",
    [
        pytest.param(errno.ENOSPC, "no space left on the device", id="enospc"),
        pytest.param(errno.EDQUOT, "the disk quota is exceeded", id="edquot"),
        pytest.param(errno.EFBIG, "a file larger than the file system allows", id="efbig"),
        pytest.param(errno.EACCES, "no write permission", id="eacces"),
        pytest.param(errno.EROFS, "a read-only file system", id="erofs"),
        pytest.param(errno.ENOENT, "the folder does not exist (any more)", id="enoent"),
    ],
)
def test_a_failed_save_names_its_errno(tmp_path, code, cause):
    """The cause comes from the write's own errno, not from a look at the folder afterwards
    (which found the step folder, never created, missing for every fault); a DCP failure of
    several ranks is named by the lowest rank's error, so every rank, holding the same
    failures, says the same line whichever rank failed first."""
    step = str(tmp_path / "checkpoint" / "step-4")
    with pytest.raises(SaveError) as raised, failing_save(step):
        raise OSError(code, os.strerror(code), os.path.join(step, "__0_0.distcp"))
    assert str(raised.value) == f"cannot save {step}: {cause}"
    other = OSError(errno.EIO, os.strerror(errno.EIO), step)
    for failures in ({1: other, 0: OSError(code, "", step)}, {0: OSError(code, "", step), 1: other}):
        with pytest.raises(SaveError) as raised, failing_save(step):
            raise CheckpointException("save failed", {r: (e, None) for r, e in failures.items()})
        assert str(raised.value) == f"cannot save {step}: {cause}"


def test_a_failed_save_places_its_cause(tmp_path, monkeypatch):
    """The folders say where the fault is: the checkpoint folder made unwritable while the run
    goes on (as a user without write permission sees it; root writes anywhere), or a part of
    the path that is a file."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    step = str(folder / "step-4")
    writable = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: writable(p, mode) and p != str(folder))
    with pytest.raises(SaveError) as raised, failing_save(step):  # what os.makedirs(step) raises then
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), step)
    assert str(raised.value) == f"cannot save {step}: no write permission in {folder}"
    (tmp_path / "file").write_text("x")
    step = str(tmp_path / "file" / "step-4")
    with pytest.raises(SaveError) as raised, failing_save(step):
        os.makedirs(step)
    assert str(raised.value) == f"cannot save {step}: {tmp_path / 'file'} is a file, not a folder"


def test_a_read_only_or_full_file_system_is_named(tmp_path, monkeypatch):
    """What statvfs says of the folder where a run's folder would be made: read-only, or under
    16 MiB free; a file system that keeps no such numbers is judged by permission alone."""
    from types import SimpleNamespace

    from titan_fold.common.storage import folder_problem

    def statvfs(flag: int, free_blocks: int):
        return lambda path: SimpleNamespace(f_flag=flag, f_bavail=free_blocks, f_frsize=4096)

    run = str(tmp_path / "run")
    monkeypatch.setattr(os, "statvfs", statvfs(os.ST_RDONLY, 10**6))
    assert folder_problem(run) == f"{tmp_path} is on a read-only file system"
    monkeypatch.setattr(os, "statvfs", statvfs(0, 1))
    assert folder_problem(run) == "no space left on the device (4096 bytes free)"
    monkeypatch.setattr(os, "statvfs", statvfs(0, 10**6))
    assert folder_problem(run) is None

    def unsupported(path):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), path)

    monkeypatch.setattr(os, "statvfs", unsupported)
    assert folder_problem(run) is None


def test_dump_and_checkpoint_folders_are_checked_before_any_work(tmp_path, monkeypatch):
    """Preflight, on every rank alike: a folder under a regular file, or where this user may
    not write, is one line naming the key, the folder and the cause; nothing is created."""
    (tmp_path / "file").write_text("x")
    cases = [
        (("--job.dump_folder", str(tmp_path / "file" / "run")), "job.dump_folder", tmp_path / "file" / "run"),
        (
            ("--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "--checkpoint.folder", "../file/ckpt"),
            "checkpoint.folder",
            tmp_path / "run" / ".." / "file" / "ckpt",
        ),
    ]
    for args, key, folder in cases:
        config = parse_args(["--job.config_file", "debug_moe.toml", *args])
        with pytest.raises(StorageError) as raised:
            preflight(config, 2)
        assert str(raised.value) == f"{key}: cannot write {folder}: {tmp_path / 'file'} is a file, not a folder"
    # root writes anywhere: the check asks os.access, here as a user without write permission would
    (tmp_path / "shared").mkdir()
    writable = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: writable(p, mode) and os.path.basename(p) != "shared")
    config = parse_args(["--job.config_file", "debug_moe.toml", "--job.dump_folder", str(tmp_path / "shared" / "run")])
    with pytest.raises(StorageError) as raised:
        preflight(config, 2)
    assert str(raised.value) == (
        f"job.dump_folder: cannot write {tmp_path / 'shared' / 'run'}: no write permission in {tmp_path / 'shared'}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "shared"]


@pytest.mark.parametrize(
    "nproc, dump, checkpoint, key, folder",
    [
        pytest.param(2, "file/run", None, "job.dump_folder", "file/run", id="dump-folder"),
        pytest.param(1, "run", "../file/ckpt", "checkpoint.folder", "run/../file/ckpt", id="checkpoint-folder"),
    ],
)
def test_a_folder_under_a_file_is_one_line_before_step_1(tmp_path, nproc, dump, checkpoint, key, folder):
    """The real command: every rank refuses it alike before any work, so one line whichever
    rank reports first, and no step runs (a checkpoint folder found bad at the first save lost
    the steps before it)."""
    (tmp_path / "file").write_text("x")
    extra = ("--checkpoint.enable", "--checkpoint.folder", checkpoint) if checkpoint else ()
    codes, _, err = forked(nproc, "titan_fold.train", *trainer_args(tmp_path / dump, "--training.steps", "2", *extra))
    lines = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert codes == [2] * nproc and lines == [
        f"error: {key}: cannot write {tmp_path / folder}: {tmp_path / 'file'} is a file, not a folder"
    ], (codes, err[-3000:])
    assert not (tmp_path / "run").exists()  # nothing trained, nothing made


def test_metrics_file_in_missing_folder_is_one_line(tmp_path):
    m = MetricsFile(str(tmp_path / "gone"))
    with pytest.raises(
        StorageError, match=r"cannot write .*gone/metrics.jsonl: the folder does not exist \(any more\)$"
    ):
        m.start(0)


# ---------------------------------------------------------------- plan / layout CLIs


def run_cli(module, args, capsys):
    from titan_fold.common.errors import run_command

    with pytest.raises(SystemExit) as e:
        run_command(lambda: module.main(args))
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--capacity-factor", "-1"], "--capacity-factor -1.0: must be > 0"),
        (["--capacity-factor", "nan"], "--capacity-factor nan: must be > 0"),
        (["--gpus", "0"], "--gpus 0: must be >= 1"),
        (["--gpus-per-node", "0"], "--gpus-per-node 0: must be >= 1"),
        (["--gpus", "60"], "--gpus 60: must be whole nodes of --gpus-per-node 8 (56 or 64), or one node at most"),
        (
            ["--gpus", "6", "--gpus-per-node", "4"],
            "--gpus 6: must be whole nodes of --gpus-per-node 4 (4 or 8), or one node at most",
        ),
        (["--fix", "ep"], "--fix ep: write DIM=N"),
        (["--fix", "ep=x"], "--fix ep=x: write DIM=N"),
        (["--min-gpus", "foo=2"], "--min-gpus foo=2: unknown dim 'foo'"),
    ],
)
def test_plan_rejects_impossible_inputs(capsys, args, message):
    from titan_fold import plan

    code, err = run_cli(plan, ["--model", "qwen2_moe/debug", *args], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), err


def test_layout_out_into_missing_folder(capsys, tmp_path):
    from titan_fold import layout

    code, err = run_cli(
        layout, ["--world-size", "2", "--out", str(tmp_path / "no" / "x.json"), "--format", "json"], capsys
    )
    assert code == 2 and len(err) == 1 and "no/x.json" in err[0] and "does not exist" in err[0], err


# ---------------------------------------------------------------- runs


def test_nan_stops_every_rank_and_a_nan_checkpoint_is_refused(tmp_path):
    """lr 1e6: the loss or grad norm turns NaN within a few steps on both ranks."""
    folder = tmp_path / "run"
    r = launch(
        2,
        folder,
        "--training.global_batch_size",
        "2",
        "--training.steps",
        "8",
        "--optimizer.lr",
        "1e6",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.no-last_save_model_only",
    )
    assert r.returncode != 0
    lines = worker_lines(r.stderr, "error:")
    assert len(lines) == 1, r.stderr[-4000:]
    bad = int(lines[0].split()[2].rstrip(":"))
    assert f"error: step {bad}: " in lines[0] and ("is nan" in lines[0] or "is inf" in lines[0])
    assert f"last complete checkpoint step-{bad - 1} in {folder / 'checkpoint'}" in lines[0]
    assert "exitcode  : 3" in r.stderr and "Traceback (most recent call last):\n    File" not in r.stderr
    assert steps_saved(folder) == list(range(1, bad))  # nothing saved from the NaN step
    records = read_records(str(folder / "metrics.jsonl"))
    assert [m["step"] for m in records] == list(range(1, bad))
    assert not (folder / "trainer.lock").exists()

    # one NaN in a saved weight (what flipped bits on a disk can do), rewritten as DCP
    last = folder / "checkpoint" / f"step-{bad - 1}"
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(str(last), str(whole))
    state = torch.load(whole, weights_only=False)
    state["layers.0.attention.wq.weight"][0, 0] = float("nan")
    torch.save(state, whole)
    shutil.rmtree(last)
    torch_save_to_dcp(str(whole), str(last))
    codes, _, stderr = forked(
        1,
        "titan_fold.train",
        *trainer_args(folder, "--training.global_batch_size", "1", "--training.steps", "8", "--checkpoint.enable"),
    )
    lines = worker_lines(stderr, "error:")
    assert codes != [0] and len(lines) == 1, stderr[-4000:]
    assert f"checkpoint {last} holds non-finite weights (layers.0.attention.wq.weight has NaN or Inf)" in lines[0]


def test_skip_policy_skips_and_counts(tmp_path):
    folder = tmp_path / "run"
    codes, _, stderr = forked(
        1,
        "titan_fold.train",
        *trainer_args(
            folder,
            "--training.global_batch_size",
            "1",
            "--training.steps",
            "6",
            "--optimizer.lr",
            "1e6",
            "--training.nonfinite",
            "skip",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "100",
            "--checkpoint.no-last_save_model_only",
        ),
    )
    assert codes == [0], stderr[-4000:]
    records = read_records(str(folder / "metrics.jsonl"))
    skipped = [m for m in records if "skipped" in m]
    assert skipped and skipped[-1]["skipped_steps"] == len(skipped)
    assert sorted(m["step"] for m in records) == list(range(1, 7))  # each step once: logged or skipped
    weights = read_model_tensors(str(folder / "checkpoint" / "step-6"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def _wait_for_step(folder, step: int, proc, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    path = folder / "metrics.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        if path.exists() and any(r.get("step", 0) >= step for r in read_records(str(path))):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no step {step} in {path}")


def test_sigterm_saves_exits_143_and_resumes_once_per_step(tmp_path):
    folder = tmp_path / "run"
    common = (
        "--training.global_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.no-last_save_model_only",
    )
    proc = subprocess.Popen(
        trainer_cmd(2, folder, *common, "--training.steps", "1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    _wait_for_step(folder, 2, proc)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to both workers
    _, stderr = proc.communicate(timeout=600)
    lines = worker_lines(stderr, "stopped by SIGTERM")
    assert len(lines) == 1, stderr[-4000:]
    stop = int(lines[0].split()[5].rstrip(";"))
    assert (
        lines[0]
        == f"stopped by SIGTERM at step {stop}; last complete checkpoint step-{stop} in {folder / 'checkpoint'}"
    )
    assert steps_saved(folder) == [stop] and only_torchruns_traceback(stderr), stderr[-5000:]
    assert not (folder / "trainer.lock").exists()

    r = launch(2, folder, *common, "--training.steps", str(stop + 2))
    assert_clean_exit(r, folder)
    steps = [m["step"] for m in read_records(str(folder / "metrics.jsonl"))]
    assert steps == list(range(1, stop + 3))  # each step once


def _agree_worker(rank: int, port: int, out_dir: str) -> None:
    from launcher import end_rank_checks, start_rank

    from titan_fold.trainer.signals import NONE, PREEMPT, StopSignals

    start_rank(rank, port, 2)
    signals, seen = StopSignals(), []
    for step in range(1, 5):
        seen.append(signals.agreed(torch.device("cpu")))
        if rank == 1 and step == 2:  # SIGTERM reaches rank 1 only, during step 2
            signals.kind = PREEMPT
    want = [NONE, NONE, NONE, PREEMPT]  # the request of step 2 is read at the end of step 3
    end_rank_checks(out_dir, rank, [] if seen == want else [f"rank {rank}: {seen} != {want}"])


def test_a_stop_request_is_agreed_one_step_later_on_every_rank(tmp_path):
    """StopSignals.agreed on two ranks: a request that only rank 1 gets during step 2 stops both
    after step 3 (the all-reduce queued at one step's end is read at the next); one rank alone
    acts on its own request at once."""
    from launcher import fork_ranks

    from titan_fold.trainer.signals import PREEMPT, StopSignals

    assert fork_ranks(_agree_worker, 2, tmp_path) == []
    alone = StopSignals()
    alone.kind = PREEMPT
    assert alone.agreed(torch.device("cpu")) == PREEMPT


def test_ctrl_c_is_one_line_exit_130_and_the_folder_is_locked_meanwhile(tmp_path):
    folder = tmp_path / "run"
    proc = subprocess.Popen(
        trainer_cmd(1, folder, "--training.global_batch_size", "1", "--training.steps", "1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    _wait_for_step(folder, 1, proc)
    # a second trainer (one process, as torchrun would start it) into the same folder
    second = one_process(
        folder, "--training.global_batch_size", "1", env=dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    )
    assert second.returncode == 2
    holder = json.loads((folder / "trainer.lock").read_text())
    lines = worker_lines(second.stderr, "error:")
    assert len(lines) == 1 and lines[0].startswith(
        f"error: job.dump_folder {folder} is in use by another trainer (pid {holder['pid']} on {holder['host']}, since "
    ), second.stderr[-3000:]
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=600)
    lines = worker_lines(stderr, "interrupted at step")
    assert len(lines) == 1, stderr[-4000:]
    assert lines[0].endswith("; checkpointing is off (checkpoint.enable)")
    assert only_torchruns_traceback(stderr) and "KeyboardInterrupt" not in stderr, stderr[-5000:]
    assert not (folder / "trainer.lock").exists()


def test_finished_two_rank_runs_exit_0(tmp_path):
    """assert_clean_exit on a run without checkpoints (the SIGTERM test's resume is a second
    finished two-rank run). Raise TITAN_FOLD_TEARDOWN_RUNS for a stress run."""
    for i in range(int(os.environ.get("TITAN_FOLD_TEARDOWN_RUNS", "1"))):
        r = launch(2, tmp_path / f"run{i}", "--training.global_batch_size", "2", "--training.steps", "1")
        assert_clean_exit(r, tmp_path / f"run{i}")


# `python -m titan_fold.train` whose trainer has returned its exit code; its last object takes
# seconds to free, as the interpreter's final collection of a model does (torchtitan turns
# automatic collection off)
_RETURNED_RANK = """
import gc, runpy, signal, sys, time
from titan_fold.trainer import fold_trainer

class Part:
    def __del__(self):
        time.sleep(5)

def main(args=None, dry_run=None):
    signal.signal(signal.SIGTERM, lambda *_: None)  # as StopSignals: a signal only sets a flag
    gc.disable()
    part = Part()
    part.cycle = part
    print("returning", flush=True)
    return 3

fold_trainer.main = main
sys.argv[1:] = ["--job.config_file", "debug_moe.toml"]  # the command's own checks pass; main ignores them
runpy.run_module("titan_fold.train", run_name="__main__", alter_sys=True)
"""


def test_a_rank_that_returned_keeps_its_exit_code_through_torchruns_sigterm(tmp_path):
    """torchrun sends SIGTERM to the ranks still running once one exits non-zero (a NaN stop:
    3 on every rank). A rank that has returned its code ends with it: the interpreter's own
    teardown would first reset the signal handlers, and the SIGTERM would kill it (-15)."""
    script = tmp_path / "rank.py"
    script.write_text(_RETURNED_RANK)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    assert proc.stdout.readline() == "returning\n", proc.communicate()[1][-3000:]
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr[-3000:]


def test_plan_min_gpus_search_is_bounded(capsys, monkeypatch):
    from titan_fold import plan
    from titan_fold.planning import plan as planning

    monkeypatch.setattr(planning, "MIN_GPUS_BUDGET_S", 0.0)  # ep=3 never divides the debug model's 8 experts
    code, err = run_cli(plan, ["--model", "qwen2_moe/debug", "--min-gpus", "ep=3"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --min-gpus ep=3: no mapping found up to 3 GPUs"), (
        err
    )
    monkeypatch.setattr(planning, "MIN_GPUS_BUDGET_S", 60.0)
    code, _ = run_cli(plan, ["--model", "qwen2_moe/debug", "--min-gpus", "ep=2"], capsys)
    assert code == 0


@pytest.mark.parametrize(
    "fault, rank, cause",
    [
        ("enospc", 1, "no space left on the device"),
        ("permission", 0, "no write permission"),
        ("efbig", 0, "a file larger than the file system allows"),
        ("vanished", 1, "the folder does not exist (any more)"),
    ],
)
def test_a_failed_save_is_one_line_exit_2_on_every_rank(tmp_path, fault, rank, cause):
    """The save of step 4 fails on one rank, inside DCP's writes (checkpoint/manager.py's fault
    injection: the disk full, no permission, or the step folder removed while it is written):
    every rank exits 2, one line names the folder, the cause and the last complete checkpoint,
    which is left whole."""
    folder = tmp_path / "run"
    env = {"TITAN_FOLD_FAULT_KIND": fault, "TITAN_FOLD_FAULT_AT_STEP": "4", "TITAN_FOLD_FAULT_RANK": str(rank)}
    codes, out, err = forked(
        2,
        "titan_fold.train",
        *trainer_args(
            folder,
            "--training.global_batch_size",
            "2",
            "--training.steps",
            "5",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
        ),
        env=env,
    )
    assert codes == [2, 2], (codes, err[-6000:])
    lines = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    checkpoints = folder / "checkpoint"
    assert lines == [
        f"error: cannot save {checkpoints / 'step-4'}: {cause}; last complete checkpoint step-2 in {checkpoints}"
    ], err[-6000:]
    assert steps_saved(folder) == [2]
    weights = read_model_tensors(str(checkpoints / "step-2"))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
