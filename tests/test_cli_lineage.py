"""``ckptstore ls`` and ``show`` on a store that was taken over: epochs and their parents,
superseded checkpoints marked as such, and a checkpoint's lineage back to epoch 0."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import SupersededError


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


@pytest.fixture
def taken(tmp_path: Path) -> str:
    """Steps 1-4 in epoch 0; epoch 1 resumed from 2 saves 3 and 5; epoch 2 resumed from 3
    (epoch 1's) saves 4; the zombie of epoch 0 is refused."""
    url = f"file://{tmp_path}/run"
    zombie = ckptstore.open(url)
    for step in range(1, 5):
        zombie.save(step, {"m": b"z" * step})
    first = ckptstore.open(url)
    first.take_over(2, note="job 41")
    first.save(3, {"m": b"a"})
    first.save(5, {"m": b"a"})
    with pytest.raises(SupersededError):
        zombie.save(6, {"m": b"z"})
    second = ckptstore.open(url)
    second.take_over(3, note="job 42")
    second.save(4, {"m": b"b"})
    return url


def test_ls_shows_epochs_parents_and_superseded_checkpoints(taken: str) -> None:
    status, text = run("ls", taken)
    assert status == 0
    tables = text.split("\n\n")
    checkpoints = [line.split() for line in tables[0].splitlines()]
    assert checkpoints[0][:2] == ["STEP", "EPOCH"]
    assert [(row[0], row[1], row[-1]) for row in checkpoints[1:]] == [
        ("1", "0", "ok"),
        ("2", "0", "ok"),
        ("3", "1", "ok"),
        ("4", "2", "ok"),
    ]
    epochs = tables[1].splitlines()
    assert epochs[0].split()[:2] == ["EPOCH", "PARENT"]
    assert epochs[1].split()[:2] == ["0", "-"]
    assert epochs[2].split()[:3] == ["1", "step", "2"] and epochs[2].endswith("job 41")
    assert epochs[3].split()[:3] == ["2", "step", "3"] and epochs[3].endswith("job 42")
    superseded = tables[2].splitlines()
    assert superseded[0].startswith("superseded")
    marked = [line.split()[:2] for line in superseded[2:]]
    assert marked == [["3", "0"], ["4", "0"], ["5", "1"]]
    assert all("superseded by epoch" in line for line in superseded[2:])


def test_ls_json_has_the_same(taken: str) -> None:
    status, text = run("ls", taken, "--json")
    assert status == 0
    document = json.loads(text)
    assert [(c["step"], c["epoch"]) for c in document["checkpoints"]] == [
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 2),
    ]
    assert [(e["epoch"], e["parent"], e["note"]) for e in document["epochs"]] == [
        (1, 2, "job 41"),
        (2, 3, "job 42"),
    ]
    assert [
        {key: entry[key] for key in ("step", "epoch", "superseded_by")}
        for entry in document["superseded"]
    ] == [
        {"step": 3, "epoch": 0, "superseded_by": 1},
        {"step": 4, "epoch": 0, "superseded_by": 2},
        {"step": 5, "epoch": 1, "superseded_by": 2},
    ]
    for entry in document["superseded"]:  # when gc takes it: a day after its takeover
        taken_at = datetime.fromisoformat(entry["superseded_at"])
        goes = datetime.fromisoformat(entry["collected_after"])
        assert goes - taken_at == timedelta(hours=24)
        assert abs((taken_at - datetime.now(timezone.utc)).total_seconds()) < 600
    ckptstore.open(taken).gc()
    assert len(json.loads(run("ls", taken, "--json")[1])["superseded"]) == 3
    ckptstore.open(taken).gc(superseded_grace=0)
    document = json.loads(run("ls", taken, "--json")[1])
    assert document["superseded"] == []
    assert [c["step"] for c in document["checkpoints"]] == [1, 2, 3, 4]


def test_show_gives_the_lineage_back_to_epoch_0(taken: str) -> None:
    status, text = run("show", taken, "4")
    assert status == 0
    lines = {line[:12].strip(): line[12:] for line in text.splitlines() if line[:1] != " "}
    assert lines["epoch"].startswith("2, resumed from step 3, taken ")
    assert lines["lineage"] == "step 4 (epoch 2) <- step 3 (epoch 1) <- step 2 (epoch 0) <- start"
    status, text = run("show", taken)  # the latest: the same checkpoint
    assert "step 4 (epoch 2) <- step 3 (epoch 1)" in text
    status, text = run("show", taken, "1")
    assert "lineage     step 1 (epoch 0) <- start" in text
    assert "epoch       0 (the store's first, never taken over)" in text


def test_show_json_has_the_lineage(taken: str) -> None:
    status, text = run("show", taken, "4", "--json")
    assert status == 0
    document = json.loads(text)
    assert document["step"] == 4 and document["epoch"] == 2
    assert [
        (link["epoch"], link["parent"], link["parent_epoch"]) for link in document["lineage"]
    ] == [
        (2, 3, 1),
        (1, 2, 0),
        (0, None, None),
    ]


def test_a_fresh_start_ends_the_lineage(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    ckptstore.open(url).save(7, {"m": b"old"})
    store = ckptstore.open(url)
    store.take_over(None, discard_history=True)
    store.save(1, {"m": b"new"})
    _, text = run("show", url, "1")
    assert "lineage     step 1 (epoch 1) <- fresh start" in text
    assert "epoch       1, resumed from a fresh start" in text
    document = json.loads(run("ls", url, "--json")[1])
    assert [c["step"] for c in document["checkpoints"]] == [1]
    assert [
        {key: entry[key] for key in ("step", "epoch", "superseded_by")}
        for entry in document["superseded"]
    ] == [{"step": 7, "epoch": 0, "superseded_by": 1}]


def test_a_store_never_taken_over_lists_as_before(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    ckptstore.open(url).save(1, {"m": b"x"})
    _, text = run("ls", url)
    assert text.splitlines()[0].split() == [
        "STEP",
        "COMMITTED",
        "(UTC)",
        "SIZE",
        "SHARDS",
        "STATUS",
    ]
    assert len(text.splitlines()) == 2
