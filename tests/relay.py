"""A TCP relay on loopback for tests that need a connection to break while both ends live: a
network drop between a client and a worker, which killing either process cannot stage.

`Relay(target)` listens on 127.0.0.1 and copies bytes both ways between each accepted connection
and `target`. `hold()` stops copying (bytes wait in the sockets' buffers, as on a stalled link),
`hold_replies()` stops only the target's side (what the client sends still gets through: a worker
that takes uploads whose acknowledgements are lost), `hold_open_replies()` the same for the
connections open now only (a session's events held while new connections work), `cut()` resets
every connection open now (both ends see the connection break), `refuse()` also stops accepting
new ones, `release()` goes back to copying. `delay_replies(s)` passes the target's bytes on `s`
seconds after they came, in order (a long link: every answer a round trip late).
`hold_open_requests()` keeps the client's bytes on the connections open now (read, so the client's
writes go on, and passed on in order by `pass_requests()`, which keeps holding the later ones, or
by `release()`): a client's messages held on their way, its session's events still coming."""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import struct
import threading
import time


class Relay:
    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listen.getsockname()[1]}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._running = threading.Event()
        self._running.set()
        self._replies = threading.Event()  # the target's bytes are copied back (unless `hold_replies`)
        self._replies.set()
        self._held: set[socket.socket] = set()  # targets' sides held by `hold_open_replies`
        self._refusing = False
        self._closed = False
        self._reply_delay = 0.0  # `delay_replies`
        # client's side -> (target's side, its bytes kept): `hold_open_requests`
        self._requests: dict[socket.socket, tuple[socket.socket, list[bytes]]] = {}
        self.accepted = 0
        threading.Thread(target=self._accept, name="test-relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listen.accept()
            except OSError:
                return
            if self._refusing:
                _reset(conn)
                continue
            try:
                up = socket.create_connection(self._target, timeout=5)
            except OSError:
                _reset(conn)
                continue
            with self._lock:
                self._pairs.append((conn, up))
                self.accepted += 1
            threading.Thread(target=self._copy, args=(conn, up), daemon=True).start()

    def _copy(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        late: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()  # the target's bytes, when due
        threading.Thread(target=self._pass_late, args=(late, a), daemon=True).start()
        try:
            while not self._closed:
                self._running.wait()
                replies = self._replies.is_set() and b not in self._held
                sources = [a, b] if replies else [a]  # b: the target
                ready, _, _ = select.select(sources, [], [], 0.05)
                if not self._running.is_set():
                    continue  # held: what came stays unread
                for s in ready:
                    if s is b and not (self._replies.is_set() and b not in self._held):
                        continue
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is b and self._reply_delay > 0:
                        late.put((time.monotonic() + self._reply_delay, data))
                    elif s is a and self._kept(a, data):
                        pass
                    else:
                        peers[s].sendall(data)
        except (OSError, ValueError):  # cut meanwhile
            return
        finally:
            late.put((0.0, b""))
            _reset(a)
            _reset(b)

    @staticmethod
    def _pass_late(late: queue.SimpleQueue[tuple[float, bytes]], client: socket.socket) -> None:
        while True:
            due, data = late.get()
            if not data:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                client.sendall(data)
            except OSError:
                return

    def _kept(self, client: socket.socket, data: bytes) -> bool:
        """Keeps `data`, the client's, when its requests are held (`hold_open_requests`)."""
        with self._lock:
            held = self._requests.get(client)
            if held is not None:
                held[1].append(data)
            return held is not None

    def hold_open_requests(self) -> None:
        """The client's bytes on the connections open now are kept from now on (later connections
        copy both ways), until `pass_requests` or `release`."""
        with self._lock:
            self._requests = {a: (b, []) for a, b in self._pairs}

    def pass_requests(self, stop: bool = False) -> int:
        """The client's bytes kept so far go on, in order; later ones are kept still (unless
        `stop`). Returns how many bytes went."""
        sent = 0
        with self._lock:
            for up, kept in self._requests.values():
                for data in kept:
                    with contextlib.suppress(OSError):
                        up.sendall(data)
                    sent += len(data)
                kept.clear()
            if stop:
                self._requests = {}
        return sent

    def delay_replies(self, seconds: float) -> None:
        """The target's bytes reach the client `seconds` after they came (0: at once again)."""
        self._reply_delay = seconds

    def hold(self) -> None:
        self._running.clear()

    def hold_replies(self) -> None:
        """The target's bytes stay unread from now on (until `release`); the client's still go."""
        self._replies.clear()

    def hold_open_replies(self) -> None:
        """As `hold_replies`, for the connections open now only: later ones copy both ways."""
        with self._lock:
            self._held = {up for _, up in self._pairs}

    def release(self) -> None:
        self.pass_requests(stop=True)
        self._held = set()
        self._refusing = False
        self._replies.set()
        self._running.set()

    def cut(self) -> None:
        """Breaks every connection open now (an RST to both ends)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            _reset(a)
            _reset(b)

    def refuse(self) -> None:
        """From now on connections are broken as soon as they are made (until `release`)."""
        self._refusing = True
        self.cut()

    def close(self) -> None:
        self._closed = True
        self._running.set()
        with contextlib.suppress(OSError):
            self._listen.close()
        self.cut()


def _reset(s: socket.socket) -> None:
    """Closes with an RST (SO_LINGER 0), as a dropped link looks to the peer."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.close()
