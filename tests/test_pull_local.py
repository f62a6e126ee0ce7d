"""What ``pull`` / ``materialize`` does in the user's directory (issue 24, items 1, 9, 13 and
18's lock files): it replaces only a directory a pull made, names are names, a planted
symbolic link is never followed or adopted, and no lock file is left behind."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptstore
import ckptstore.adapters.localdir
import ckptstore.directory
from ckptstore import InvalidInputError
from ckptstore.adapters.directory import materialize, publish_directory
from ckptstore.adapters.localdir import locked
from ckptstore.cli import main as cli


def _files(seed: int) -> dict[str, bytes]:
    return {
        "config.json": b'{"step": %d}' % seed,
        "model.safetensors": bytes((seed + i) % 256 for i in range(50_000)),
        "sub/deep.txt": b"deep %d" % seed,
    }


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


class Remote:
    """A store with steps 1 and 2 published, as a URL for the CLI and a Store for the API."""

    def __init__(self, url: str, options: dict[str, object], scratch: Path) -> None:
        self.url = url
        self.store = ckptstore.open(url, **options)
        for step in (1, 2):
            source = scratch / f"published-{step}"
            _write(source, _files(step))
            publish_directory(self.store, step, source)

    def pull(self, *args: str) -> int:
        return cli(["pull", self.url, *args])


@pytest.fixture(params=["file", "s3"])
def remote(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Remote:  # fmt: skip
    scratch = tmp_path_factory.mktemp("remote")
    if request.param == "file":
        return Remote(f"file://{scratch}/store", {}, scratch)
    server = request.getfixturevalue("moto_s3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)  # the CLI's credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    url = server.url(f"pull-{os.getpid()}-{scratch.name}")
    return Remote(url, dict(server.options), scratch)


@pytest.fixture
def file_remote(tmp_path_factory: pytest.TempPathFactory) -> Remote:
    scratch = tmp_path_factory.mktemp("remote")
    return Remote(f"file://{scratch}/store", {}, scratch)


# -- item 1: replace only what a pull made -------------------------------------------------


def test_pull_replace_into_the_working_directory_is_refused_and_moves_nothing(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    project = tmp_path / "project"
    project.mkdir()
    (project / "thesis.tex").write_bytes(b"\\documentclass{book} four years of work")
    (project / "notes.txt").write_bytes(b"notes")
    before = _listing(tmp_path)
    monkeypatch.chdir(project)
    capsys.readouterr()
    assert remote.pull(".", "--replace") == 2
    err = capsys.readouterr().err
    assert "not made by ckptstore pull" in err and "move it away or remove it yourself" in err
    assert len(err.strip().splitlines()) == 1
    assert _tree(project) == {
        "thesis.tex": b"\\documentclass{book} four years of work", "notes.txt": b"notes",
    }  # fmt: skip
    assert _listing(tmp_path) == before  # nothing moved aside, no lock, no marker, no staging
    with pytest.raises(InvalidInputError, match="not made by ckptstore pull"):
        materialize(remote.store.get(2), project, replace=True)  # the API: likewise
    with pytest.raises(InvalidInputError, match="not made by ckptstore pull"):
        materialize(remote.store.get(2), ".", replace=True)
    assert _tree(project)["thesis.tex"].endswith(b"four years of work")
    assert _listing(tmp_path) == before


def test_a_directory_a_pull_made_is_replaced(
    remote: Remote, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "resume"
    assert remote.pull("1", str(target)) == 0
    assert _tree(target) == _files(1)
    assert remote.pull("2", str(target), "--replace") == 0  # the CLI
    assert _tree(target) == _files(2)
    assert _listing(tmp_path) == [".resume.ckptstore-pulled", "resume"]  # no lock, no old
    materialize(remote.store.get(1), target, replace=True)  # the API, again and again
    materialize(remote.store.get(1), target, replace=True)
    assert _tree(target) == _files(1)
    assert _listing(tmp_path) == [".resume.ckptstore-pulled", "resume"]


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d / "notes.txt").write_bytes(b"mine"),
        lambda d: (d / "sub" / "deep.txt").unlink(),
        lambda d: (d / "config.json").write_bytes(b"a longer config the user wrote"),
        lambda d: (d / "mine").mkdir(),
        lambda d: (d / "link").symlink_to("config.json"),
    ],
    ids=["added", "removed", "resized", "folder", "link"],
)
def test_a_pulled_directory_changed_since_is_not_replaced(
    file_remote: Remote, tmp_path: Path, change: Callable[[Path], object]
) -> None:
    target = tmp_path / "resume"
    materialize(file_remote.store.get(1), target)
    change(target)
    before = _tree(target)
    with pytest.raises(InvalidInputError, match="has changed since"):
        materialize(file_remote.store.get(2), target, replace=True)
    assert _tree(target) == before
    assert _listing(tmp_path) == [".resume.ckptstore-pulled", "resume"]


def test_files_written_into_the_target_during_the_pull_are_kept(
    file_remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out"
    materialize(file_remote.store.get(1), target)
    real = ckptstore.directory._materialize_file

    def user_writes_meanwhile(*args: object) -> None:
        (target / "notes.txt").write_bytes(b"written while the checkpoint downloaded")
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ckptstore.directory, "_materialize_file", user_writes_meanwhile)
    with pytest.raises(InvalidInputError, match="changed while the checkpoint was being written"):
        materialize(file_remote.store.get(2), target, replace=True, parallel=1)
    assert _tree(target) == {**_files(1), "notes.txt": b"written while the checkpoint downloaded"}
    assert _listing(tmp_path) == [".out.ckptstore-pulled", "out"]


def test_a_directory_without_a_marker_is_refused_with_the_way_out(
    file_remote: Remote, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory an older ckptstore pulled carries no marker: refused; removing it is the
    way out (documented in README.md's pull section)."""
    target = tmp_path / "resume"
    materialize(file_remote.store.get(1), target)
    (tmp_path / ".resume.ckptstore-pulled").unlink()  # as an older ckptstore left it
    capsys.readouterr()
    assert file_remote.pull("2", str(target), "--replace") == 2
    err = capsys.readouterr().err
    assert "an older ckptstore wrote none" in err and "remove it yourself" in err
    assert _tree(target) == _files(1)
    for path in sorted(target.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    target.rmdir()
    assert file_remote.pull("2", str(target), "--replace") == 0
    assert _tree(target) == _files(2)


def test_a_users_directory_made_where_a_pulled_one_was_is_refused(
    file_remote: Remote, tmp_path: Path
) -> None:
    target = tmp_path / "resume"
    materialize(file_remote.store.get(1), target)
    for path in sorted(target.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    target.rmdir()
    target.mkdir()  # the user's own now (the file system may even reuse the inode)
    (target / "thesis.tex").write_bytes(b"mine")
    with pytest.raises(InvalidInputError, match=r"(not made by|changed since)"):
        materialize(file_remote.store.get(2), target, replace=True)
    assert _tree(target) == {"thesis.tex": b"mine"}


def test_a_kill_after_the_swap_leaves_the_old_directory_to_the_next_pull(
    file_remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out"
    materialize(file_remote.store.get(1), target)

    def killed(path: Path) -> None:
        raise KeyboardInterrupt  # the process dies right after the new directory went in

    with monkeypatch.context() as patch:
        patch.setattr(ckptstore.adapters.localdir, "_remove", killed)
        with pytest.raises(KeyboardInterrupt):
            materialize(file_remote.store.get(2), target, replace=True)
    assert _tree(target) == _files(2)
    (aside,) = [p for p in tmp_path.iterdir() if ".ckptstore-old-" in p.name]
    assert _tree(aside) == _files(1)
    materialize(file_remote.store.get(1), target, replace=True)  # still a pull's: replaced
    assert _tree(target) == _files(1)
    assert _listing(tmp_path) == [".out.ckptstore-pulled", "out"]  # the old one removed


def test_a_damaged_marker_names_nothing(file_remote: Remote, tmp_path: Path) -> None:
    target = tmp_path / "resume"
    materialize(file_remote.store.get(1), target)
    marker = tmp_path / ".resume.ckptstore-pulled"
    for damage in (b"[" * 5000, b'{"format": "ckptstore-pulled-1"}', b"x" * 70_000):
        marker.write_bytes(damage)
        with pytest.raises(InvalidInputError, match="not made by ckptstore pull"):
            materialize(file_remote.store.get(2), target, replace=True)
        assert _tree(target) == _files(1)


def test_names_that_are_not_a_directory_of_their_own_are_refused(
    file_remote: Remote, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    for name in ["a/..", ".x.ckptstore-lock", ".a.ckptstore-0123456789ab"]:
        with pytest.raises(InvalidInputError, match=r"(name the directory|ckptstore's own)"):
            materialize(file_remote.store.get(1), tmp_path / name, replace=True)
    assert _listing(tmp_path) == ["a"]


# -- item 9: names are names -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["run?", "run*", "[ab]", "[r]un1", "run1*"])
def test_a_target_named_like_a_pattern_touches_nothing_of_another(
    remote: Remote, tmp_path: Path, name: str
) -> None:
    """Pulling into ``run?`` used to delete run1's staging directory and rename run1's old
    directory into ``run?``."""
    run1 = tmp_path / "run1"
    materialize(remote.store.get(1), run1)
    os.mkdir(tmp_path / ".run1.ckptstore-0123456789ab")  # run1's own pull, in progress
    (tmp_path / ".run1.ckptstore-0123456789ab" / "half").write_bytes(b"half")
    os.rename(run1, tmp_path / ".run1.ckptstore-old-0123456789ab")  # run1, mid-swap
    for other in ("a", "b", "r"):
        materialize(remote.store.get(1), tmp_path / other)
        os.mkdir(tmp_path / f".{other}.ckptstore-0123456789ab")
    before = {p.name: p.stat().st_ino for p in tmp_path.iterdir()}
    assert remote.pull("2", str(tmp_path / name)) == 0
    assert remote.pull("1", str(tmp_path / name), "--replace") == 0
    assert _tree(tmp_path / name) == _files(1)
    after = {p.name: p.stat().st_ino for p in tmp_path.iterdir()}
    assert {entry: after.get(entry) for entry in before} == before  # all there, untouched
    assert set(after) - set(before) == {name, f".{name}.ckptstore-pulled"}
    assert not run1.exists()  # still aside, for run1's next pull to put back
    materialize(remote.store.get(2), run1, replace=True)
    assert _tree(run1) == _files(2)
    assert not (tmp_path / ".run1.ckptstore-0123456789ab").exists()  # its own: cleared


# -- item 13: planted symbolic links -------------------------------------------------------


def test_a_planted_lock_file_symlink_is_not_followed(
    file_remote: Remote, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    lock = work / ".out.ckptstore-lock"
    lock.symlink_to(elsewhere / "created-by-a-follower")
    with pytest.raises(InvalidInputError, match="is a symbolic link"):
        materialize(file_remote.store.get(1), work / "out")
    capsys.readouterr()
    assert file_remote.pull(str(work / "out")) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert _listing(elsewhere) == []  # nothing created where it points
    assert _listing(work) == [".out.ckptstore-lock"] and lock.is_symlink()
    victim = elsewhere / "victim"
    victim.write_bytes(b"precious")
    lock.unlink()
    lock.symlink_to(victim)  # pointing at an existing file: neither opened nor removed
    with pytest.raises(InvalidInputError, match="is a symbolic link"):
        materialize(file_remote.store.get(1), work / "out")
    assert victim.read_bytes() == b"precious" and lock.is_symlink()


def test_a_planted_lock_file_that_is_not_a_file_is_refused(
    file_remote: Remote, tmp_path: Path
) -> None:
    os.mkfifo(tmp_path / ".out.ckptstore-lock")
    with pytest.raises(InvalidInputError, match="not a regular file"):
        materialize(file_remote.store.get(1), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_planted_aside_symlink_is_not_adopted(
    remote: Remote, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    work = tmp_path / "work"
    work.mkdir()
    planted = work / ".out.ckptstore-old-0123456789ab"
    planted.symlink_to(outside)
    capsys.readouterr()
    assert remote.pull(str(work / "out")) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="is a symbolic link"):
        materialize(remote.store.get(1), work / "out")
    assert not os.path.lexists(work / "out")  # the target never points outside
    assert planted.is_symlink() and _tree(outside) == {"secret": b"s"}
    assert _listing(work) == [planted.name]


@pytest.mark.parametrize(
    "planted", [".out.ckptstore-0123456789ab", ".out.ckptstore-pulled-0123456789ab",
                ".out.ckptstore-pulled"],
)  # fmt: skip
def test_other_planted_symlinks_are_errors(
    file_remote: Remote, tmp_path: Path, planted: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    work = tmp_path / "work"
    work.mkdir()
    materialize(file_remote.store.get(1), work / "out")
    (work / planted).unlink(missing_ok=True)
    (work / planted).symlink_to(outside)
    with pytest.raises(InvalidInputError, match="is a symbolic link"):
        materialize(file_remote.store.get(2), work / "out", replace=True)
    assert _tree(work / "out") == _files(1)
    assert _tree(outside) == {"secret": b"s"} and (work / planted).is_symlink()


def test_an_unmarked_aside_directory_is_left_alone(file_remote: Remote, tmp_path: Path) -> None:
    aside = tmp_path / ".out.ckptstore-old-0123456789ab"  # named like ours, not ours
    aside.mkdir()
    (aside / "mine.bin").write_bytes(b"the user's")
    target = materialize(file_remote.store.get(1), tmp_path / "out")
    assert _tree(target) == _files(1)  # not adopted as the target
    assert _tree(aside) == {"mine.bin": b"the user's"}  # nor deleted


@pytest.mark.parametrize("points_to", ["user", "pulled"])
def test_a_target_that_is_a_symlink_is_not_replaced(
    remote: Remote, tmp_path: Path, points_to: str, capsys: pytest.CaptureFixture[str]
) -> None:
    real = tmp_path / "real"
    if points_to == "user":
        real.mkdir()
        (real / "thesis.tex").write_bytes(b"mine")
    else:
        materialize(remote.store.get(1), real)
    before = _tree(real)
    link = tmp_path / "out"
    link.symlink_to(real)
    capsys.readouterr()
    assert remote.pull("2", str(link), "--replace") == 2
    assert "is a symbolic link" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="is a symbolic link"):
        materialize(remote.store.get(2), link, replace=True)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert _tree(real) == before


# -- item 18: no lock file left; the lock still excludes -------------------------------------


def test_no_lock_file_is_left_after_success_or_failure(
    remote: Remote, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out"
    assert remote.pull("1", str(target)) == 0
    assert _listing(tmp_path) == [".out.ckptstore-pulled", "out"]
    assert remote.pull("2", str(target)) == 2  # exists
    with pytest.raises(InvalidInputError, match="already exists"):
        materialize(remote.store.get(2), target)
    (target / "notes.txt").write_bytes(b"mine")
    assert remote.pull("2", str(target), "--replace") == 2  # not as the pull left it
    with pytest.raises(InvalidInputError, match="changed since"):
        materialize(remote.store.get(2), target, replace=True)
    (target / "notes.txt").unlink()
    gone = remote.store.get(1)
    remote.store.delete(1)  # deleted while it is pulled: reading its shards fails midway
    with pytest.raises(ckptstore.CkptStoreError):
        materialize(gone, target, replace=True)
    assert _listing(tmp_path) == [".out.ckptstore-pulled", "out"]
    assert _tree(target) == _files(1)
    assert remote.pull("2", str(target), "--replace") == 0
    assert _listing(tmp_path) == [".out.ckptstore-pulled", "out"]


def _waiting_on(path: Path) -> int:
    """How many flock waiters /proc/locks shows on the file ``path`` names now."""
    try:
        inode = os.lstat(path).st_ino
    except FileNotFoundError:
        return 0
    text = Path("/proc/locks").read_text()
    return len(re.findall(rf"^\d+: -> FLOCK .*:{inode} ", text, re.MULTILINE))


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")
def test_the_lock_still_excludes_when_its_file_is_removed(tmp_path: Path) -> None:
    """B waits on the lock file A holds; A removes it and unlocks; B must not then hold a
    lock on a removed file while C creates a new one and holds that too."""
    target = tmp_path / "out"
    lock = tmp_path / ".out.ckptstore-lock"
    holding: list[str] = []
    entered = {name: threading.Event() for name in "BC"}
    leave = {name: threading.Event() for name in "BC"}

    def hold(name: str) -> None:
        with locked(target):
            holding.append(name)
            entered[name].set()
            leave[name].wait(30)
            holding.remove(name)

    a = locked(target)
    a.__enter__()
    b = threading.Thread(target=hold, args=("B",))
    b.start()
    _until(lambda: _waiting_on(lock) == 1, "B to wait on A's lock file")
    a.__exit__(None, None, None)
    _until(entered["B"].is_set, "B to hold the lock")
    c = threading.Thread(target=hold, args=("C",))
    c.start()
    _until(lambda: entered["C"].is_set() or _waiting_on(lock) == 1, "C to wait or enter")
    assert holding == ["B"]  # C waits: B holds the file the name leads to
    leave["B"].set()
    _until(entered["C"].is_set, "C to hold the lock")
    assert holding == ["C"]
    leave["C"].set()
    b.join()
    c.join()
    assert not lock.exists()


def test_concurrent_pulls_of_one_target_take_turns(file_remote: Remote, tmp_path: Path) -> None:
    target = tmp_path / "out"
    errors: list[BaseException] = []

    def pull(step: int) -> None:
        try:
            for _ in range(5):
                with pytest.raises(InvalidInputError, match="already exists"):
                    materialize(file_remote.store.get(step), target)
                materialize(file_remote.store.get(step), target, replace=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    materialize(file_remote.store.get(1), target)
    threads = [threading.Thread(target=pull, args=(1 + i % 2,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert _tree(target) in (_files(1), _files(2))
    assert _listing(tmp_path) == [".out.ckptstore-pulled", "out"]
