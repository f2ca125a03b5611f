"""Invariant checking for the pure state machines (scheduler, resource manager, the worker's core).

Every state machine keeps a bounded log of the stimuli it handled (`StimulusLog`) and has a
`validate()`. With `PATHWAYS_VALIDATE=1` in the environment (the test fixture sets it for every
controller and worker it starts) each machine validates itself after every stimulus, and an
`InvariantError` then carries the recent stimuli that led to the broken state, so a failure on real
traffic reads as a reproducible event sequence rather than a bare assertion.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

ENV_VAR = "PATHWAYS_VALIDATE"
DEFAULT_HISTORY = 64  # stimuli kept per machine: enough to read the path to a failure, ~10 KiB


def validation_enabled() -> bool:
    """Whether state machines should validate after every stimulus (read at construction)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Stimulus:
    """One event a state machine handled: when (monotonic seconds) and a one-line description."""

    at: float
    text: str

    def __str__(self) -> str:
        return f"{self.at:.6f} {self.text}"


class StimulusLog:
    """The last `maxlen` stimuli of one state machine (a ring, O(1) per record)."""

    def __init__(self, maxlen: int = DEFAULT_HISTORY) -> None:
        self._items: deque[Stimulus] = deque(maxlen=maxlen)

    def record(self, text: str) -> None:
        self._items.append(Stimulus(time.monotonic(), text))

    def recent(self) -> list[Stimulus]:
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)


class InvariantError(AssertionError):
    """A state machine's `validate()` found its state inconsistent.

    `history` holds the stimuli (oldest first) that the machine handled before the failure."""

    def __init__(self, message: str, history: Iterable[Stimulus] = ()) -> None:
        self.problem = message
        self.history = list(history)
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.history:
            return self.problem
        lines = "\n".join(f"  {s}" for s in self.history)
        return f"{self.problem}\nafter these stimuli (oldest first):\n{lines}"

    def with_history(self, history: Iterable[Stimulus]) -> InvariantError:
        """The same problem, carrying `history` (for a machine that caught a bare error)."""
        return InvariantError(self.problem, history)
