"""Regenerate the command output quoted in docs/*.md: `python docs/gen.py [FILE.md ...]`.

A quoted run is a fenced code block right after a `<!-- gen -->` line. Its `$ ` lines (a
trailing backslash continues one onto the next line) are run with bash from the repository
root, `python` being this interpreter, and the lines after each, up to the next `$ ` line,
are replaced by what it prints (stdout and stderr). Anything bash accepts works, e.g.
`| grep -E '^(rank|best)'` to quote part of an output. `--check` rewrites nothing and exits 1
when a file would change (tests/test_docs.py runs it).
"""

import argparse
import difflib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["docs/layouts.md", "docs/moe.md", "docs/parallelize.md", "docs/planning.md"]
MARKER = "<!-- gen -->"


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


def run(command: str) -> str:
    """A `$ ...` line -> the block text: the command, then its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]), COLUMNS="200")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command[2:]], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1800)
    output = (result.stdout + result.stderr).rstrip("\n")
    if result.returncode not in (0, 2):  # 2: a UserError, quoted on purpose
        raise RuntimeError(f"{command!r} exited {result.returncode}:\n{output[-3000:]}")
    return command + ("\n" + output if output else "")


def generate(text: str, workers: int) -> str:
    lines = text.split("\n")
    spans = blocks(lines)
    todo = [c for first, end in spans for c in commands(lines[first:end])]
    with ThreadPoolExecutor(workers) as pool:
        results = dict(zip(todo, pool.map(run, todo)))
    for first, end in reversed(spans):
        quoted = "\n\n".join(results[c] for c in commands(lines[first:end]))
        lines[first:end] = quoted.split("\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", default=DOCS, help="markdown files, relative to the repository root")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 and show the files that differ")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    stale = []
    for name in args.files:
        path = os.path.join(ROOT, name)
        old = open(path).read()
        new = generate(old, args.workers)
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
