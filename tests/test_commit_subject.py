"""The commit-msg hook: a subject of 72 characters passes, 73 is refused in one line, as is an empty
one; git's comment lines are not the subject. The pre-commit config runs it at the commit-msg stage."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK = os.path.join(ROOT, ".ci", "commit_subject.py")


def _hook(tmp_path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([sys.executable, HOOK, str(path)], capture_output=True, text=True)


def test_subject_length_limit(tmp_path):
    ok = _hook(tmp_path, "# Please enter the commit message\n" + "a" * 72 + "\n\nA body line " + "b" * 100 + "\n")
    assert ok.returncode == 0, ok.stdout
    long = _hook(tmp_path, "a" * 73 + "\n")
    assert long.returncode == 1
    assert long.stdout.count("\n") == 1 and "73 characters, at most 72" in long.stdout
    empty = _hook(tmp_path, "# only a comment\n\n")
    assert empty.returncode == 1 and "empty" in empty.stdout


def test_pre_commit_runs_the_hook_at_commit_msg():
    config = open(os.path.join(ROOT, ".pre-commit-config.yaml")).read()
    assert "default_install_hook_types: [pre-commit, commit-msg]" in config
    hook = config[config.index("id: commit-subject") :]
    assert "entry: python .ci/commit_subject.py" in hook and "stages: [commit-msg]" in hook
