"""``.ci/commit_messages.py``: the shape CI requires of every commit message after the rule began."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("commit_messages", REPO / ".ci" / "commit_messages.py")
assert _spec is not None and _spec.loader is not None
commit_messages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(commit_messages)


def test_a_short_subject_and_a_body_after_a_blank_line_pass() -> None:
    assert commit_messages.problems("Fix the thing\n\nWhy, with figures.\n") == []
    assert commit_messages.problems("Fix the thing\n") == []


def test_a_paragraph_subject_or_a_body_glued_to_it_is_named() -> None:
    long = "x" * 73
    assert commit_messages.problems(long) == ["a subject of 73 characters (at most 72)"]
    assert commit_messages.problems("Fix\nmore on the next line") == [
        "no blank line between the subject and the body"
    ]
    assert commit_messages.problems("\n\nbody") == ["an empty subject"]


def test_the_check_runs_on_a_real_history(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "Good one")
    script = [sys.executable, str(REPO / ".ci" / "commit_messages.py"), base.strip()]
    assert subprocess.run(script, cwd=tmp_path).returncode == 0
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "y" * 80)
    bad = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 1 and "a subject of 80 characters" in bad.stdout
    missing = subprocess.run([*script[:2], "0" * 40], cwd=tmp_path, capture_output=True, text=True)
    assert missing.returncode == 0 and "not in this clone's history" in missing.stdout
