"""The suite's pytest hooks (the install check, the skip policy, the order of the longest files)
and the fixtures shared by the folding tests: the debug model's seed checkpoint and its one-rank
reference run. Helpers that test files import are in tests/helpers.py."""

import importlib.util
import os
import sys

import pytest

# one thread per pytest-xdist worker (and per process a test starts): the two workers share two
# cores, and torch's default of a thread per core has each worker's idle threads spin against the
# other's busy ones; two dry runs side by side took 244 s each that way, 31 s on one thread each
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> str:
    """Initial weights of the debug model, made once on one rank (torchtitan's seed flow)."""
    from helpers import torchrun  # not at the top: the install check runs before torch is imported

    root = tmp_path_factory.mktemp("seed")
    torchrun(1, "--job.dump_folder", str(root), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    return str(root / "checkpoint" / "step-0")


@pytest.fixture(scope="session")
def one_rank_reference(tmp_path_factory, seed_checkpoint) -> list[dict]:
    """5 steps on one rank from the seed checkpoint: the global batch of 8 sequences in 8
    micro-batches of one (so each MoE aux loss is a mean over one sequence, as in the
    folded runs that compare against it)."""
    from helpers import train_from_seed

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
