"""Shared helpers for tests that launch the trainer on several CPU ranks."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

# one thread per pytest-xdist worker (and per process a test starts): the two workers share two
# cores, and torch's default of a thread per core has each worker's idle threads spin against the
# other's busy ones; two dry runs side by side took 244 s each that way, 31 s on one thread each
os.environ.setdefault("OMP_NUM_THREADS", "1")

from launcher import ZYGOTE, RanksFailed  # noqa: E402

# what the suite needs beyond pytest: the install README gives (pip install -e ".[test]")
NEEDED = ("torch", "torchtitan", "titan_fold", "transformers")
INSTALL = 'activate the venv (. .venv/bin/activate) or install the test extra: pip install torch==2.13.0 && pip install -e ".[test]"'


def pytest_addoption(parser, pluginmanager):
    if not pluginmanager.hasplugin("xdist"):
        # pyproject.toml's addopts are pytest-xdist's options: accept them here, so that an
        # interpreter without it says what is missing (pytest_configure) instead of
        # "unrecognized arguments: -n --dist loadfile"
        group = parser.getgroup("xdist", "pytest-xdist is not installed: these options do nothing")
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=None)
        group.addoption("--dist", dest="dist", default="no")
        group.addoption("--no-loadscope-reorder", dest="loadscopereorder", action="store_false")


def pytest_configure(config):
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        pytest.exit(f"{sys.executable} lacks {', '.join(missing)}: {INSTALL}", returncode=4)
    if not config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses") not in (None, "0"):
        config.issue_config_time_warning(
            pytest.PytestConfigWarning(f"pytest-xdist is not installed: the tests run in one process; {INSTALL}"),
            stacklevel=2,
        )


# pytest-xdist runs the files on two workers, a whole file each (pyproject.toml's addopts),
# handing out the next file as a worker nears the end of its last one: the files with the
# longest launches go first, so that the two workers finish together rather than one
# waiting out the other's last long file.
LONGEST_FIRST = [
    "test_dryrun.py",
    "test_dryrun_match.py",
    "test_overlap.py",
    "test_readme_commands.py",
    "test_equivalence.py",
    "test_equivalence_qwen35.py",
    "test_equivalence_gpt_oss.py",
    "test_checkpoint.py",
    "test_optimizer.py",
    "test_muon_folding.py",
    "test_reliability.py",
    "test_docs.py",
    "test_hf.py",
    "test_first_hour.py",
    "test_packaged_configs_train.py",
    "test_pipeline.py",
    "test_cp_documents.py",
    "test_gradient_check.py",
    "test_attention_parallel.py",
    "test_both_runs_check.py",
    "test_mutations.py",
]


# the reasons a test may skip for: this machine lacks the hardware or the kernel library the test
# exercises. Any other skip (a data file or a bench record missing, nothing to run) hides a test
# that no longer runs: it fails the session, listed at the end (tests/test_skips.py)
ALLOWED_SKIPS = ("needs a GPU", "needs QuACK")
UNEXPLAINED: list[tuple[str, str]] = []  # (node id, reason)


def skip_reason(report) -> str:
    """The reason a skipped test or collector gave (pytest.skip's message, a skipif's reason)."""
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: REASON")
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and not skip_reason(report).startswith(ALLOWED_SKIPS):
        UNEXPLAINED.append((report.nodeid, skip_reason(report)))


# under pytest-xdist both hooks also run in the controller, for every worker's skips
def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):  # a module-level skip (pytest.importorskip, allow_module_level)
    _note_skip(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    # in the controller (or the only process); a worse status (interrupted, an internal error) stays
    if (
        UNEXPLAINED
        and not hasattr(session.config, "workerinput")
        and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    ):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    if UNEXPLAINED and not hasattr(config, "workerinput"):
        terminalreporter.section("skips that are not allowed", red=True)
        terminalreporter.line(f"a test may skip only for a reason starting with one of {ALLOWED_SKIPS}:")
        for nodeid, reason in UNEXPLAINED:
            terminalreporter.line(f"{nodeid}: {reason}", red=True)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


def forked(
    nproc: int, module: str, *args: str, env: dict | None = None, timeout: float = 900
) -> tuple[list[int], str, str]:
    """`python -m MODULE ARGS` on NPROC ranks with torchrun's environment (0: one plain process),
    forked from one process that imported the trainer once per session (tests/launcher.py);
    -> every rank's exit code, stdout, stderr."""
    with tempfile.TemporaryDirectory() as logs:
        out, err = pathlib.Path(logs, "stdout"), pathlib.Path(logs, "stderr")
        codes = ZYGOTE.launch(nproc, list(args), str(out), str(err), env=env, timeout=timeout, module=module)
        return codes, out.read_text(errors="replace"), err.read_text(errors="replace")


