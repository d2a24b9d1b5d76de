"""Regenerate the command output quoted in README.md and docs/*.md, and titan_fold/train_help.txt:
`python docs/gen.py [FILE ...]`.

A quoted run is a fenced code block right after a `<!-- gen -->` line. Its `$ ` lines (a
trailing backslash continues one onto the next line) are run with bash from the repository
root, `python` being this interpreter, and the lines after each, up to the next `$ ` line,
are replaced by what it prints (stdout and stderr). Anything bash accepts works, e.g.
`| grep -E '^(rank|best)'` to quote part of an output. A `python -m MODULE ...` command (with
at most a `| FILTER` after it) runs in a child forked from this process, which imports MODULE
once, instead of a fresh interpreter (seconds of imports per command). `--check` rewrites nothing and exits 1
when a file would change (tests/test_docs.py runs it).
"""

import argparse
import difflib
import importlib
import os
import runpy
import shlex
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "README.md",
    "docs/configuration.md",
    "docs/dryrun.md",
    "docs/layouts.md",
    "docs/moe.md",
    "docs/parallelize.md",
    "docs/planning.md",
    "docs/running.md",
]
MARKER = "<!-- gen -->"
FORK_LOCK = threading.Lock()


def blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(first, end) line indices of the inside of each marked fenced block."""
    found = []
    for i, line in enumerate(lines):
        if line.strip() == MARKER:
            if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
                raise ValueError(f"line {i + 1}: {MARKER} must be followed by a ``` block")
            end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"line {i + 2}: the ``` block is not closed")
            found.append((i + 2, end))
    return found


def commands(inside: list[str]) -> list[str]:
    """The `$ ` command lines of a block, continuation lines joined back as typed."""
    out, i = [], 0
    while i < len(inside):
        if inside[i].startswith("$ "):
            command = [inside[i]]
            while command[-1].endswith("\\") and i + 1 < len(inside):
                i += 1
                command.append(inside[i])
            out.append("\n".join(command))
        i += 1
    return out


def python_module(command: str) -> tuple[list[str], str] | None:
    """`python -m MODULE ARGS [| FILTER]` -> ([MODULE, *ARGS], FILTER or ""); None for anything else."""
    lexer = shlex.shlex(command.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    ops = [i for i, w in enumerate(words) if w and set(w) <= set("|&;<>()")]
    head = words[: ops[0]] if ops else words
    if len(head) < 3 or head[:2] != ["python", "-m"] or (ops and words[ops[0]] != "|"):
        return None
    return head[2:], command.split("|", 1)[1] if ops else ""


def import_from_root() -> None:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # as PYTHONPATH for the commands bash runs


# command modules that import torch and the models inside main() only (their --help stays
# fast): the parent imports those once, and each forked command starts with them loaded
HEAVY = {"titan_fold.plan": ("titan_fold.planning.plan",), "titan_fold.layout": ("titan_fold.planning.layout",)}


def fork_module(argv: list[str]) -> tuple[int, str]:
    """`python -m MODULE ARGS` in a child forked from this process, which imported MODULE
    once (no interpreter start and torch import per command); -> exit code, stdout + stderr.
    Imports and forks take turns (FORK_LOCK): a child forked while another thread is importing
    a module would find that module's import lock held by a thread it lacks, and wait forever."""
    import_from_root()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with FORK_LOCK:
            for module in (argv[0], *HEAVY.get(argv[0], ())):
                importlib.import_module(module)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chdir(ROOT)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                os.environ["COLUMNS"] = "200"
                sys.argv = list(argv)
                sys.modules.pop(argv[0], None)  # run as __main__, as `-m` does
                runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        out.seek(0)
        err.seek(0)
        return code, out.read() + err.read()  # as bash's stdout, then stderr


def run(command: str) -> str:
    """A `$ ...` line -> the block text: the command, then its output."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
        COLUMNS="200",
    )
    module = python_module(command[2:])
    if module is not None:
        code, output = fork_module(module[0])
        if module[1] and code in (0, 2):
            result = subprocess.run(
                ["bash", "-o", "pipefail", "-c", module[1]],
                input=output,
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            code, output = result.returncode, result.stdout + result.stderr
    else:
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command[2:]],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        code, output = result.returncode, result.stdout + result.stderr
    output = output.rstrip("\n")
    if code not in (0, 2):  # 2: a UserError, quoted on purpose
        raise RuntimeError(f"{command!r} exited {code}:\n{output[-3000:]}")
    return command + ("\n" + output if output else "")


def train_help() -> str:
    """`python -m titan_fold.train --help`'s text, which the command prints without importing torch."""
    import_from_root()
    from titan_fold.train import job_config_help

    return job_config_help()


def train_keys() -> str:
    """The keys `python -m titan_fold.train` takes, which it checks without importing torch."""
    import_from_root()
    from titan_fold.train import job_config_keys

    return job_config_keys()


# files written whole by a function, relative to the repository root
WHOLE = {"titan_fold/train_help.txt": train_help, "titan_fold/train_keys.txt": train_keys}


def generate(text: str, workers: int) -> str:
    lines = text.split("\n")
    spans = blocks(lines)
    todo = [c for first, end in spans for c in commands(lines[first:end])]
    with ThreadPoolExecutor(workers) as pool:
        results = dict(zip(todo, pool.map(run, todo), strict=True))
    for first, end in reversed(spans):
        quoted = "\n\n".join(results[c] for c in commands(lines[first:end]))
        lines[first:end] = quoted.split("\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "files",
        nargs="*",
        default=DOCS + list(WHOLE),
        help="markdown files (or the files of WHOLE), relative to the repository root",
    )
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 and show the files that differ")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    stale = []
    for name in args.files:
        path = os.path.join(ROOT, name)
        old = open(path).read()
        new = WHOLE[name]() if name in WHOLE else generate(old, args.workers)
        if new != old:
            stale.append(name)
            if args.check:
                diff = difflib.unified_diff(old.split("\n"), new.split("\n"), name, "generated", lineterm="", n=1)
                print("\n".join(list(diff)[:60]))
            else:
                with open(path, "w") as f:
                    f.write(new)
    if stale:
        print(("out of date: " if args.check else "rewrote: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
