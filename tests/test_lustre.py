"""The Lustre backend: bindings tested against a stand-in liblustreapi compiled here."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore import StorageError
from ckptstore.backends import lustre
from ckptstore.backends.lustre import LustreStripingWarning
from ckptstore.backends.lustreapi import LAYOUT_DEFAULT, LAYOUT_WIDE
from ckptstore.backends.posix import PosixDriver
from ckptstore.conformance.mixins import ConformanceTests

SOURCE = Path(__file__).parent / "lustre_standin" / "standin.c"
O_EXCL_CREATE_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _compile(directory: Path, name: str, *flags: str) -> str:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.fail("a C compiler (gcc) is needed to build the liblustreapi stand-in")
    output = directory / name
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", *flags, "-o", str(output),
         str(SOURCE)],
        check=True,
    )  # fmt: skip
    return str(output)


@pytest.fixture(scope="session")
def standin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A liblustreapi.so with the layout API that records its calls."""
    return _compile(tmp_path_factory.mktemp("lustreapi"), "liblustreapi.so")


@pytest.fixture(scope="session")
def legacy_standin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A liblustreapi.so of an old release: llapi_file_create only."""
    return _compile(tmp_path_factory.mktemp("lustreapi-legacy"), "liblustreapi.so", "-DLEGACY_ONLY")


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    lustre._warned.clear()
    yield
    lustre._warned.clear()


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("LUSTREAPI_STANDIN_LOG", str(log))

    def read() -> list[list[str]]:
        if not log.exists():
            return []
        return [line.split() for line in log.read_text().splitlines()]

    return read


def _open(url: str, **options: Any) -> ckptstore.Store:
    with pytest.warns(LustreStripingWarning, match="not on a Lustre file system"):
        return ckptstore.open(url, **options)


def test_layouts_below_and_above_the_threshold(tmp_path: Path, standin: str, calls: Any) -> None:
    store = _open(
        f"lustre://{tmp_path}/store?wide_threshold=4096&stripe_size=1048576&pool=flash",
        lustreapi=standin,
    )
    with store.begin(1) as pending:
        pending.write("small.json", b"{}")
        pending.write("model/big.bin", b"x" * 5000)
        with pending.open_shard("streamed.bin") as shard:
            shard.write(b"y" * 10)
    creates = [c for c in calls() if c[0] == "llapi_layout_file_create"]
    by_name = {Path(c[1]).name: c for c in creates}
    assert by_name["small.json"][4:] == [str(LAYOUT_DEFAULT), str(LAYOUT_DEFAULT)]
    assert by_name["big.bin"][4:] == [str(LAYOUT_WIDE), "1048576"]
    assert by_name["streamed.bin"][4:] == [str(LAYOUT_WIDE), "1048576"]  # size unknown: wide
    for call in creates:
        assert int(call[2]) == O_EXCL_CREATE_WRITE
        assert call[3] == "644"
        assert ".pending-" in call[1]  # created in the staging directory, never in place
    names = [c[0] for c in calls()]
    assert names.count("llapi_layout_alloc") == names.count("llapi_layout_free") == 3
    assert ["llapi_layout_pool_name_set", "flash"] in calls()
    assert store.latest().read("model/big.bin") == b"x" * 5000


def test_explicit_stripe_count(tmp_path: Path, standin: str, calls: Any) -> None:
    store = _open(f"lustre://{tmp_path}/s?stripe_count=8&wide_threshold=0", lustreapi=standin)
    store.save(1, {"a": b"1"})
    assert ["llapi_layout_stripe_count_set", "8"] in calls()


def test_library_from_the_environment(
    tmp_path: Path, standin: str, calls: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTSTORE_LUSTREAPI", standin)
    _open(f"lustre://{tmp_path}/s?wide_threshold=0").save(1, {"a": b"1"})
    assert any(c[0] == "llapi_layout_file_create" for c in calls())


@pytest.mark.parametrize(
    ("failing", "message"),
    [
        ("llapi_layout_stripe_count_set:22", "llapi_layout_stripe_count_set.*Invalid argument"),
        ("llapi_layout_file_create:28", "llapi_layout_file_create.*No space left"),
    ],
)
def test_negative_returns_become_clear_errors(
    tmp_path: Path,
    standin: str,
    calls: Any,
    monkeypatch: pytest.MonkeyPatch,
    failing: str,
    message: str,
) -> None:
    monkeypatch.setenv("LUSTREAPI_STANDIN_FAIL", failing)
    store = _open(f"lustre://{tmp_path}/s?wide_threshold=0", lustreapi=standin)
    with pytest.raises(StorageError, match=message):
        store.save(1, {"a": b"1"})
    assert store.steps() == []
    names = [c[0] for c in calls()]
    assert names.count("llapi_layout_alloc") == names.count("llapi_layout_free")


def test_legacy_api(tmp_path: Path, legacy_standin: str, calls: Any) -> None:
    store = _open(f"lustre://{tmp_path}/s?wide_threshold=100", lustreapi=legacy_standin)
    store.save(1, {"big": b"z" * 200, "small": b"z"})
    creates = {Path(c[1]).name: c[2:] for c in calls() if c[0] == "llapi_file_create"}
    assert creates["big"] == [str(16 * 1024 * 1024), "-1", "-1", "1"]  # all OSTs, RAID0
    assert creates["small"] == ["0", "-1", "0", "1"]  # the defaults
    assert store.latest().read("big") == b"z" * 200


def test_legacy_api_negative_errno(
    tmp_path: Path, legacy_standin: str, calls: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LUSTREAPI_STANDIN_FAIL", "llapi_file_create:122")
    store = _open(f"lustre://{tmp_path}/s", lustreapi=legacy_standin)
    with pytest.raises(StorageError, match=r"llapi_file_create.*quota"):
        store.save(1, {"a": b"1"})


def test_without_the_library_it_warns_once_and_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTSTORE_LUSTREAPI", raising=False)
    monkeypatch.setattr(lustre, "load_lustreapi", lambda explicit=None: None)
    with pytest.warns(LustreStripingWarning) as caught:
        store = ckptstore.open(f"lustre://{tmp_path}/s")
    assert any("liblustreapi was not found" in str(w.message) for w in caught)
    store.save(1, {"a": b"1"})
    assert store.latest().read("a") == b"1"
    with pytest.warns(LustreStripingWarning) as again:
        ckptstore.open(f"lustre://{tmp_path}/t")
    assert not any("liblustreapi was not found" in str(w.message) for w in again)


def test_exdev_on_the_publishing_rename_is_a_clear_error(
    tmp_path: Path, standin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(f"lustre://{tmp_path}/s", lustreapi=standin)
    store.save(1, {"a": b"1"})
    original = PosixDriver._try_renameat2

    def cross_mdt(self: PosixDriver, source: str, target: str) -> bool:
        if os.path.basename(target).startswith("step-") and ".pending-" in source:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), source, None, target)
        return original(self, source, target)

    monkeypatch.setattr(PosixDriver, "_try_renameat2", cross_mdt)
    with pytest.raises(StorageError, match="not striped") as caught:
        store.save(2, {"a": b"2"})
    assert caught.value.errno == errno.EXDEV
    assert store.steps() == [1]
    assert store.latest().read("a") == b"1"
    assert not (tmp_path / "s" / f"step-{2:020d}").exists()


@pytest.mark.filterwarnings("ignore::ckptstore.backends.lustre.LustreStripingWarning")
class TestLustreConformance(ConformanceTests):
    @pytest.fixture
    def ckpt_url(self, tmp_path: Path, standin: str) -> str:
        return f"lustre://{tmp_path}/conformance?lustreapi={standin}&wide_threshold=2048"
