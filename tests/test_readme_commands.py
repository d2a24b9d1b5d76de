"""Every command that README.md and docs/*.md show runs as written, on the CPU.

The commands are read from the files (a line in an indented or fenced code block that starts
with a program or `VAR=value`, with its `\\` continuation lines), so an example added or
changed is tested as it reads. Each runs in a fresh working folder per file (the
commands of one file share it, in order: the seed checkpoint a later command loads, the
run a plot reads), with only `--training.steps` added to the trainer's commands. Trainer
ranks and the tools are forked from one process that imported torch once
(tests/launcher.py): `python -m titan_fold.run --nproc_per_node N` (or `torchrun
--nproc_per_node N -m titan_fold.train`) becomes N forked ranks with torchrun's environment
(the launcher itself, and its output on a failure, are tested by tests/test_run.py),
`NGPU=N python -m titan_fold.train ...` one process with NGPU set. A command
that resumes an earlier one's checkpoint trains 2 steps past it.

Not run here, by rule (`NOT_RUN`), each with its reason: the install lines (CI's .ci/run
makes the same install, then runs the suite), several nodes, full-size models under
torchrun (GPUs), commands with placeholders (N, FILE.toml, HF_FOLDER, /models/...), what
needs their output, and the output quoted in `<!-- gen -->` blocks (tests/test_docs.py
runs those and compares their output).
"""

import os
import re
import shlex
import subprocess
import sys
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
from helpers import forked

from titan_fold.run import split_args

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2  # per trainer command; one that resumes a checkpoint trains 2 more
PROGRAMS = re.compile(r"^(\$ )?([A-Z_]+=\S+ )*(torchrun|python3?) ")

# (pattern on the command, reason): the commands this test does not run
NOT_RUN = [
    (
        r"^python3? -m venv|^\. \.venv/bin/activate|^pip install",
        "installs: .ci/run makes this install, then runs the tests",
    ),
    (r"^python -m pytest", "the test suite itself (.ci/run)"),
    (r"--nnodes ([2-9]|\d\d)", "several nodes"),
    (
        r"^(?!.*--debug\.shrink)(.*\s)?(torchrun|python -m titan_fold\.run) .*--job\.config_file "
        r"(qwen3_30b_a3b|sft_qwen3_30b_a3b|qwen2|mixtral_8x22b\w*|deepseek_v3_(16b|671b))\.toml",
        "a full-size model: GPUs",
    ),
    (r"^python (bench/|-m bench (?!--help))", "GPU benchmark runs"),
    (
        r"^python -m bench\.report --write",
        "rewrites docs/benchmarks.md (tests/test_bench.py checks that it holds the report)",
    ),
    (
        r"outputs/(qwen3_30b_a3b|sft_qwen3_30b_a3b|qwen2|mixtral_8x22b\w*|deepseek_v3_(16b|671b))/",
        "needs the GPU run above",
    ),
    (
        r"--job\.config_file debug_moe\.toml --training\.steps 5( |$)",
        "docs/planning.md's memory measurements (CPU batches of up to 16K tokens): the same trainer "
        "command line runs in every other document",
    ),
    (
        r"pipeline_parallel_degree 2 .*selective_ac_option op",
        "this layout trains in tests/test_pipeline.py (pp2_edp2_1F1B_op_sac, against the one-rank run)",
    ),
    (
        r"/models/|\$[A-Za-z_]|\.\.\.|\[--|\b(N|FILE\.toml|FLAVOR|HOST|HF_FOLDER|HF_OUT|DCP_FOLDER|DENSE|DENSE_DCP)\b",
        "a placeholder to fill in",
    ),
]


def documents() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(docs) if f.endswith(".md"))


def _complete(text: str) -> bool:
    try:
        shlex.split(text)
    except ValueError:  # an open quote: a `python -c "` block goes on
        return False
    return not text.endswith("\\")


def commands(text: str) -> list[tuple[int, str, bool]]:
    """(line number, command as typed, inside a `<!-- gen -->` block) of every command of a
    markdown text; `a && b` gives a and b."""
    lines = text.split("\n")
    out, fenced, gen, i = [], False, False, 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            fenced, gen = not fenced, (not fenced and i > 0 and lines[i - 1].strip() == "<!-- gen -->")
            i += 1
            continue
        code = fenced or line.startswith("    ")
        text_ = line.strip()
        if code and PROGRAMS.match(text_):
            first = i
            command = text_.removeprefix("$ ")
            while not _complete(command) and i + 1 < len(lines):
                i += 1
                command = command.removesuffix("\\").rstrip() + " " if command.endswith("\\") else command + "\n"
                command += lines[i].strip()
            for part in re.split(r" && ", command):
                out.append((first + 1, part.strip(), gen))
        i += 1
    return out


