"""The command line, used as a new user would: on a store made by the tests."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

import ckptstore
from ckptstore.cli import main, parse_duration


@pytest.fixture
def made(tmp_path):
    url = f"file://{tmp_path}/run"
    store = ckptstore.open(url)
    for step in (100, 200, 300):
        store.save(
            step,
            {"model/rank00000.bin": bytes([step % 256]) * 5000, "trainer.json": b"{}"},
            {"samples_read": step * 32},
        )
    return url, store, tmp_path


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


def test_ls_shows_a_table(made):
    url, _, _ = made
    status, text = run("ls", url)
    assert status == 0
    lines = text.splitlines()
    assert lines[0].split() == ["STEP", "COMMITTED", "(UTC)", "SIZE", "SHARDS", "STATUS"]
    assert [line.split()[0] for line in lines[1:]] == ["100", "200", "300"]
    assert "4.9 KiB" in lines[1] and lines[1].endswith("ok")


def test_ls_json(made):
    url, _, _ = made
    _status, text = run("ls", url, "--json")
    document = json.loads(text)
    assert [c["step"] for c in document["checkpoints"]] == [100, 200, 300]
    assert document["checkpoints"][0]["shards"] == 2


def test_show_latest_and_a_step(made):
    url, _, _ = made
    status, text = run("show", url)
    assert status == 0
    assert "step 300" in text and '"samples_read": 9600' in text and "model/rank00000.bin" in text
    status, text = run("show", url, "100", "--json")
    assert json.loads(text)["step"] == 100


def test_verify_reports_a_broken_checkpoint_with_exit_1(made):
    url, _, tmp_path = made
    status, text = run("verify", url, "--all")
    assert status == 0 and "3 ok, 0 broken" in text
    path = tmp_path / "run" / f"step-{200:020d}" / "data" / "model" / "rank00000.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    status, text = run("verify", url, "--all")
    assert status == 1
    assert "step 200: BROKEN" in text and "CRC32C mismatch" in text and "2 ok, 1 broken" in text
    status, text = run("verify", url, "200", "--json")
    assert status == 1 and json.loads(text)["results"][0]["status"] == "broken"
    assert run("verify", url)[0] == 0  # the latest (300) is fine


def test_gc_dry_run_and_real(made):
    url, store, tmp_path = made
    dead = store.begin(400)
    dead.write("model/rank00000.bin", b"x" * 1000)
    status, text = run("gc", url)
    assert status == 0 and "kept staging" in text and "removed 0 leftover(s)" in text
    old = time.time() - 7200
    staging = next(p for p in (tmp_path / "run").iterdir() if ".pending-" in p.name)
    for directory, _, files in os.walk(staging):
        for name in [*files, "."]:
            os.utime(os.path.join(directory, name), (old, old))
    status, text = run("gc", url, "--dry-run")
    assert "would remove staging" in text and staging.exists()
    status, text = run("gc", url, "--json")
    assert json.loads(text)["removed"][0]["name"] == staging.name
    assert not staging.exists()


def test_delete_and_rollback(made):
    url, store, _ = made
    status, _ = run("delete", url, "300")
    assert status == 2
    assert run("delete", url, "100")[0] == 0
    status, text = run("rollback", url, "200", "--json")
    done = json.loads(text)  # a takeover from 200: 300 left the history, GC takes it later
    assert {k: done[k] for k in ("url", "latest", "left_history", "epoch")} == {
        "url": url,
        "latest": 200,
        "left_history": [300],
        "epoch": 1,
    }
    assert done["collected_after"] is not None
    assert store.steps() == [200]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ls", "/definitely/not/here"], "no such directory"),
        (["ls", "s3q://bucket"], "known schemes"),
        (["show", "{tmp}/run", "999"], "no published checkpoint at step 999"),
        (["delete", "{tmp}/run", "300"], "newest checkpoint"),
    ],
)
def test_errors_are_one_clear_line(made, capsys, argv, message):
    _, _, tmp_path = made
    status = main([a.format(tmp=tmp_path) for a in argv], io.StringIO())
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("ckptstore: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_durations():
    assert parse_duration("90").total_seconds() == 90
    assert parse_duration("15m").total_seconds() == 900
    assert parse_duration("1.5h").total_seconds() == 5400
    assert parse_duration("2d").total_seconds() == 172800


def test_console_script_and_demo(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", "demo", "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "latest() -> step 500" in result.stdout
    assert "latest(verified=True) -> step 400" in result.stdout
    _status, text = run("ls", str(tmp_path / "demo" / "run"))
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["300", "400", "500"]


def test_bench_prints_ratios_against_the_raw_baseline(tmp_path):
    status, text = run("bench", str(tmp_path / "b"), "--size", "2M", "--repeats", "2")
    assert status == 0
    assert "| raw write+fsync / read |" in text
    assert "| ckptstore |" in text
    assert len(re.findall(r"[0-9]\.[0-9]{2}x \|", text)) == 4  # median ratios, save and load
    assert text.count("| contender | min | median | max |") == 2
    assert "2 interleaved repeats; layout: 8 x 256 KiB; 0 busy processes beside" in text
    assert list((tmp_path / "b").iterdir()) == []  # it cleans up after itself


def test_bench_runs_busy_processes_beside_and_says_so(tmp_path):
    status, text = run(
        "bench", str(tmp_path / "b"), "--size", "1M", "--repeats", "1", "--busy", "2"
    )
    assert status == 0
    assert text.count("2 busy processes beside") == 2


def test_busy_processes_run_inside_and_are_gone_after_even_on_an_error():
    from ckptstore.tools.timing import busy

    with pytest.raises(RuntimeError, match="inside"), busy(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # alive
        raise RuntimeError("inside")
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped
