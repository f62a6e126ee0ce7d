"""The command line used as a hostile user would (issue 11, items 15-18): strays and deletions
during a listing, absurd numbers, --json on every outcome, names that would break a terminal."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os

import pytest

import ckptstore
import ckptstore.errors
from ckptstore.cli import main, parse_duration
from ckptstore.errors import InvalidShardNameError
from ckptstore.manifest import Manifest
from ckptstore.names import check_shard_name
from ckptstore.store import Store

HOSTILE_NAMES = ["a\x85b", "a\u202eb", "a\u2028b", "a\u2029b", "a\u200bb", "a\ufeffb", "a\x9bb"]
RAW_HOSTILE = ("\x85", "\u202e", "\u2028", "\x1b", "\x9b")


@pytest.fixture
def made(tmp_path):
    url = f"file://{tmp_path}/run"
    store = ckptstore.open(url)
    for step in (100, 200, 300):
        store.save(step, {"model.bin": bytes([step % 256]) * 3000}, {"step": step})
    return url, store, tmp_path / "run"


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("ckptstore: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- item 15: one entry cannot hide the others ----------------------------------------------


def make_strays(root) -> None:
    (root / f"step-{150:020d}").mkdir()  # an operator's mkdir, a copy without its manifest
    (root / f"step-{250:020d}").write_bytes(b"")  # a plain file named like a step


def test_ls_lists_every_checkpoint_and_marks_strays(made):
    url, _, root = made
    make_strays(root)
    status, text = run("ls", url)
    assert status == 0
    rows = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert list(rows) == ["100", "150", "200", "250", "300"]
    for step in ("100", "200", "300"):
        assert rows[step].endswith("ok")
    for step in ("150", "250"):
        assert rows[step].endswith("stray (not a checkpoint, left alone)")
    status, text = run("ls", url, "--json")
    statuses = {e["step"]: e["status"] for e in json.loads(text)["checkpoints"]}
    assert status == 0
    assert statuses == {100: "ok", 150: "stray", 200: "ok", 250: "stray", 300: "ok"}
    assert (root / f"step-{150:020d}").is_dir() and (root / f"step-{250:020d}").is_file()


def test_verify_all_checks_every_checkpoint_past_strays(made):
    url, _, root = made
    make_strays(root)
    status, text = run("verify", url, "--all")
    assert status == 0, text
    assert "step 150: stray (not a checkpoint, left alone)" in text
    assert "step 250: stray (not a checkpoint, left alone)" in text
    assert text.splitlines()[-1] == "3 ok, 0 broken, 2 stray"
    status, text = run("verify", url, "--all", "--json")
    assert status == 0
    statuses = [r["status"] for r in json.loads(text)["results"]]
    assert statuses == ["ok", "stray", "ok", "stray", "ok"]


def test_verify_of_the_latest_passes_over_a_newer_stray(made):
    url, _, root = made
    (root / f"step-{400:020d}").mkdir()
    status, text = run("verify", url)
    assert status == 0, text
    assert text.splitlines() == [
        "step 400: stray (not a checkpoint, left alone)",
        "step 300: ok (2.9 KiB checked)",
        "1 ok, 0 broken, 1 stray",
    ]
    for step in (100, 200, 300):
        ckptstore.open(url).delete(step, force=True)
    status, _ = run("verify", url)  # nothing but a stray: no checkpoint to verify
    assert status == 2


def test_a_damaged_manifest_is_reported_broken_among_the_rest(made):
    url, _, root = made
    (root / f"step-{200:020d}" / "manifest.json").write_bytes(b'{"truncated": ')
    status, text = run("ls", url)
    assert status == 0
    assert [line.split()[-1] for line in text.splitlines()[1:]][::2] == ["ok", "ok"]
    assert "BROKEN: " in text.splitlines()[2] and "not valid JSON" in text
    status, text = run("verify", url, "--all")
    assert status == 1 and "step 200: BROKEN" in text and "2 ok, 1 broken" in text


@pytest.fixture
def deleted_while_read(made, monkeypatch):
    """Step 200 is deleted (by another store, as an operator would) just as it is read."""
    url, _, _ = made
    operator = ckptstore.open(url)
    real_get = Store.get
    deleted = []

    def racing_get(self: Store, step: int):
        if step == 200 and not deleted:
            deleted.append(step)
            operator.delete(200)
        return real_get(self, step)

    monkeypatch.setattr(Store, "get", racing_get)
    return url, deleted


def test_ls_marks_a_checkpoint_deleted_during_the_listing(deleted_while_read):
    url, deleted = deleted_while_read
    status, text = run("ls", url)
    assert deleted == [200]
    assert status == 0
    rows = [line.split()[0] + " " + line.split()[-1] for line in text.splitlines()[1:]]
    assert rows[0] == "100 ok" and rows[2] == "300 ok"
    assert text.splitlines()[2].endswith("vanished (deleted while being read)")


def test_verify_all_marks_a_checkpoint_deleted_during_verification(deleted_while_read):
    url, deleted = deleted_while_read
    status, text = run("verify", url, "--all")
    assert deleted == [200]
    assert status == 0, text
    assert "step 200: vanished (deleted while being read)" in text
    assert text.splitlines()[-1] == "2 ok, 0 broken, 1 vanished"


def test_verify_marks_a_checkpoint_deleted_while_its_shards_are_read(made, monkeypatch):
    url, _, _ = made
    operator = ckptstore.open(url)
    real_get = Store.get

    def get_then_delete(self: Store, step: int):
        checkpoint = real_get(self, step)
        if step == 200:
            operator.delete(200)  # after the manifest was read, before any shard is
        return checkpoint

    monkeypatch.setattr(Store, "get", get_then_delete)
    status, text = run("verify", url, "--all")
    assert status == 0, text
    assert "step 200: vanished" in text and "BROKEN" not in text


# -- item 16: every number is validated, in one line ----------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "{url}", "--grace", "99999999999d"],
        ["gc", "{url}", "--grace", "9" * 400],
        ["gc", "{url}", "--grace", "-1"],
        ["gc", "{url}", "--grace", "1e5"],
        ["gc", "{url}", "--grace", "\u0661h"],  # an Arabic-Indic digit
        ["bench", "{url}", "--repeats", "0"],
        ["bench", "{url}", "--repeats=-1"],
        ["bench", "{url}", "--repeats", "9" * 5000],
        ["bench", "{url}", "--size", "0"],
        ["bench", "{url}", "--size=-1M"],
        ["bench", "{url}", "--size", "infM"],
        ["bench", "{url}", "--size", "1e9M"],
        ["bench", "{url}", "--size", "99999999999G"],
        ["bench", "{url}", "--busy", "-1"],
        ["bench", "{url}", "--busy", "65"],
        ["bench", "{url}", "--busy", "two"],
        ["show", "{url}", "-5"],
        ["show", "{url}", "1_00"],
        ["show", "{url}", "\u0661\u0660\u0660"],
        ["verify", "{url}", str(10**20)],
        ["verify", "{url}", "0" * 5000 + "1"],
        ["delete", "{url}", "x"],
        ["rollback", "{url}", "-1"],
        ["verify", "{url}", "100", "--all"],
        ["ls"],
        [],
        ["nosuch", "{url}"],
        ["ls", "{url}", "--bogus"],
        ["conformance", "--json-file", "/no/such/dir/report.json", "{url}"],
        ["conformance", "--junit", "", "{url}"],
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(made, capsys, argv):
    url, _, root = made
    before = sorted(os.listdir(root))
    status = main([a.format(url=url) for a in argv], io.StringIO())
    assert status == 2
    one_error_line(capsys)
    assert sorted(os.listdir(root)) == before  # nothing ran


@pytest.mark.parametrize("days", ["-1", "0", "99999999999999999999", "7.5", "\u0667"])
def test_lifecycle_days_are_checked_before_the_server_is_asked(capsys, monkeypatch, days):
    pytest.importorskip("boto3")
    import ckptstore.backends.s3_open as s3_open

    def must_not_run(*args, **kwargs):
        raise AssertionError(f"sent to the server: {args} {kwargs}")

    monkeypatch.setattr(s3_open, "install_abort_incomplete_uploads_rule", must_not_run)
    assert main(["lifecycle", "s3://bucket", "--days", days], io.StringIO()) == 2
    assert "--days" in one_error_line(capsys)


def test_durations_are_bounded():
    assert parse_duration("36500d").days == 36500
    assert parse_duration(" 5m ").total_seconds() == 300
    for text in ("36501d", "99999999999d", "9" * 400, "\u0661", "1 d 2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(text)


# -- item 17: with --json, every outcome is JSON on stdout ----------------------------------


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["ls", "{tmp}/nothing-here", "--json"], "StoreNotFoundError"),
        (["ls", "s3q://bucket", "--json"], "UnknownSchemeError"),
        (["show", "{url}", "999", "--json"], "CheckpointNotFoundError"),
        (["verify", "{url}", "999", "--json"], "CheckpointNotFoundError"),
        (["delete", "{url}", "300", "--json"], "RefusedError"),
        (["rollback", "{url}", "999", "--json"], "CheckpointNotFoundError"),
        (["gc", "{url}", "--grace", "99999999999d", "--json"], "InvalidInputError"),
        (["show", "{url}", "-1", "--json"], "InvalidInputError"),
        (["lifecycle", "{url}", "--json"], "InvalidURLError"),
        (["ls", "--json"], "InvalidInputError"),
        (["verify", "{url}", "--js", "--bogus"], "InvalidInputError"),
        (["conformance", "--json", "s3q://bucket"], "UnknownSchemeError"),
    ],
)
def test_json_errors_are_json_on_stdout(made, capsys, argv, kind):
    url, _, root = made
    status, text = run(*[a.format(url=url, tmp=root.parent) for a in argv])
    assert status == 2
    document = json.loads(text)
    assert set(document) == {"error", "type"}
    assert document["type"] == kind
    assert issubclass(getattr(ckptstore.errors, kind), ckptstore.errors.CkptStoreError)
    assert document["error"] in one_error_line(capsys)


def test_without_json_errors_leave_stdout_empty(made, capsys):
    url, _, _ = made
    assert run("show", url, "999") == (2, "")
    one_error_line(capsys)


# -- item 18: names that would break a terminal ---------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_shard_names_with_invisible_or_line_breaking_characters_are_refused(made, name):
    _, store, _ = made
    with pytest.raises(InvalidShardNameError, match="format"):
        check_shard_name(name)
    pending = store.begin(400)
    with pytest.raises(InvalidShardNameError):
        pending.write(name, b"x")
    pending.abort()
    assert store.steps() == [100, 200, 300]
    assert check_shard_name(name, stored=True) == name  # a manifest that holds one stays readable


def tamper(root, step: int) -> None:
    """Rewrite step's manifest as a hostile writer would: valid checksum, hostile strings."""
    path = root / f"step-{step:020d}" / "manifest.json"
    manifest = Manifest.decode(path.read_bytes(), where=str(path), expected_step=step)
    data = root / f"step-{step:020d}" / "data"
    shards = []
    for record, name in zip(manifest.shards * 3, ["a\u202eb", "x\x85y", "l\u2028m"], strict=True):
        if not (data / name).exists():
            (data / name).write_bytes((data / record.name).read_bytes())
        shards.append(dataclasses.replace(record, name=name, locator={"path": f"data/{name}"}))
    hostile = dataclasses.replace(
        manifest,
        shards=tuple(shards),
        writer=dataclasses.replace(manifest.writer, host="evil\x1b[2J\u202ehost"),
        backend="posix-rename\x9b",
        timings={"write_s\n": 1.0},
    )
    path.write_bytes(hostile.encode())


