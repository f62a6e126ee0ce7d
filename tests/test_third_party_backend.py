"""A backend written the way a third party would, against public names only, passes the
conformance suite: a scheme registered at run time whose strategy subclasses the public
building blocks (ConditionalPutCommit, ObjectShardSink) over a public driver."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket
from ckptstore.commit.base import CommitStrategy, ShardSink
from ckptstore.commit.conditional_put import ConditionalPutCommit, ObjectShardSink
from ckptstore.conformance.runner import run_backend
from ckptstore.registry import register, unregister
from ckptstore.urls import StoreURL


class TaggedCommit(ConditionalPutCommit):
    """Every shard object carries its step and attempt as user metadata, say for a bucket
    lifecycle rule or an audit, on top of the conditional-put protocol."""

    name = "tagged-conditional-put"

    def open_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None = None
    ) -> ShardSink:
        return ObjectShardSink(
            self.driver,
            f"{self.attempt_prefix(step, attempt)}{name}",
            self.part_size,
            size_hint,
            self.parts_executor(),
            self.concurrency,
            metadata={"tagged-step": str(step), "tagged-attempt": attempt},
        )


def open_tagged(url: StoreURL, options: Mapping[str, object]) -> TaggedCommit:
    """``tagged://bucket/prefix``: an in-process bucket with 1 KiB parts."""
    url.reject_unknown(options, allowed=())
    bucket = get_bucket(url.netloc, min_part_size=1024)
    return TaggedCommit(MemoryDriver(bucket, url.path.strip("/")), part_size=1024)


@pytest.fixture
def tagged_url() -> Iterator[str]:
    register("tagged", open_tagged)
    bucket = f"tagged-{os.getpid()}"
    yield f"tagged://{bucket}/run"
    unregister("tagged")
    drop_bucket(bucket)


def test_a_third_party_backend_passes_the_conformance_suite(tagged_url: str) -> None:
    report = run_backend(tagged_url)
    assert report.ok, report
    assert {key: result.status for key, result in report.invariants.items()} == dict.fromkeys(
        [f"I{i}" for i in range(1, 11)], "held"
    )
    store = ckptstore.open(f"{tagged_url}-again")
    store.save(7, {"a": b"x" * 3000})  # three parts
    checkpoint = store.latest()
    assert checkpoint.read("a") == b"x" * 3000
    driver = store.strategy.driver
    key = checkpoint.manifest.shard("a").locator["key"]
    assert dict(driver.head(key).metadata or {})["tagged-step"] == "7"


def test_the_backend_uses_public_names_only() -> None:
    tree = ast.parse(Path(__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptstore"):
            assert not any(part.startswith("_") for part in node.module.split(".")), node.module
            assert not [alias.name for alias in node.names if alias.name.startswith("_")]
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self":
            assert not node.attr.startswith("_"), f"self.{node.attr}"  # no inherited privates


def test_a_strategy_declares_its_lineages_or_is_refused_when_defined() -> None:
    """``keeps_lineages`` is declared beside ``create_epoch``, not guessed from the methods:
    a class that implements one without the other is a TypeError when it is defined."""
    with pytest.raises(TypeError, match="has a create_epoch: declare keeps_lineages = True"):

        class Undeclared(CommitStrategy[Any]):  # epochs implemented, not declared
            def create_epoch(self, epoch: int, record: bytes) -> None: ...

    with pytest.raises(TypeError, match="declares keeps_lineages but has no create_epoch"):

        class Unimplemented(CommitStrategy[Any]):  # declared, not implemented
            keeps_lineages = True

    with pytest.raises(TypeError, match="has a create_epoch"):

        class HalfOptedOut(ConditionalPutCommit):  # the inherited create_epoch still there
            keeps_lineages = False

    class WithoutLineages(ConditionalPutCommit):  # opting out of an inherited implementation
        keeps_lineages = False
        create_epoch = CommitStrategy.create_epoch

    assert TaggedCommit.keeps_lineages and not WithoutLineages.keeps_lineages