def torchrun(nproc: int, *args: str, config: str = "debug_moe.toml") -> None:
    """`torchrun --standalone --nproc_per_node NPROC -m titan_fold.train --job.config_file CONFIG ARGS`,
    the ranks forked (`forked`); torchrun itself: test_checkpoint.py's fault test and
    test_reliability.py's signal tests. A failed run raises RanksFailed: a crash, not a wrong value."""
    codes, out, err = forked(nproc, "titan_fold.train", "--job.config_file", config, *args)
    if any(codes):
        raise RanksFailed(f"exit codes {codes}\n{out[-3000:]}{err[-6000:]}")


def python_m(module: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` as one process in this test's working folder: its exit code,
    stdout and stderr, as subprocess.run(capture_output=True, text=True) gives them, without
    the fresh interpreter's seconds of imports (`forked`)."""
    (code,), out, err = forked(0, module, *args, env=env, timeout=timeout)
    return subprocess.CompletedProcess(["python", "-m", module, *args], code, out, err)


def read_metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_from_seed(
    folder, nproc: int, seed_checkpoint: str, steps: int, *args: str, config: str = "debug_moe.toml"
) -> list[dict]:
    """Train `steps` steps from the seed checkpoint, logging every step with each parameter
    group's norms; -> the metrics."""
    torchrun(
        nproc,
        "--job.dump_folder",
        str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        seed_checkpoint,
        "--checkpoint.interval",
        "1000",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.group_grad_norms",
        *args,
        config=config,
    )
    return read_metrics(folder)


# a folding changes where each parameter group's work runs: each group is compared on its own,
# relative to its own norm (the routed experts' is about 1e-3 of the total in the debug model)
GROUP_METRICS = ("group_grad_norms", "group_update_norms")


def assert_matches_one_rank(
    reference: list[dict],
    got: list[dict],
    name: str,
    keys: tuple[str, ...] = ("loss", "grad_norm", "moe_aux_loss"),
    rel: float = 1e-4,
    abs: float = 1e-7,
) -> None:
    """Every step of `got` as the one-rank `reference`: the logged `keys`, and the gradient norm
    and update norm of every parameter group (train_from_seed logs them)."""
    assert len(got) == len(reference) > 0, name
    for ref, run in zip(reference, got, strict=True):
        for key in keys:
            assert run[key] == pytest.approx(ref[key], rel=rel, abs=abs), (name, key, ref["step"])
        # the groups part the parameters: their squares add up to the total
        assert sum(v**2 for v in run["group_grad_norms"].values()) == pytest.approx(run["grad_norm"] ** 2, rel=1e-4)
        for metric in GROUP_METRICS:
            assert set(run[metric]) == set(ref[metric]), (name, metric, ref["step"])
            for group, value in ref[metric].items():
                assert run[metric][group] == pytest.approx(value, rel=rel), (name, metric, group, ref["step"])


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> str:
    """Initial weights of the debug model, made once on one rank (torchtitan's seed flow)."""
    root = tmp_path_factory.mktemp("seed")
    torchrun(1, "--job.dump_folder", str(root), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    return str(root / "checkpoint" / "step-0")


@pytest.fixture(scope="session")
def one_rank_reference(tmp_path_factory, seed_checkpoint) -> list[dict]:
    """5 steps on one rank from the seed checkpoint: the global batch of 8 sequences in 8
    micro-batches of one (so each MoE aux loss is a mean over one sequence, as in the
    folded runs that compare against it)."""
    return train_from_seed(
        tmp_path_factory.mktemp("ref"),
        1,
        seed_checkpoint,
        5,
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "8",
    )
