"""The session stream's sender: what drains the runtime's outgoing queue into a stream.

The runtime (runtime.py) puts messages, and dropped futures' buffers (`Release`), on one queue;
the sender of the current stream takes them in batches (packing.py makes each batch one
message), so a loop of calls costs one message per batch and never waits for a reply.

A stream has a generation. When the session is resumed on a new stream (resume.py), the sender
of the old one ends: what it had taken and not yet handed to gRPC goes to `carry`, in order, and
the new stream's sender sends it first. The sender also remembers the runs it handed to the
current stream (`handed`): those are uncertain should that stream break.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb

from .packing import Release, pack

MAX_BATCH = 4096
# Run ids remembered as handed to the current stream, for `uncertain` after a reconnect; older runs
# are over in practice (a client keeps at most MAX_IN_FLIGHT in flight).
MAX_HANDED = 65536
# Release messages remembered until the controller says they reached their workers, to send again
# on the next stream should this one break first (controller.proto Hello.ack_releases); beyond
# this many (a controller that stopped acknowledging), the oldest are forgotten.
MAX_UNACKED_RELEASES = 65536
STOP = object()  # queued by close: the sender sends what came before, then ends its stream
WAKE = object()  # wakes a stream's sender that the stream outlived (it then hands its item on)


class Sender:
    """The outgoing queue's consumer, one stream generation after another.

    `gen` and `carry` change under `lock`; a run is added to `handed` (and `handed_total`) only
    under `lock` while its stream is current. `handed` is cleared by the runtime, under its own
    progress lock, once every run handed so far is over or its stream broke."""

    def __init__(self, out: queue.SimpleQueue[object], closed: Callable[[], bool]) -> None:
        self.out = out  # the runtime's outgoing queue (messages, `Release`s, STOP, WAKE)
        self.closed = closed
        self.gen = 0
        self.lock = threading.Lock()
        self.carry: deque[object] = deque()  # taken by a sender its stream outlived, sent first on the next
        # runs handed to the current stream, with their outputs
        self.handed: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=MAX_HANDED)
        self.handed_total = 0  # runs handed to any stream (the base of a new stream's RunsDone)
        # release messages handed to the current stream and not yet known to have arrived (with
        # their number on it), kept while the controller acknowledges them (`acks_releases`)
        self.unacked: deque[tuple[int, wpb.ReleaseBuffers]] = deque(maxlen=MAX_UNACKED_RELEASES)
        self.releases_sent = 0  # release messages handed to the current stream
        self.acks_releases = False  # the current stream's controller says which arrived
        self.ready = threading.Event()  # the current stream's Welcome came: its sender goes on
        self.done = threading.Event()  # the current stream's sender ended

    def requests(self, gen: int, first: list[cpb.ClientMessage], ready: threading.Event,
                 done: threading.Event) -> Iterator[cpb.ClientMessage]:
        """Stream `gen`'s messages: `first` (hello, and on a resumed stream the registrations),
        then, once the Welcome came (`ready`), what was carried over and what is queued, in
        batches. A newer stream ends this one: what it took then goes to `carry`, in order."""
        try:
            yield from first
            while not ready.wait(0.5):
                if gen != self.gen or self.closed():
                    return
            while True:
                with self.lock:
                    if gen != self.gen:
                        return
                    carried = list(self.carry)
                    self.carry.clear()
                batch: list[cpb.ClientMessage | Release] = []
                stop = False
                for item in carried:
                    if item is STOP:
                        stop = True
                    elif item is not WAKE:
                        assert isinstance(item, cpb.ClientMessage | Release)
                        batch.append(item)
                if not batch and not stop:
                    item = self.out.get()
                    if not self._take(gen, item, batch):
                        return
                    stop = item is STOP
                while not stop and batch and len(batch) < MAX_BATCH:
                    try:
                        nxt = self.out.get_nowait()
                    except queue.Empty:
                        break
                    if not self._take(gen, nxt, batch):
                        return
                    stop = nxt is STOP
                if batch:
                    runs = [(m.run.run_id, tuple(m.run.output_ids)) for m in batch
                            if isinstance(m, cpb.ClientMessage) and m.HasField("run")]
                    releases: list[wpb.ReleaseBuffers] = []
                    msg = pack(batch, releases)
                    with self.lock:  # handed (and remembered as such) only while the stream is current
                        if gen != self.gen:
                            self.carry.extend(batch)
                            return
                        if runs:
                            self.handed.extend(runs)
                            self.handed_total += len(runs)
                        if releases and self.acks_releases:  # numbered as the controller counts them
                            for r in releases:
                                self.releases_sent += 1
                                self.unacked.append((self.releases_sent, r))
                    yield msg
                if stop:
                    return
        finally:
            done.set()

    def _take(self, gen: int, item: object, batch: list[cpb.ClientMessage | Release]) -> bool:
        """Adds `item` to `batch`; False when stream `gen` is over: then the batch and the item
        go to `carry`, in order, for the next stream."""
        with self.lock:
            if gen != self.gen:
                self.carry.extend(batch)
                if item is not WAKE:
                    self.carry.append(item)
                batch.clear()
                return False
        if isinstance(item, cpb.ClientMessage | Release):
            batch.append(item)
        return True

    def releases_arrived(self, count: int) -> list[wpb.ReleaseBuffers]:
        """The controller says the current stream's first `count` release messages reached their
        workers (SessionEvent.releases_done): they are forgotten, and returned."""
        arrived = []
        with self.lock:
            while self.unacked and self.unacked[0][0] <= count:
                arrived.append(self.unacked.popleft()[1])
        return arrived

    def set_acks(self, acks: bool) -> None:
        """Whether the current stream's controller acknowledges releases (Welcome.acks_releases):
        if not, none is kept (nothing would ever forget them)."""
        with self.lock:
            self.acks_releases = acks
            if not acks:
                self.unacked.clear()

    def releases_again(self) -> None:
        """For a new stream: the release messages handed to the streams before whose arrival was
        not acknowledged (the controller that died may have held them, or not sent them yet) are
        sent again, first thing once it is ready (after the Welcome, and the wait for the
        session's hosts to register again: a release for a host not back yet would be dropped),
        numbered as that stream's. One whose buffer is gone already leaves a tombstone of the
        session's on its worker, which goes when the session ends (server/worker/buffers.py)."""
        with self.lock:
            again = [cpb.ClientMessage(release=r) for _, r in self.unacked]
            self.unacked.clear()
            self.releases_sent = 0
            self.carry.extendleft(reversed(again))

    def next_stream(self) -> tuple[int, threading.Event, threading.Event]:
        """Ends the current stream's sender (it hands on what it took) and opens a generation:
        its number, and its `ready` and `done` events."""
        with self.lock:
            self.gen += 1
            gen = self.gen
        self.ready.set()  # a sender waiting for its Welcome looks again, and ends
        self.out.put(WAKE)
        self.done.wait(1.0)  # a sender blocked on the queue wakes; one stuck in gRPC never takes more
        self.ready = threading.Event()
        self.done = threading.Event()
        return gen, self.ready, self.done

    def queued(self) -> list[object]:
        """Everything queued for the next stream, in order (moved to `carry`); no stream takes
        from the queue until its `ready` is set."""
        with self.lock:
            while True:
                try:
                    self.carry.append(self.out.get_nowait())
                except queue.Empty:
                    break
            return list(self.carry)

    def requeue(self, keep: list[object]) -> None:
        """Only `keep` stays queued for the next stream (what `queued` returned, less some)."""
        with self.lock:
            self.carry = deque(keep)
