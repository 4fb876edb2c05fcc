"""Commit messages in git's shape (docs/contributing.md): a subject of at most 72 characters, and when
there is more, a blank line and then the body with the reasons and figures.

Checks every commit after ``BASE`` (the last commit before the rule: older subjects were paragraphs)
up to HEAD. A clone without ``BASE`` in its history (a shallow one) says so and checks nothing.
Usage: ``python3 .ci/commit_messages.py [BASE]``; exit 1 naming each commit out of shape.
"""

from __future__ import annotations

import subprocess
import sys

BASE = "c703594"
MAX_SUBJECT = 72


def problems(message: str) -> list[str]:
    """What is wrong with one commit message (empty: nothing)."""
    lines = message.rstrip("\n").split("\n")
    subject = lines[0]
    found = []
    if not subject.strip():
        found.append("an empty subject")
    if len(subject) > MAX_SUBJECT:
        found.append(f"a subject of {len(subject)} characters (at most {MAX_SUBJECT})")
    if len(lines) > 1 and lines[1].strip():
        found.append("no blank line between the subject and the body")
    return found


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def main(argv: list[str]) -> int:
    base = argv[1] if len(argv) > 1 else BASE
    if subprocess.run(["git", "cat-file", "-e", f"{base}^{{commit}}"], capture_output=True).returncode:
        print(f"commit messages: {base} is not in this clone's history (shallow?); not checked")
        return 0
    bad = 0
    for sha in _git("rev-list", "--no-merges", f"{base}..HEAD").split():
        message = _git("log", "-1", "--format=%B", sha)
        for problem in problems(message):
            print(f"commit {sha[:10]} ({message.splitlines()[0][:50]!r}): {problem}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
