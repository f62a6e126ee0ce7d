"""A child process's output, line by line, where every wait is bounded and fails clearly.

The kill tests wait for a state the child reports (a checkpoint published) before they kill
it: a wait that could block forever would hang CI, and a sleep would only hope the state was
reached. A thread reads the pipe, so that a wait can end at its deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import IO

import pytest


class ChildOutput:
    """The lines a child writes to a text pipe, read as they come."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        """Every line taken so far, for failure messages and for what the child said."""
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._ended = False
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next_line(self, timeout: float) -> str | None:
        """The next line, or None if none comes within ``timeout`` s; EOFError at the end."""
        if self._ended:
            raise EOFError("the child's output has ended")
        try:
            line = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if line is None:
            self._ended = True
            raise EOFError("the child's output has ended")
        self.lines.append(line)
        return line

    def wait_for(self, wanted: Callable[[str], bool], timeout: float, what: str) -> str:
        """The next line that ``wanted`` accepts; fail the test naming ``what`` if the output
        ends, or ``timeout`` s pass, first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.next_line(deadline - time.monotonic())
            except EOFError:
                pytest.fail(f"the child exited before {what}; it said:\n{self._tail()}")
            if line is None:
                pytest.fail(f"no {what} within {timeout:.0f} s; the child said:\n{self._tail()}")
            if wanted(line):
                return line

    def drain(self, timeout: float) -> list[str]:
        """Every line up to the end of the output (the child has exited or been killed)."""
        deadline = time.monotonic() + timeout
        while not self._ended:
            try:
                line = self.next_line(deadline - time.monotonic())
            except EOFError:
                break
            if line is None:
                pytest.fail(f"the child's output did not end within {timeout:.0f} s")
        return self.lines

    def _tail(self) -> str:
        return "\n".join(self.lines[-20:]) or "(nothing)"
