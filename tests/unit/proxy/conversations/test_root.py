"""The life of a states folder, one transition per test: made, held (by this process and by another
one, together), released, swept (only unheld, only after the grace period), lost, made again; and the
race between a sweeper and a new holder. The other holder is a real second process holding the lock."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.conversations.disk import StateDir, StateDirError
from proxy.conversations.root import LOCK_FILE, Hold, StateRoot
from proxy.source import SlotStates

IDENTITY = "1" * 64
OTHER = "2" * 64
DAY = 24 * 3600.0

Holder = Callable[[Path], "subprocess.Popen[str]"]

_HOLDER = """
import sys
from pathlib import Path
from proxy.conversations.root import Hold
hold = Hold.take(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.readline()
hold.release()
"""


@pytest.fixture
def other_process() -> Iterator[Holder]:
    """Start a real second process that holds a folder until the test ends (``hold(path)``)."""
    started: list[subprocess.Popen[str]] = []

    def hold(path: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[4],
        )
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _age(folder: Path, seconds: float) -> None:
    """Make the folder look last used ``seconds`` ago (its lock file too)."""
    then = time.time() - seconds
    for path in (folder / LOCK_FILE, folder):
        if path.exists():
            os.utime(path, (then, then))


def test_made_private_with_its_parents_and_its_lock_file(tmp_path: Path) -> None:
    root = StateRoot(tmp_path / "states" / "conversations")
    folder = root.folder("m", IDENTITY)
    assert folder.name == "m-" + "1" * 16 and root.alias_of(folder) == "m"
    hold = Hold.take(folder)
    for path in (folder, folder.parent, folder.parent.parent):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    assert (folder / LOCK_FILE).is_file() and hold.held and hold.intact()
    hold.release()


def test_a_link_or_another_kind_of_file_is_never_made_held_or_removed(tmp_path: Path) -> None:
    real = tmp_path / ("m-" + "3" * 16)
    real.mkdir()
    link = tmp_path / ("m-" + "1" * 16)
    link.symlink_to(real)
    with pytest.raises(StateDirError):
        Hold.take(link)
    file = tmp_path / ("m-" + "2" * 16)
    file.write_bytes(b"x")
    _age(real, 2 * DAY)
    assert StateRoot(tmp_path, grace_s=0).sweep("m", None) == [real]
    assert link.is_symlink() and file.is_file()


def test_held_by_another_process_survives_a_sweep_past_the_grace_period(
    tmp_path: Path, other_process: Holder
) -> None:
    root = StateRoot(tmp_path, grace_s=60)
    folder = root.folder("m", OTHER)
    proc = other_process(folder)
    (folder / "k.state").write_bytes(b"x" * 10)
    _age(folder, 2 * DAY)
    assert root.sweep("m", root.folder("m", IDENTITY)) == []
    assert (folder / "k.state").is_file()
    # Shared: this process holds the same folder at the same time (replicas of one identity).
    mine = Hold.take(folder)
    assert mine.intact()
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=10)
    _age(folder, 2 * DAY)
    assert root.remove(folder) is False and folder.is_dir()  # still ours
    mine.release()


def test_a_dead_holder_holds_nothing(tmp_path: Path, other_process: Holder) -> None:
    root = StateRoot(tmp_path, grace_s=60)
    folder = root.folder("m", OTHER)
    proc = other_process(folder)
    proc.kill()
    proc.wait(timeout=10)
    _age(folder, 2 * DAY)
    assert root.sweep("m", None) == [folder] and not folder.exists()


def test_released_the_grace_period_counts_from_the_last_use(tmp_path: Path) -> None:
    now = [time.time()]
    root = StateRoot(tmp_path, grace_s=3600, clock=lambda: now[0])
    folder = root.folder("m", OTHER)
    hold = Hold.take(folder)
    now[0] += 2 * 3600  # held for two hours without a touch: held all the same
    assert root.remove(folder) is False
    hold.release()  # its last use: now
    now[0] = time.time() + 3000  # 50 min after the release
    assert root.remove(folder) is False and folder.is_dir()
    (folder / "k.state").write_bytes(b"x")  # a save: the folder's own mtime is a use too
    _age(folder / LOCK_FILE, 0)
    now[0] = time.time() + 3700
    assert root.remove(folder) is True and not folder.exists()
    assert not [p for p in tmp_path.iterdir()]  # nothing left aside


def test_swept_only_the_models_other_identities_and_leftovers_of_a_removal(tmp_path: Path) -> None:
    root = StateRoot(tmp_path, grace_s=60)
    keep, old = root.folder("m", IDENTITY), root.folder("m", OTHER)
    other_model, short = root.folder("n", OTHER), tmp_path / "m-1"
    aside = tmp_path / ".removing-m-2222222222222222-abcd"
    for folder in (keep, old, other_model, short, aside):
        folder.mkdir()
        (folder / "x.state").write_bytes(b"x")
        _age(folder, 2 * DAY)
    assert root.sweep("m", keep) == [old]
    assert keep.is_dir() and not old.exists() and other_model.is_dir() and short.is_dir()
    assert not aside.exists()


def test_a_folder_never_held_keeps_its_grace_and_is_left_as_found(tmp_path: Path) -> None:
    root = StateRoot(tmp_path, grace_s=60)
    folder = root.folder("m", OTHER)
    folder.mkdir()
    _age(folder, 30)  # made by a daemon's prepare 30 s ago, its child not spawned yet
    before = os.lstat(folder).st_mtime_ns
    assert root.sweep("m", None) == []
    assert not (folder / LOCK_FILE).exists() and os.lstat(folder).st_mtime_ns == before
    _age(folder, 61)
    assert root.sweep("m", None) == [folder]


def test_lost_under_its_holder_then_made_again(tmp_path: Path) -> None:
    root = StateRoot(tmp_path)
    folder = root.folder("m", IDENTITY)
    hold = Hold.take(folder)
    (folder / "k.state").write_bytes(b"x")
    subprocess.run(["rm", "-rf", str(folder)], check=True)  # by hand
    assert hold.held and not hold.intact()
    folder.mkdir()  # even a folder of the same name made by someone else is not the one held
    (folder / LOCK_FILE).touch()
    assert not hold.intact()
    hold.release()
    again = Hold.take(folder)
    assert again.intact()
    assert not (folder / "k.state").exists()
    again.release()


def test_a_holder_that_waited_out_a_sweepers_rename_holds_a_fresh_folder(tmp_path: Path) -> None:
    folder = StateRoot(tmp_path).folder("m", IDENTITY)
    folder.mkdir(mode=0o700)
    (folder / "old.state").write_bytes(b"x")
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the sweeper decided: this folder goes
    held: list[Hold] = []
    taker = threading.Thread(target=lambda: held.append(Hold.take(folder)))
    taker.start()
    deadline = time.monotonic() + 10
    while not _waits_on_lock(folder) and time.monotonic() < deadline:  # the taker is in flock
        time.sleep(0.01)
    aside = tmp_path / ".removing-x"
    folder.rename(aside)
    os.close(fd)  # the sweeper lets go after its rename
    taker.join(timeout=10)
    assert held and held[0].intact() and folder.is_dir() and not (folder / "old.state").exists()
    held[0].release()


def _waits_on_lock(folder: Path) -> bool:
    """Some process waits for a lock on the folder's lock file (``/proc/locks`` lists waiters with ->)."""
    ino = os.lstat(folder / LOCK_FILE).st_ino
    try:
        locks = Path("/proc/locks").read_text()
    except OSError:
        return True
    return any("->" in line and line.split()[-3].endswith(f":{ino}") for line in locks.splitlines())


def test_the_held_count_is_the_indexs(tmp_path: Path) -> None:
    folder = tmp_path / "m-1"
    states = SlotStates(str(folder), "id-1", 1000)
    assert StateRoot.held(states) == (0, 0)  # missing: nothing held, nothing made
    assert not folder.exists()
    folder.mkdir(mode=0o700)
    (folder / "stray.bin").write_bytes(b"x" * 50)  # not a state the index knows: not counted
    assert StateRoot.held(states) == (0, 0)
    index = StateDir(states)
    (folder / "saving-1.state").write_bytes(b"x" * 30)
    index.commit("saving-1.state", "a" * 32, "t", 3)
    unfinished = folder / "saving-2.state"
    unfinished.write_bytes(b"x")
    then = time.time() - 2 * 3600
    os.utime(unfinished, (then, then))
    folder.chmod(0o750)
    assert StateRoot.held(states) == (1, 30) == (index.files, index.bytes)  # one count: the index's
    assert unfinished.exists() and stat.S_IMODE(os.lstat(folder).st_mode) == 0o750  # read only
