"""pytest plugin of the mutation runner (tests/mutations.py): `-p pytest_outcomes`, this folder on
the path. Writes each test's outcome and what it failed on to the JSON file named by
$TITAN_FOLD_OUTCOMES:

    {"tests": {node id: {"verdict": "passed" | "assertion: ..." | "crash: ..." | "error in setup: ...",
                         "seconds": setup + call + teardown}},
     "collection errors": ["<node id>: <first line>", ...]}

A failure is an "assertion" when the test's body raised a test's AssertionError (failures.py)
and no process it started (ranks, subprocesses) ended on an exception other than a test's
assertion; a crash, another exception, a rank's timeout or a failing fixture is not.
"""

import json
import os

import failures
import pytest

OUTCOMES = "TITAN_FOLD_OUTCOMES"


class Outcomes:
    def __init__(self, path: str, tests_folder: str):
        self.path, self.log = path, path + ".log"
        self.tests: dict[str, dict] = {}
        self.collection_errors: list[str] = []
        self.log_start = 0
        here = os.path.dirname(os.path.abspath(__file__))
        # what the test's ranks and subprocesses inherit: the log, the test code, sitecustomize.py
        os.environ[failures.LOG] = self.log
        os.environ[failures.TEST_CODE] = tests_folder
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)

    def pytest_runtest_logstart(self, nodeid):
        self.log_start = os.path.getsize(self.log) if os.path.exists(self.log) else 0
        self.tests[nodeid] = {"verdict": "passed", "seconds": 0.0}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        seen = self.tests[item.nodeid]
        seen["seconds"] = round(seen["seconds"] + report.duration, 2)
        if report.failed and seen["verdict"] == "passed":
            seen["verdict"] = self.judge(report.when, call.excinfo.value if call.excinfo else None)
        elif report.skipped and report.when != "teardown":
            seen["verdict"] = "skipped"

    def judge(self, when: str, exc: BaseException | None) -> str:
        what = failures.describe(exc) if exc is not None else "no exception"
        started = failures.read_log(self.log, self.log_start)
        # a rank's assertion ends the launch: its peers may then fail in a collective
        ended = (
            [] if any(e["kind"] == "assertion" for e in started) else [e for e in started if e["kind"] != "assertion"]
        )
        inside = f"in a process the test started ({' '.join(ended[0]['argv'])}): {ended[0]['what']}" if ended else ""
        if when != "call":
            return f"error in {when}: {inside or what}"
        if exc is None or not failures.is_test_assertion(exc):
            return f"crash: {inside or what}"
        if ended:
            return f"{ended[0]['kind']}: {inside}"
        return f"assertion: {what}"

    def pytest_collectreport(self, report):
        if report.failed:
            lines = str(report.longrepr).strip().splitlines()
            self.collection_errors.append(f"{report.nodeid or '.'}: {lines[-1] if lines else ''}")

    def pytest_sessionfinish(self):
        with open(self.path, "w") as f:
            json.dump({"tests": self.tests, "collection errors": self.collection_errors}, f, indent=1)


def pytest_configure(config):
    if os.environ.get(OUTCOMES):
        config.pluginmanager.register(Outcomes(os.environ[OUTCOMES], str(config.rootpath / "tests")), "outcomes")
