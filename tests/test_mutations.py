"""The mutation suite (tests/mutations.py): its record covers the list as it is, every mutation
caught; the mutations marked fast are planted and caught again here; the runner reports a
mutation that no test notices as missed."""

import dataclasses

import pytest
from mutations import MUTATIONS, ROOT, Mutation, mutate, read_record, run

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only


def test_record_covers_every_mutation_as_it_is():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names)) >= 15
    record = read_record()["mutations"]
    assert set(record) == set(names), "run `python -m tests.mutations --record` after changing the list"
    for m in MUTATIONS:
        seen = record[m.name]
        assert seen["fingerprint"] == m.fingerprint(), f"{m.name} changed since the record: run it again"
        assert seen["caught"] and sorted(seen["failed"]) == sorted(m.tests), m.name


@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.fast], ids=lambda m: m.name)
def test_fast_mutation_is_caught(mutation):
    outcome = run(mutation)
    assert outcome.caught, (
        f"{mutation.name}: did not fail: {set(mutation.tests) - set(outcome.failed)}\n{outcome.output[-3000:]}"
    )


def test_a_harmless_change_is_not_caught():
    """The runner itself: a mutation that changes only a comment leaves its tests passing, and
    is reported as missed, not caught."""
    fast = next(m for m in MUTATIONS if m.fast)
    first = (ROOT / fast.path).read_text().splitlines(keepends=True)[0]  # a module's docstring opens it
    harmless = dataclasses.replace(fast, name="harmless", old=first, new=first.replace('"""', '"""Unchanged. ', 1))
    outcome = run(harmless)
    assert not outcome.caught and outcome.failed == [], outcome.output[-3000:]


def test_the_text_must_occur_once(tmp_path):
    (tmp_path / "f.py").write_text("a = 1\na = 1\n")
    for old in ("a = 1\n", "b = 2\n"):
        with pytest.raises(ValueError, match="occurs [02] times"):
            mutate(Mutation("m", "what", "f.py", old, "", ()), tmp_path)
