"""The syscall-trace layer: the real driver's system calls, recorded with strace during the
standard workload, must make each durability call on the right file or directory and leave
no power-loss state that breaks an invariant; deliberately broken drivers are caught by the
invariant they endanger, and the real POSIX driver passes (the Lustre driver, which shares its
code, runs this layer in tests/test_lustre.py through the conformance mixin)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore.backends.posix import PosixDriver
from ckptstore.commit.rename import DATA_DIR, MANIFEST_NAME, RenameCommit, directories_of
from ckptstore.conformance import runner
from ckptstore.conformance.layers import syscall_trace
from ckptstore.conformance.layers.layer import SuiteRun, TargetKind
from ckptstore.conformance.layers.syscall_trace import (
    SyscallTraceResult,
    run_syscall_trace,
)
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.report import BackendReport, render_text
from ckptstore.conformance.tracing import images
from ckptstore.conformance.tracing.images import ImageUnavailable, image_url, mounted_image
from ckptstore.conformance.tracing.strace import (
    TracerUnavailable,
    decode_string,
    parse_trace,
    split_args,
)
from ckptstore.manifest import Manifest
from ckptstore.names import step_token
from ckptstore.registry import register, unregister

# -- broken drivers: module level, so that the traced process can unpickle them -----------


class NoFsyncDriver(PosixDriver):
    """Broken: fsync returns at once, having asked the kernel nothing (a lying fsync)."""

    def fsync(self, handle: int) -> None:
        return None


class DirectoryFsyncDriver(PosixDriver):
    """Broken: fsync syncs the file's directory instead of the file."""

    def fsync(self, handle: int) -> None:
        path = self._paths[handle]
        self._fsync_path(self._abs(path.rpartition("/")[0]))