def test_stored_hostile_names_are_printed_escaped(made):
    url, _, root = made
    tamper(root, 300)
    status, text = run("show", url)
    assert status == 0
    assert not any(ch in text for ch in RAW_HOSTILE)
    for escaped in ("a\\u202eb", "x\\x85y", "l\\u2028m", "evil\\x1b[2J\\u202ehost", "\\x9b"):
        assert escaped in text
    assert "write_s\\n 1.000" in text
    assert len(text.splitlines()) == 9 + 1 + 1 + 3  # header, blank line, table head, 3 shards
    status, text = run("show", url, "--json")
    assert status == 0 and text.isascii()
    assert [s["name"] for s in json.loads(text)["shards"]] == ["a\u202eb", "x\x85y", "l\u2028m"]
    status, text = run("verify", url)
    assert (status, text.splitlines()[-1]) == (0, "1 ok, 0 broken")
    status, text = run("ls", url)
    assert status == 0 and text.splitlines()[-1].startswith("300 ")


def test_hostile_characters_in_errors_are_escaped(made, capsys):
    _, _, root = made
    status, text = run("ls", f"{root.parent}/no\u202esuch\nplace")
    assert (status, text) == (2, "")
    err = one_error_line(capsys)
    # The store's file:// URL percent-encodes the newline (so that it opens the store again,
    # issue 24 item 18); what a terminal would act on is escaped.
    assert "no\\u202esuch%0Aplace" in err and "\u202e" not in err and "\n" not in err[:-1]
