"""The mutation suite (tests/mutations.py). The runner itself, on a toy repository: a planted
wrong value is caught; a planted exception, a syntax error, a hang, a change no test notices
and a test that fails without the mutation are not, each reported as what it is, in the test
or in a process the test started. The record: it covers the list as it is, each mutation
caught on its tests' assertions, no entry stale, at least MIN_COUNT. The mutations marked fast
are planted and caught again here."""

import dataclasses
import textwrap

import pytest
from mutations import MIN_COUNT, MUTATIONS, Mutation, mutate, problems, read_record, run

TOY = {
    "mod.py": "def f():\n    return 2\n",
    "tests/check.py": "import mod\n\n\ndef check():\n    assert mod.f() == 2\n",
    "tests/test_toy.py": textwrap.dedent(
        """\
        import subprocess
        import sys

        import mod


        def test_f():
            assert mod.f() == 2


        def test_f_in_a_subprocess():
            code = "import sys; sys.path.insert(0, 'tests'); import check; check.check()"
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr


        def test_broken():
            assert mod.f() == 5
        """
    ),
}
F, SUB, BROKEN = (f"tests/test_toy.py::{t}" for t in ("test_f", "test_f_in_a_subprocess", "test_broken"))


@pytest.fixture
def toy(tmp_path):
    for name, text in TOY.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def planted(name, new, tests=(F, SUB)):
    return Mutation(name, name, "mod.py", "return 2", new, tests)


def test_runner_counts_only_a_wrong_value(toy):
    mutations = [
        planted("value", "return 3"),
        planted("crash", 'raise RuntimeError("planted")'),
        planted("internal_assert", "assert False, 'an invariant of the code under test'"),
        planted("harmless", "return 2  # unchanged"),
        planted("syntax", "return 2 +", (F,)),
        planted("baseline", "return 3", (F, BROKEN)),
        Mutation("absent", "absent", "mod.py", "return 7", "return 3", (F,)),
    ]
    got = {o.mutation.name: o for o in run(mutations, toy)}
    assert got["value"].verdict == "caught", got["value"].verdicts
    assert got["value"].verdicts[SUB].startswith("assertion: AssertionError"), got["value"].verdicts
    for test in (F, SUB):
        assert "RuntimeError: planted" in got["crash"].verdicts[test], got["crash"].verdicts
        assert got["crash"].verdicts[test].startswith("crash:"), got["crash"].verdicts
        # an AssertionError raised in the code under test is a crash too
        assert got["internal_assert"].verdicts[test].startswith("crash:"), got["internal_assert"].verdicts
    assert "in a process the test started" in got["crash"].verdicts[SUB], got["crash"].verdicts
    assert got["crash"].verdict.startswith("not caught: crash: RuntimeError: planted"), got["crash"].verdict
    assert got["harmless"].verdict == f"not caught: passed ({F})"
    assert got["syntax"].verdict.startswith("not caught: collection error"), got["syntax"].verdict
    assert "SyntaxError" in got["syntax"].verdict, got["syntax"].verdict
    assert got["baseline"].verdict.startswith("baseline fails: assertion: AssertionError: assert 2 == 5"), got[
        "baseline"
    ].verdict
    assert got["absent"].verdict.startswith("not caught: not planted"), got["absent"].verdict


def test_runner_reports_a_hang_as_a_timeout(toy):
    (outcome,) = run([planted("hang", "import time; time.sleep(600)", (F,))], toy, baseline=False, timeout=5)
    assert outcome.verdict == f"not caught: timeout: still running after 5 s ({F})"


def test_fingerprint_covers_the_mutation_and_its_test_files(toy):
    m = planted("value", "return 3")
    before = m.fingerprint(toy)
    assert dataclasses.replace(m, new="return 4").fingerprint(toy) != before
    assert dataclasses.replace(m, tests=(F,)).fingerprint(toy) != before
    assert dataclasses.replace(m, what="reworded").fingerprint(toy) == before
    (toy / "tests" / "test_toy.py").write_text(TOY["tests/test_toy.py"] + "\n# edited\n")
    assert m.fingerprint(toy) != before


def test_the_text_must_occur_once(tmp_path):
    (tmp_path / "f.py").write_text("a = 1\na = 1\n")
    for old in ("a = 1\n", "b = 2\n"):
        with pytest.raises(ValueError, match="occurs [02] times"):
            mutate(Mutation("m", "what", "f.py", old, "", ()), tmp_path)


def test_record_covers_every_mutation_caught_for_the_right_reason():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names)) >= MIN_COUNT
    record = read_record()
    assert problems(record) == {}, "run `python -m tests.mutations --record --stale` for these"
    assert set(record["mutations"]) == set(names)
    for m in MUTATIONS:
        tests = record["mutations"][m.name]["tests"]
        assert set(tests) == set(m.tests), m.name
        assert all(verdict.startswith("assertion: ") for verdict in tests.values()), (m.name, tests)
    assert record["caught"] == record["of"] == len(MUTATIONS) >= MIN_COUNT


def test_check_names_each_stale_missing_or_missed_entry():
    first, second, third = MUTATIONS[:3]
    record = {"mutations": {m.name: {"fingerprint": m.fingerprint(), "verdict": "caught"} for m in MUTATIONS}}
    assert problems(record) == {}
    record["mutations"][first.name]["fingerprint"] = "0" * 16
    del record["mutations"][second.name]
    record["mutations"][third.name]["verdict"] = "not caught: crash: RuntimeError: x"
    found = problems(record)
    assert list(found) == [first.name, second.name, third.name]
    assert "stale" in found[first.name] and found[second.name] == "not recorded"
    assert found[third.name] == "not caught: crash: RuntimeError: x"


@pytest.mark.slow  # minutes: the real tests
@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.fast], ids=lambda m: m.name)
def test_fast_mutation_is_caught(mutation):
    # no baseline run: the suite runs the same tests unmutated
    (outcome,) = run([mutation], baseline=False)
    assert outcome.caught, f"{outcome.verdict}\n{outcome.output[-3000:]}"
