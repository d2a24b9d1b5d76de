"""Command output quoted in docs/ is what the tools print today (`python docs/gen.py` rewrites it)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import gen  # noqa: E402


@pytest.mark.parametrize("doc", gen.DOCS)
def test_quoted_output_is_current(doc):
    # planning.md's 20 planner searches: about a CPU minute, each forked from one import (gen.fork_module)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "gen.py"), "--check", doc],
                            capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, f"{doc} quotes stale output; run `python docs/gen.py`:\n{result.stdout}{result.stderr}"


def test_generator_replaces_only_the_output():
    text = "\n".join(["intro", gen.MARKER, "```", "$ echo one \\", "  two | tr a-z A-Z", "stale", "",
                      "$ printf 'x\\ny\\n'", "old", "```", "```", "$ echo untouched", "kept", "```"])
    lines = gen.generate(text, workers=1).split("\n")
    assert lines == ["intro", gen.MARKER, "```", "$ echo one \\", "  two | tr a-z A-Z", "ONE TWO", "",
                     "$ printf 'x\\ny\\n'", "x", "y", "```", "```", "$ echo untouched", "kept", "```"]


def test_python_commands_are_forked_with_their_filter():
    assert gen.python_module("python -m titan_fold.plan --gpus 64 | grep -E '^( +1 |best)'") == (
        ["titan_fold.plan", "--gpus", "64"], " grep -E '^( +1 |best)'")
    assert gen.python_module("python -m titan_fold.layout --world-size 8 \\\n  --tp 2") == (
        ["titan_fold.layout", "--world-size", "8", "--tp", "2"], "")
    assert gen.python_module("python -m titan_fold.plan > out.txt") is None  # bash runs the rest
    assert gen.python_module("NGPU=8 python -m titan_fold.train") is None
    code, output = gen.fork_module(["titan_fold.plan", "--model", "57B-A14B", "--min-gpus", "cp=8", "ep=8"])
    assert code == 0 and "folded  cp=8 ep=8: 8 GPUs" in output, output