class OtherFileFsyncDriver(PosixDriver):
    """Broken: fsync syncs a freshly opened descriptor of another file."""

    def fsync(self, handle: int) -> None:
        fd = os.open(self._abs(".fsync-scratch"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class PlainRenameDriver(PosixDriver):
    """Broken: the no-replace rename checks, then renames with plain rename(2) (a race)."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        source, target = self._abs(src), self._abs(dst)
        with self._translate("rename", f"{src} -> {dst}"):
            if os.path.lexists(target):
                raise FileExistsError(errno.EEXIST, "exists", target)
            os.rename(source, target)


_libc_renameat2 = PosixDriver._renameat2


def _renameat2_refused(old_dir: int, old: bytes, new_dir: int, new: bytes, flags: int) -> int:
    """renameat2 as a kernel without RENAME_NOREPLACE answers it: EINVAL (the flags asked
    for are invalid together, so the real kernel refuses the call and changes nothing)."""
    assert _libc_renameat2 is not None
    return int(_libc_renameat2(old_dir, old, new_dir, new, flags | 2))  # | RENAME_EXCHANGE


class OldKernelDriver(PosixDriver):
    """Correct: a kernel that refuses renameat2's flag; the driver's documented fallback."""

    _renameat2 = staticmethod(_renameat2_refused)


class NoRootFsyncCommit(RenameCommit):
    """Broken in the strategy: the root is not fsynced after the publishing rename (only the
    power-loss states of the recorded trace can see this: no driver call is wrong)."""

    def publish(self, manifest: Manifest) -> None:
        staging = self.staging_dir(manifest.step, manifest.attempt)
        self._seal_files(manifest.step, manifest.attempt)
        handle = self.driver.create(f"{staging}/{MANIFEST_NAME}")
        self.driver.write(handle, manifest.encode())
        self.driver.fsync(handle)
        self.driver.close(handle)
        for directory in directories_of(manifest):
            self.driver.fsync_dir(f"{staging}/{DATA_DIR}/{directory}")
        self.driver.fsync_dir(f"{staging}/{DATA_DIR}")
        self.driver.fsync_dir(staging)
        self.driver.rename_noreplace(staging, step_token(manifest.step))


def _scheme(name: str, driver: type[PosixDriver], commit: type[RenameCommit] = RenameCommit) -> str:
    register(name, lambda url, options: commit(driver(url.path)), replace=True)
    return name


@pytest.fixture
def broken() -> Iterator[Any]:
    added: list[str] = []

    def add(name: str, driver: type[PosixDriver], commit: type[RenameCommit] = RenameCommit) -> str:
        added.append(_scheme(name, driver, commit))
        return name

    yield add
    for name in added:
        unregister(name)


def _trace(url: str) -> SyscallTraceResult:
    location = LocationFactory(url)()
    try:
        return run_syscall_trace(location)
    finally:
        location.destroy()


def _report(url: str) -> tuple[BackendReport, str]:
    report = BackendReport(url=url, strategy="posix-rename")
    runner.run_layer(
        report, "syscall trace", SuiteRun(LocationFactory(url), kind=TargetKind.FILE_SYSTEM)
    )
    return report, render_text([report])


# -- the real drivers pass -------------------------------------------------------------


def test_the_posix_driver_reaches_the_kernel_with_every_durability_call(tmp_path: Path) -> None:
    report, text = _report(f"file://{tmp_path}/store")
    assert report.ok, text
    assert {report.invariants[key].status for key in ("I1", "I2", "I5")} == {"held"}
    line = report.coverage["syscall trace"]
    found = re.fullmatch(
        r"(\d+) system calls recorded \((\d+) on the store\), (\d+) of (\d+) durability calls "
        r"matched, ([\d,]+) power-loss states from the trace checked at (\d+) instants",
        line,
    )  # no note: nothing unmodelled, no fallback
    assert found is not None, line
    recorded, on_store, matched, judged, states, cuts = (
        int(group.replace(",", "")) for group in found.groups()
    )
    assert matched == judged >= 20
    assert on_store < recorded and states > 100 and cuts >= judged


def test_the_documented_rename_fallback_is_accepted(tmp_path: Path, broken: Any) -> None:
    url = f"{broken('old-kernel', OldKernelDriver)}://{tmp_path}/store"
    result = _trace(url)
    assert result.failures == [], result.failures
    assert result.matched == result.durability_calls
    assert any("documented fallback" in note for note in result.notes), result.notes


# -- broken drivers are caught, by the invariant they endanger ----------------------------


def test_a_fsync_that_does_nothing_is_caught_as_i2(tmp_path: Path, broken: Any) -> None:
    report, text = _report(f"{broken('no-fsync', NoFsyncDriver)}://{tmp_path}/store")
    assert report.invariants["I2"].status == "violated"
    assert "no fsync or fdatasync system call reached the kernel" in text
    assert re.search(r"syscall trace: driver call #\d+ fsync\(4\): fsync of step-0{19}1\.", text)
    assert "/data/model/rank00000.bin: no fsync or fdatasync system call reached the kernel" in text
    assert "may be lost at a power loss after the strategy counted it durable" in text
    # ... and the power-loss states of the recorded trace lose the unsynced data
    assert report.invariants["I1"].status == "violated"
    assert "syscall trace: power loss before system call #" in text
    assert "shard 'model/rank00000.bin' has 0 bytes, manifest says 3000" in text


def test_a_fsync_of_the_directory_instead_of_the_file_is_caught_as_i2(
    tmp_path: Path, broken: Any
) -> None:
    report, text = _report(f"{broken('dir-fsync', DirectoryFsyncDriver)}://{tmp_path}/store")
    assert report.invariants["I2"].status == "violated"
    assert "the kernel was asked to sync fsync(" in text
    assert "(a directory)) instead" in text


def test_a_fsync_of_another_file_is_caught_as_i2(tmp_path: Path, broken: Any) -> None:
    report, text = _report(f"{broken('other-fsync', OtherFileFsyncDriver)}://{tmp_path}/store")
    assert report.invariants["I2"].status == "violated"
    assert "the kernel was asked to sync fsync(.fsync-scratch) instead" in text


def test_a_plain_rename_is_caught_as_i5(tmp_path: Path, broken: Any) -> None:
    report, text = _report(f"{broken('plain-rename', PlainRenameDriver)}://{tmp_path}/store")
    assert report.invariants["I5"].status == "violated"
    assert "driver call #" in text and "rename_noreplace(" in text
    assert "reached the kernel as rename(" in text
    assert "not as renameat2(RENAME_NOREPLACE)" in text
    assert report.invariants["I2"].status == "held"


def test_a_missing_root_fsync_is_caught_by_the_traced_power_loss_states(
    tmp_path: Path, broken: Any
) -> None:
    url = f"{broken('no-root-fsync', PosixDriver, NoRootFsyncCommit)}://{tmp_path}/store"
    result = _trace(url)
    assert result.matched == result.durability_calls  # every call the strategy made is right
    lost = [f for f in result.failures if f.invariant == "I2"]
    assert lost and lost[0].case.startswith("syscall trace: power loss before system call #")


# -- where it cannot run, it says why --------------------------------------------------


def test_without_strace_the_layer_is_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    report, _ = _report(f"file://{tmp_path}/store")
    assert report.coverage["syscall trace"] == (
        "skipped: strace is not installed (apt-get install strace)"
    )
    assert report.invariants["I2"].status == "not checked"


def test_an_image_type_without_its_mkfs_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = shutil.which
    monkeypatch.setattr(
        images.shutil, "which", lambda name: None if name == "mkfs.xfs" else real(name)
    )
    monkeypatch.setattr(images.os, "geteuid", lambda: 0)
    missing = pytest.raises(ImageUnavailable, match=r"^mkfs\.xfs is not installed$")
    with missing, mounted_image("xfs"):
        pass
    monkeypatch.setattr(images.os, "geteuid", lambda: 1000)
    with pytest.raises(ImageUnavailable, match="loop devices need root"), mounted_image("ext4"):
        pass


def test_the_thorough_profile_reports_each_image_or_why_it_was_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(syscall_trace, "run_syscall_trace", _no_tracer)
    report = BackendReport(url=f"file://{tmp_path}/store", strategy="posix-rename")
    said: list[str] = []
    run = SuiteRun(LocationFactory(report.url), "thorough", TargetKind.FILE_SYSTEM, say=said.append)
    runner.run_layer(report, "syscall trace", run)
    assert report.coverage == {
        "syscall trace": "skipped: no tracer in this test",
        "ext4 image": "skipped: loop devices need root",
        "xfs image": "skipped: loop devices need root",
        "btrfs image": "skipped: loop devices need root",
    }
    assert said[1:] == [
        f"file-system layers on {fs} (an image on a loop device)" for fs in ("ext4", "xfs", "btrfs")
    ]
    assert {result.status for result in report.invariants.values()} == {"not checked"}


def _no_tracer(location: Any, depth: int = 1) -> Any:
    raise TracerUnavailable("no tracer in this test")


def test_image_urls_keep_the_scheme_and_options() -> None:
    assert image_url("lustre:///a/b?stripe_count=2", "/mnt") == "lustre:///mnt/store?stripe_count=2"
    assert image_url("/plain/path", "/mnt") == "file:///mnt/store"


def test_the_trace_is_judged_on_an_ext4_image_where_the_machine_allows() -> None:
    try:
        with mounted_image("ext4") as mount_point:
            result = _trace(image_url("file:///x", mount_point))
    except ImageUnavailable as exc:
        pytest.skip(f"no ext4 image here: {exc}")
    assert result.failures == [], result.failures
    assert result.matched == result.durability_calls > 0


# -- the trace parser --------------------------------------------------------------------


def test_calls_interrupted_by_another_thread_are_joined_where_they_completed() -> None:
    trace = (
        '10 openat(AT_FDCWD, "\\x2f\\x61", O_RDONLY|O_DIRECTORY <unfinished ...>\n'
        "11 fsync(4)                          = 0\n"
        "10 <... openat resumed>)             = 3\n"
        '10 renameat2(AT_FDCWD, "\\x2f\\x61", AT_FDCWD, "\\x2f\\x62", RENAME_NOREPLACE)'
        " = -1 EEXIST (File exists)\n"
        "10 +++ exited with 0 +++\n"
    )
    calls = parse_trace(trace)
    assert [(c.tid, c.name) for c in calls] == [(11, "fsync"), (10, "openat"), (10, "renameat2")]
    assert calls[1].args == ("AT_FDCWD", '"\\x2f\\x61"', "O_RDONLY|O_DIRECTORY")
    assert calls[1].result == 3 and calls[1].ok
    assert calls[2].error == "EEXIST" and not calls[2].ok
    assert (
        str(calls[2]) == 'renameat2(AT_FDCWD, "/a", AT_FDCWD, "/b", RENAME_NOREPLACE) = -1 EEXIST'
    )


def test_arguments_split_outside_strings_and_structures() -> None:
    assert split_args('3, "\\x2c\\x22", {a=1, b=[2, 3]}, 4') == (
        "3", '"\\x2c\\x22"', "{a=1, b=[2, 3]}", "4",
    )  # fmt: skip
    assert decode_string('"\\x68\\x00\\xff"') == (b"h\x00\xff", False)
    assert decode_string('"\\x68"...') == (b"h", True)
    assert decode_string("NULL") is None
