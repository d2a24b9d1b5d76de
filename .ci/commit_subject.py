"""The commit-msg hook (.pre-commit-config.yaml): a commit's subject line is at most 72 characters.

python .ci/commit_subject.py MESSAGE_FILE
"""

import sys

LIMIT = 72


def main(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if not line.startswith("#")]
    subject = lines[0] if lines else ""
    if not subject.strip():
        print("commit message: the subject line is empty")
        return 1
    if len(subject) > LIMIT:
        print(f"commit message: the subject has {len(subject)} characters, at most {LIMIT}: {subject!r}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
