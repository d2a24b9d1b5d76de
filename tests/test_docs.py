"""Command output quoted in docs/ is what the tools print today (`python docs/gen.py` rewrites it); the
relative links of README.md and docs/ resolve; README.md stays short; docs/architecture.md names
every module."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import gen  # noqa: E402

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only


@pytest.mark.parametrize("doc", gen.DOCS)
def test_quoted_output_is_current(doc):
    # planning.md's 20 planner searches, each forked from one import of the planner (gen.fork_module)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "docs", "gen.py"), "--check", doc],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"{doc} quotes stale output; run `python docs/gen.py`:\n{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize(
    "doc, command",
    [
        ("README.md", "python -m titan_fold.common.packaged_configs --names"),
        ("docs/running.md", "python -m titan_fold.common.packaged_configs"),
    ],
)
def test_packaged_configs_are_listed_from_the_folder(doc, command):
    """The packaged-config lists quote the folder through a generated block (its output checked
    by test_quoted_output_is_current): a config added to titan_fold/train_configs/ is listed."""
    from titan_fold.common.packaged_configs import names

    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    assert doc in gen.DOCS and f"{gen.MARKER}\n```\n$ {command}\n" in text
    assert names() and all(name in text for name in names())


def test_generator_replaces_only_the_output():
    text = "\n".join(
        [
            "intro",
            gen.MARKER,
            "```",
            "$ echo one \\",
            "  two | tr a-z A-Z",
            "stale",
            "",
            "$ printf 'x\\ny\\n'",
            "old",
            "```",
            "```",
            "$ echo untouched",
            "kept",
            "```",
        ]
    )
    lines = gen.generate(text, workers=1).split("\n")
    assert lines == [
        "intro",
        gen.MARKER,
        "```",
        "$ echo one \\",
        "  two | tr a-z A-Z",
        "ONE TWO",
        "",
        "$ printf 'x\\ny\\n'",
        "x",
        "y",
        "```",
        "```",
        "$ echo untouched",
        "kept",
        "```",
    ]


def test_python_commands_are_forked_with_their_filter():
    assert gen.python_module("python -m titan_fold.plan --gpus 64 | grep -E '^( +1 |best)'") == (
        ["titan_fold.plan", "--gpus", "64"],
        " grep -E '^( +1 |best)'",
    )
    assert gen.python_module("python -m titan_fold.layout --world-size 8 \\\n  --tp 2") == (
        ["titan_fold.layout", "--world-size", "8", "--tp", "2"],
        "",
    )
    assert gen.python_module("python -m titan_fold.plan > out.txt") is None  # bash runs the rest
    assert gen.python_module("NGPU=8 python -m titan_fold.train") is None
    code, output = gen.fork_module(["titan_fold.plan", "--model", "57B-A14B", "--min-gpus", "cp=8", "ep=8"])
    assert code == 0 and "folded  cp=8 ep=8: 8 GPUs" in output, output


README_MAX_LINES = 160  # the user's path; reference material goes to docs/


def _markdown_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2, ...
    for repeats; `#` lines inside fenced code are not headings."""
    found, fenced = set(), False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"^#{1,6} +(.*?) *#* *$", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in found:
                n += 1
                anchor = f"{slug}-{n}"
            found.add(anchor)
    return found


def _links(text: str) -> list[str]:
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"^[a-z]+:", link)]


@pytest.mark.parametrize("doc", _markdown_files())
def test_relative_links_resolve(doc):
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    broken = []
    for link in _links(text):
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else os.path.join(ROOT, doc)
        if not os.path.exists(target):
            broken.append(f"{link}: no file {os.path.relpath(target, ROOT)}")
        elif anchor and target.endswith(".md"):
            with open(target) as f:
                if anchor not in _anchors(f.read()):
                    broken.append(f"{link}: no heading #{anchor} in {os.path.relpath(target, ROOT)}")
    assert not broken, f"{doc}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", _markdown_files())
def test_quoted_bench_records_exist(doc):
    """A bench record a page names (bench/results/NAME.json) is there: records are replaced by
    newer runs, and a page quoting a deleted one quotes figures nobody can check."""
    with open(os.path.join(ROOT, doc)) as f:
        named = set(re.findall(r"bench/results/[\w.@-]+\.json", f.read()))
    missing = sorted(path for path in named if not os.path.exists(os.path.join(ROOT, path)))
    assert not missing, f"{doc} names records that do not exist: {', '.join(missing)}"


def test_anchors_follow_github():
    assert _anchors(
        "# Quick start (CPU, no GPU)\n```\n# not a heading\n```\n## `[moe]`\n## metrics.jsonl\n## A\n## A"
    ) == {"quick-start-cpu-no-gpu", "moe", "metricsjsonl", "a", "a-1"}
    assert _links("see [x](docs/a.md#b), [y](https://e.org) and [z](#c)") == ["docs/a.md#b", "#c"]


def test_readme_stays_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material into docs/"


@pytest.mark.parametrize("doc", _markdown_files())
def test_code_fences_are_closed(doc):
    """An unclosed ``` turns the rest of a page into code (and hides its headings from links)."""
    with open(os.path.join(ROOT, doc)) as f:
        fences = [n for n, line in enumerate(f.read().split("\n"), 1) if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{doc}: the ``` on line {fences[-1]} is not closed"


def test_architecture_names_every_module():
    """A module added without its line in the package map fails here: each module's name is in
    its own folder's entry (the lines from `folder/` to the next folder), the top-level modules
    in the lines that follow the folders."""
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    tree = text[text.index("    titan_fold/\n") : text.index("    tests/")]
    entries, folder = {}, ""  # folder -> its entry's text
    for line in tree.split("\n")[1:]:
        head = re.match(r"      (\w+)/ ", line)
        if head:
            folder = head.group(1)
        elif re.match(r"      \w+\.py", line):
            folder = ""  # the top-level modules
        entries[folder] = entries.get(folder, "") + line + "\n"
    modules = sorted(
        os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "titan_fold"))
        for folder, _, names in os.walk(os.path.join(ROOT, "titan_fold"))
        for name in names
        if name.endswith(".py") and name != "__init__.py"
    )
    assert len(modules) > 100

    def named(module: str) -> bool:
        folder, name = os.path.split(module)
        return re.search(rf"(?<![\w.]){re.escape(name)}", entries.get(folder, "")) is not None

    assert [m for m in modules if not named(m)] == []
