"""A tiered store is one URL (``?replicate_to=DURABLE``), and every adapter and command takes it.

What is checked: ``tiered_url`` and the URL forms it parses (a percent-encoded durable URL
with its own query, an unquoted one with a ``+`` in its scheme); that a URL opens the same pair
as the keyword; the clear errors of a wrong URL (a second durable, ``replication`` alone, a
tiered durable, a command on one store given a pair); secrets of the durable URL redacted;
``TieredStore.delete``; and each adapter (torch state, DCP, Lightning, Hugging Face, directory)
and ``ckptstore ls/show/verify/delete/rollback/push/pull`` on a tiered URL, the checkpoint
reaching the durable tier. Also: ``save_state(TieredStore, ...)`` type-checks (mypy --strict).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import (
    CapabilityError,
    CheckpointNotFoundError,
    InvalidOptionError,
    InvalidURLError,
    RefusedError,
)
from ckptstore.redaction import redact
from ckptstore.tiers.tiered import TieredStore, split_tiered_url
from ckptstore.tools.embedded import EmbeddedS3

REPO = Path(__file__).resolve().parent.parent


def pair_url(tmp_path: Path, **options: str) -> str:
    return ckptstore.tiered_url(f"file://{tmp_path}/fast", f"file://{tmp_path}/durable", **options)


def run(*words: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(words), out=out)
    return status, out.getvalue()


# -- the URL ---------------------------------------------------------------------------------


def test_tiered_url_round_trips_a_durable_url_with_its_own_query() -> None:
    durable = "s3+versioned://bucket/run?endpoint_url=http://127.0.0.1:9000&part_size=65536"
    url = ckptstore.tiered_url("file:///nvme/run?fsync=0", durable, replication="every:10")
    assert url.startswith("file:///nvme/run?fsync=0&replicate_to=s3%2Bversioned%3A%2F%2F")
    assert split_tiered_url(url) == (
        "file:///nvme/run?fsync=0",
        {"replicate_to": durable, "replication": "every:10"},
    )
    # Unquoted, a durable URL without an ``&`` of its own keeps its ``+`` (not a space).
    assert split_tiered_url("file:///a?replicate_to=s3+versioned://b/run")[1] == {
        "replicate_to": "s3+versioned://b/run"
    }
    assert split_tiered_url("/a/path?replicate_to=x") == ("/a/path?replicate_to=x", {})
    assert split_tiered_url("file:///a?epoch=3") == ("file:///a?epoch=3", {})


def test_a_tiered_url_opens_the_pair_the_keywords_open(tmp_path: Path) -> None:
    with ckptstore.open(pair_url(tmp_path, replication="newest")) as store:
        assert isinstance(store, TieredStore)
        assert store.url == f"file://{tmp_path}/fast"
        assert store.durable_url == f"file://{tmp_path}/durable"
        assert type(store.replicator.policy).__name__ == "ReplicateNewest"
        store.save(1, {"a.bin": b"one"})
    durable = ckptstore.open(f"file://{tmp_path}/durable", create=False)
    latest = durable.latest()
    assert latest is not None and latest.read("a.bin") == b"one"  # close() copied it
    # The same durable URL as keyword and in the URL is one pair, not a conflict.
    same = ckptstore.open(pair_url(tmp_path), replicate_to=f"file://{tmp_path}/durable")
    same.close()


@pytest.mark.parametrize(
    ("query", "error", "words"),
    [
        ("replicate_to=file:///x&replicate_to=file:///y", InvalidURLError, "given twice"),
        ("replicate_to=", InvalidURLError, "replicate_to is empty"),
        ("replication=newest", InvalidOptionError, "need replicate_to"),
        (
            f"replicate_to={quote('file:///d?replicate_to=file:///e', safe='')}",
            InvalidOptionError,
            "a durable store is one store",
        ),
    ],
)
def test_a_wrong_tiered_url_is_refused_clearly(
    tmp_path: Path, query: str, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        ckptstore.open(f"file://{tmp_path}/fast?{query}")
    assert not (tmp_path / "fast").exists()  # nothing made for a refused URL


def test_a_second_durable_store_as_keyword_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="give one"):
        ckptstore.open(pair_url(tmp_path), replicate_to=f"file://{tmp_path}/elsewhere")
    with pytest.raises(InvalidOptionError, match="already names replicate_to"):
        ckptstore.tiered_url(pair_url(tmp_path), "file:///other")
    with pytest.raises(InvalidURLError, match="needs a scheme"):
        ckptstore.tiered_url("/nvme/run", "file:///other")


def test_the_durable_urls_secrets_are_redacted(tmp_path: Path) -> None:
    durable = "s3://KEYID:SECRET@bucket/run?endpoint_url=http://127.0.0.1:1&session_token=TOKEN"
    url = ckptstore.tiered_url(f"file://{tmp_path}/fast", durable)
    shown = redact(url)
    assert "SECRET" not in shown and "TOKEN" not in shown and "KEYID" in shown
    with pytest.raises(ckptstore.CkptStoreError) as raised:
        ckptstore.open(url)  # a password in the URL is refused: said without it
    assert "SECRET" not in str(raised.value) and "TOKEN" not in str(raised.value)
    status, out = run("ls", url, "--json")
    assert status != 0 and "SECRET" not in out and "TOKEN" not in out


# -- the pair's delete -----------------------------------------------------------------------


def test_delete_removes_a_step_from_both_tiers_and_keeps_the_newest(tmp_path: Path) -> None:
    with ckptstore.open(pair_url(tmp_path)) as store:
        for step in (1, 2, 3):
            store.save(step, {"a.bin": bytes([step])})
        store.wait_replicated(timeout=60)
        store.delete(2)
        assert store.steps() == [1, 3]
        assert store.fast.steps() == [1, 3] and store.durable.steps() == [1, 3]
        with pytest.raises(RefusedError, match="newest"):
            store.delete(3)
        with pytest.raises(CheckpointNotFoundError):
            store.delete(2)
        store.delete(3, force=True)
        assert store.steps() == [1]
        store.save(4, {"a.bin": b"4"})
        store.delete(4, force=True)  # deleted before its copy (or after): gone from both
        store.wait_replicated(timeout=60)
        assert store.steps() == [1] and store.durable.steps() == [1]


# -- the adapters ----------------------------------------------------------------------------


def durable_steps(tmp_path: Path) -> list[int]:
    return ckptstore.open(f"file://{tmp_path}/durable", create=False).steps()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_state_and_dcp_on_a_tiered_store(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckptstore.torch import load_state, save_state
    from ckptstore.torch.dcp import CkptStoreReader, CkptStoreWriter

    model = torch.nn.Linear(3, 2)
    with ckptstore.open(pair_url(tmp_path)) as store:
        assert isinstance(store, TieredStore)
        save_state(store, 1, {"model": model}, counters={"epoch": 1})
        dcp.save({"w": torch.arange(6.0)}, storage_writer=CkptStoreWriter(store, 2))
    assert durable_steps(tmp_path) == [1, 2]
    shutil.rmtree(tmp_path / "fast")  # a new node: only the durable tier holds them
    restored = torch.nn.Linear(3, 2)
    with ckptstore.open(pair_url(tmp_path)) as store:
        target = {"w": torch.zeros(6)}
        dcp.load(target, storage_reader=CkptStoreReader(store, 2))
        assert torch.equal(target["w"], torch.arange(6.0))
        state = load_state(store.get(1), {"model": restored})
    assert state["counters"] == {"epoch": 1}
    assert torch.equal(restored.weight, model.weight)


def test_lightning_checkpoint_io_on_a_tiered_url(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning_fabric")
    from ckptstore.adapters.lightning import CkptStoreIO

    plugin = CkptStoreIO(pair_url(tmp_path))
    assert isinstance(plugin.store, TieredStore)
    for step in (1, 2):
        state = {"global_step": step, "state_dict": {"w": torch.full((2,), float(step))}}
        plugin.save_checkpoint(state, tmp_path / "ckpts" / f"step={step}.ckpt")
    plugin.remove_checkpoint(tmp_path / "ckpts" / "step=1.ckpt")  # top-k: gone from both tiers
    assert plugin.load_checkpoint(tmp_path / "ckpts" / "step=2.ckpt")["global_step"] == 2
    plugin.teardown()
    plugin.store.close()
    assert durable_steps(tmp_path) == [2]


def test_hugging_face_callback_on_a_tiered_url(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from ckptstore.adapters.huggingface import CkptStoreCallback

    output = tmp_path / "out"
    (output / "checkpoint-5").mkdir(parents=True)
    (output / "checkpoint-5" / "model.safetensors").write_bytes(b"weights")
    callback = CkptStoreCallback(pair_url(tmp_path))
    args = SimpleNamespace(output_dir=str(output), world_size=1, process_index=0)
    callback.on_save(args, SimpleNamespace(global_step=5), None)  # published in the background
    callback.on_train_end(args, SimpleNamespace(global_step=5), None)  # waits for it, as train()
    callback.store.close()
    assert durable_steps(tmp_path) == [5]
    shutil.rmtree(tmp_path / "fast")
    shutil.rmtree(output)
    output.mkdir()
    again = CkptStoreCallback(pair_url(tmp_path))  # a new node: restored from the durable tier
    restored = again.prepare_output_dir(output)
    assert restored is not None and restored.step == 5
    assert (output / "checkpoint-5" / "model.safetensors").read_bytes() == b"weights"
    again.store.close()


def test_directory_push_and_pull_on_a_tiered_url(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.txt").write_text("a")
    url = pair_url(tmp_path)
    status, out = run("push", str(source), url, "--step", "3")
    assert status == 0, out
    assert durable_steps(tmp_path) == [3]  # push returns once the durable tier holds it
    shutil.rmtree(tmp_path / "fast")
    (tmp_path / "fast").mkdir()  # a new node's empty fast tier
    status, out = run("pull", url, str(tmp_path / "restored"))
    assert status == 0, out
    assert (tmp_path / "restored" / "sub" / "a.txt").read_text() == "a"
    status, out = run("push", str(source), url, "--step", "4", "--epoch", "0", "--json")
    assert status == 2 and "a tiered pair's epochs" in json.loads(out)["error"], out
    from ckptstore.adapters.directory import publish_directory

    with ckptstore.open(url) as store, pytest.raises(CapabilityError, match="epoch"):
        publish_directory(store, 5, source, epoch=0)


# -- the commands ----------------------------------------------------------------------------


def test_ls_show_verify_delete_and_rollback_take_a_tiered_url(tmp_path: Path) -> None:
    url = pair_url(tmp_path)
    with ckptstore.open(url) as store:
        for step in (1, 2, 3, 4):
            store.save(step, {"a.bin": bytes([step]) * 100})
    status, out = run("ls", url, "--json")
    assert status == 0, out
    document = json.loads(out)
    assert [entry["step"] for entry in document["checkpoints"]] == [1, 2, 3, 4]
    assert {entry["tier"] for entry in document["checkpoints"]} == {"fast+durable"}
    assert document["durable_url"] == f"file://{tmp_path}/durable"
    status, out = run("show", url, "2")
    assert status == 0 and "tier        fast" in out, out
    status, out = run("verify", url, "--all", "--json")
    assert status == 0, out
    results = json.loads(out)["results"]
    assert sorted((r["tier"], r["step"]) for r in results if r["status"] == "ok") == sorted(
        (tier, step) for tier in ("fast", "durable") for step in (1, 2, 3, 4)
    )
    status, out = run("delete", url, "1")
    assert status == 0 and durable_steps(tmp_path) == [2, 3, 4], out
    status, out = run("rollback", url, "2", "--json")
    assert status == 0 and json.loads(out)["left_history"] == [3, 4], out
    with ckptstore.open(url) as store:
        latest = store.latest()
        assert latest is not None and latest.step == 2
    # A damaged durable copy is found though the fast copy is whole.
    durable = tmp_path / "durable"
    [damaged] = [p for p in durable.rglob("a.bin") if p.relative_to(durable).parts[0][-2:] == "02"]
    damaged.write_bytes(b"\0" * 100)
    status, out = run("verify", url, "2")
    assert status == 1 and "durable tier" in out and "BROKEN" in out, out


def test_an_s3_durable_tier_with_its_own_query_through_one_url(
    tmp_path: Path, moto_s3: EmbeddedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real S3 server as the durable tier, its URL (endpoint, part sizes) inside the pair's:
    the Lightning plugin saves through it, and a new node's ``ls`` and ``pull`` find it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning_fabric")
    from ckptstore.adapters.lightning import CkptStoreIO

    for name, value in moto_s3.credentials_env().items():
        monkeypatch.setenv(name, value)
    durable = moto_s3.url(f"tiered-url/{os.getpid()}-{tmp_path.name}", part_size=65536)
    assert "&" in durable  # its own query, which the pair's URL must carry whole
    url = ckptstore.tiered_url(f"file://{tmp_path}/fast", durable)
    plugin = CkptStoreIO(url)
    state = {"global_step": 7, "state_dict": {"w": torch.arange(100_000.0)}}
    plugin.save_checkpoint(state, tmp_path / "ckpts" / "step=7.ckpt")
    plugin.store.close()
    shutil.rmtree(tmp_path / "fast")
    (tmp_path / "fast").mkdir()
    status, out = run("ls", url, "--json")
    assert status == 0, out
    assert [(e["step"], e["tier"]) for e in json.loads(out)["checkpoints"]] == [(7, "durable")]
    again = CkptStoreIO(url)
    assert torch.equal(
        again.load_checkpoint(tmp_path / "ckpts" / "step=7.ckpt")["state_dict"]["w"],
        torch.arange(100_000.0),
    )
    again.store.close()


def test_a_command_on_one_store_refuses_a_tiered_url_naming_both(tmp_path: Path) -> None:
    url = pair_url(tmp_path)
    ckptstore.open(url).close()
    for words in (["gc", url], ["take-over", url, "--discard-history"], ["advise", url]):
        status, out = run(*words, "--json")
        message = json.loads(out)["error"]
        assert status == 2 and "names a tiered pair" in message, out
        assert f"file://{tmp_path}/fast" in message and f"file://{tmp_path}/durable" in message
    assert ckptstore.open(f"file://{tmp_path}/fast").lineage().newest == 0  # not taken over


def test_conformance_takes_a_tiered_url_as_its_replicate_to_form(tmp_path: Path) -> None:
    status, out = run("conformance", pair_url(tmp_path), f"file://{tmp_path}/other", "--json")
    assert status == 2 and "runs a tiered pair alone" in json.loads(out)["error"], out
    status, out = run(
        "conformance", pair_url(tmp_path), "--replicate-to", f"file://{tmp_path}/else", "--json"
    )
    assert status == 2 and "give one" in json.loads(out)["error"], out


# -- typing ----------------------------------------------------------------------------------


def test_every_adapter_type_checks_with_a_tiered_store(tmp_path: Path) -> None:
    """mypy --strict accepts a TieredStore (and ckptstore.open's result) wherever an adapter
    takes a store; a Store-only call (a pair's epochs) is where mypy says so."""
    api = pytest.importorskip("mypy.api")
    source = tmp_path / "uses_a_tiered_store.py"
    source.write_text(
        textwrap.dedent(
            """
            import torch

            import ckptstore
            from ckptstore.adapters.directory import publish_directory
            from ckptstore.adapters.lightning import CkptStoreIO
            from ckptstore.torch import AsyncSaver, load_state, save_state
            from ckptstore.torch.agreement import take_over
            from ckptstore.torch.dcp import CkptStoreWriter


            def uses(pair: ckptstore.TieredStore, any_store: ckptstore.CheckpointStore) -> None:
                model = torch.nn.Linear(1, 1)
                save_state(pair, 1, {"model": model})
                load_state(pair, {"model": model})
                CkptStoreWriter(pair, 2)
                AsyncSaver(pair)
                CkptStoreIO(pair)
                publish_directory(pair, 3, "somewhere")
                take_over(pair, None)
                save_state(any_store, 4, {"model": model})
                opened = ckptstore.open("file:///x", replicate_to="file:///y")
                save_state(opened, 5, {"model": model})
                with ckptstore.open("file:///x?replicate_to=file:///y") as store:
                    save_state(store, 6, {"model": model})
            """
        )
    )
    stdout, stderr, status = api.run(
        ["--strict", "--cache-dir", str(REPO / ".mypy_cache"), "--no-error-summary", str(source)]
    )
    assert status == 0, stdout + stderr
    assert os.path.exists(source)