def reason_not_run(command: str, gen: bool) -> str | None:
    if gen:
        return "output quoted in a <!-- gen --> block: tests/test_docs.py runs it and compares"
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command)), None)


def _option(args: list[str], key: str) -> str | None:
    for i, a in enumerate(args):
        if a == key and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(key + "="):
            return a.split("=", 1)[1]
    return None


def training_steps(args: list[str]) -> int:
    """STEPS, or STEPS past the checkpoint a trainer command with these arguments resumes."""
    if "--checkpoint.enable" not in args:
        return STEPS
    folder = _option(args, "--job.dump_folder")
    if folder is None:
        config = _option(args, "--job.config_file")
        path = config if os.path.exists(config) else os.path.join(ROOT, "titan_fold", "train_configs", config)
        with open(path, "rb") as f:
            folder = tomllib.load(f)["job"]["dump_folder"]
    checkpoints = os.path.join(folder, _option(args, "--checkpoint.folder") or "checkpoint")
    saved = [int(d[5:]) for d in os.listdir(checkpoints) if d[5:].isdigit()] if os.path.isdir(checkpoints) else []
    return max(saved, default=0) + STEPS


def run(command: str) -> tuple[int, str]:
    """One command as typed, in the current folder, with `--training.steps` added to a
    trainer's; -> exit code (the first failing rank's), output."""
    words = shlex.split(command, comments=True)
    env = {}
    while re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "torchrun" or words[:3] == ["python", "-m", "titan_fold.run"]:
        if words[0] == "torchrun":
            at = words.index("-m")
            options, module, args = words[1:at], words[at + 1], words[at + 2 :]
        else:
            (options, args), module = split_args(words[3:]), "titan_fold.train"
        nproc = int(_option(options, "--nproc_per_node") or _option(options, "--nproc-per-node") or 1)
        codes, out, err = forked(nproc, module, *args, "--training.steps", str(training_steps(args)), env=env)
    else:
        assert words[0] in ("python", "python3"), command
        if words[1] == "-c":
            codes, out, err = _python(words[1:], env)
        elif words[2] == "bench" or words[1].endswith(".py"):  # the repository's, not the package's: from the root
            codes, out, err = _python(words[1:], env, cwd=ROOT)
        else:
            assert words[1] == "-m", command
            extra = ["--training.steps", str(STEPS)] if words[2] == "titan_fold.train" else []
            codes, out, err = forked(0, words[2], *words[3:], *extra, env=env)
    code = next((c for c in codes if c != 0), 0)
    return code, out + err


def _python(args: list[str], env: dict, cwd: str | None = None) -> tuple[list[int], str, str]:
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, env=dict(os.environ, **env), cwd=cwd
    )
    return [result.returncode], result.stdout, result.stderr


def runnable(doc: str) -> bool:
    with open(os.path.join(ROOT, doc)) as f:
        return any(reason_not_run(c, gen) is None for _, c, gen in commands(f.read()))


# the documents with a command to run here (a test per document that has none would only skip)
@pytest.mark.parametrize("doc", [doc for doc in documents() if runnable(doc)])
def test_commands_run_as_written(doc, tmp_path, monkeypatch):
    with open(os.path.join(ROOT, doc)) as f:
        found = commands(f.read())
    todo = [(n, c) for n, c, gen in found if reason_not_run(c, gen) is None]
    for number, command, gen in found:
        if (why := reason_not_run(command, gen)) is not None and not gen:
            print(f"{doc}:{number}: not run ({why}): {command[:120]}")
    monkeypatch.chdir(tmp_path)
    for number, command in todo:
        start = time.monotonic()
        code, output = run(command)
        print(f"{doc}:{number}: {time.monotonic() - start:.1f} s, exit {code}: {command[:120]}")
        assert code == 0, f"{doc}:{number}: `{command}` exited {code}:\n{output[-4000:]}"
        if "--comm.mode fake_backend" in command and "--comm.dry_run_verbose" not in command:
            assert output.count("\n") <= 60, f"{doc}:{number}: the dry run printed {output.count(chr(10))} lines"
