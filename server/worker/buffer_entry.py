"""What the worker's buffer store (buffers.py) keeps per buffer, what its waiters wait on, and the
book of who waits on which buffer, and the store's bounded memories of what is gone (`Recent`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

K = TypeVar("K")

PENDING = "pending"
READY = "ready"
FAILED = "failed"


class BufferFailed(Exception):
    """The buffer's producer failed; the message is the cause."""


class Entry:
    """One buffer's record. Slotted, with one constructor that sets every field: a training step
    makes one per output (hundreds), and a dataclass's (keyword defaults, a list per entry) cost
    twice as much."""

    __slots__ = ("callbacks", "client_ref", "consumers", "error", "hold", "launched", "nbytes", "owner",
                 "released", "state", "unread", "uploaded", "value")

    def __init__(self, owner: str = "", *, released: bool = False, client_ref: bool = False,
                 hold: bool = False) -> None:
        self.state = PENDING
        self.value: Any = None
        self.error = ""
        self.client_ref = client_ref  # held for the client until it releases
        self.released = released  # the client released it (maybe before it existed)
        self.consumers = 0  # enqueued readers that have not finished
        self.owner = owner
        self.nbytes = 0
        self.hold = hold  # arrived from a peer before the enqueue that reads it: keep it
        self.uploaded = False  # a client's upload supplied it
        # every reader enqueued here ended before it existed (they failed: a run dropped before its
        # reader arrived fails that reader on arrival), and nothing else holds it
        self.unread = False
        # called once it settles; None (most buffers: nothing waits on them) until one is added
        self.callbacks: list[Callable[[], None]] | None = None
        self.launched = False  # a launch's output: the executor says when its computation is over

    def take_callbacks(self) -> list[Callable[[], None]]:
        """Its callbacks (to call once settled), forgotten here."""
        callbacks, self.callbacks = self.callbacks, None
        return callbacks or []

    @property
    def held(self) -> bool:
        """Whether something keeps the buffer: the client's reference, an enqueued reader that has
        not finished, or a peer's copy kept for a reader to come. A buffer is freed only when this
        is false (BufferStore `_maybe_free`). The one definition: the store's hot path (`launched`,
        and `_maybe_free`, which `release` calls per buffer) spells it out inline instead of paying
        a call per array, and tests/test_buffers.py checks that they agree with it."""
        return bool(self.client_ref or self.consumers or self.hold)

    @property
    def tombstone(self) -> bool:
        """Released before it existed, and nothing waits for it or reads it."""
        return self.released and self.state == PENDING and not self.callbacks and not self.held


class Latch:
    """What a thread blocked in `wait_all` waits on: set when the last of its buffers settles, so
    a wait for many buffers (a pipeline pass's outputs, a training step's parameters) wakes its
    thread once, not once per buffer. Counted down under the store's lock."""

    __slots__ = ("callback", "event", "left")

    def __init__(self, count: int, callback: Callable[[], None] | None = None) -> None:
        self.left = count
        self.event = threading.Event()
        self.callback = callback  # called (under the store's lock: it must be quick) when set

    def settled(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.event.set()
            if self.callback is not None:
                self.callback()


class Waiting:
    """Latches waiting on buffers, by buffer id: a latch counts down once for each id it waits on
    when that id is `settle`d. The store calls it with its lock held."""

    __slots__ = ("by_id",)

    def __init__(self) -> None:
        self.by_id: dict[int, list[Latch]] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, buffer_id: object) -> bool:
        return buffer_id in self.by_id

    def add(self, buffer_ids: Iterable[int], latch: Latch) -> None:
        for b in buffer_ids:
            self.by_id.setdefault(b, []).append(latch)

    def remove(self, buffer_ids: Iterable[int], latch: Latch) -> None:
        """Forgets `latch` on these ids (its wait ended or gave up); an id nobody waits on goes."""
        for b in buffer_ids:
            waiting = self.by_id.get(b)
            if waiting is not None and latch in waiting:
                waiting.remove(latch)
                if not waiting:
                    del self.by_id[b]

    def settle(self, buffer_id: int) -> None:
        """Counts down the latches waiting on this buffer, which just settled."""
        for latch in self.by_id.pop(buffer_id, ()):
            latch.settled()


class Recent(OrderedDict[K, None]):
    """The last `limit` keys added (in the order first added): what the store remembers of
    buffers or owners that are gone, so that something of theirs arriving late is not kept; the
    oldest are forgotten first."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def add(self, key: K) -> list[K]:
        """Remembers `key` (as the newest); the keys forgotten to stay within the limit."""
        self[key] = None  # one remembered already keeps its place
        forgotten = []
        while len(self) > self.limit:
            forgotten.append(self.popitem(last=False)[0])
        return forgotten

