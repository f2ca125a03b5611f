"""Ports for servers a process starts itself, reserved until released: the controller's island
coordination services (controller/groups.py), and the servers tests and benchmarks start.

Binding 127.0.0.1:0, reading the port and closing the socket (the usual "free port") leaves a
window until the server binds it: any `bind(0)` on the machine (a worker's gRPC or transfer port,
started at the same time as the controller) can be handed that port (measured: 13 of 100,000
`bind(0)` calls returned a port just closed), and the controller then exits with "address
in use". A controller restarted on its port has the same window.

`reserve_port()` keeps the socket bound, with SO_REUSEADDR and without listening, for as long as
the reservation lives. The kernel then hands the port to no `bind(0)` (nor, by its source, to a
`connect()` as its local port), while a server that binds it by number with SO_REUSEADDR (gRPC
servers do, the controller's and jaxlib's coordination service included) still can, again after
each restart: sockets with SO_REUSEADDR share a port as long as at most one listens. A second
server on the port still fails, as it should (tests/test_ports.py).
"""

from __future__ import annotations

import socket

__all__ = ["PortReservation", "held_port", "reserve_port"]


class PortReservation:
    """A port (on `host`, loopback by default) held for a server that this process starts;
    `close()` gives it up."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, 0))
        except OSError:
            self._sock.close()
            raise
        self.host = host
        self.port = int(self._sock.getsockname()[1])

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reserve_port(host: str = "127.0.0.1") -> PortReservation:
    return PortReservation(host)


_HELD: list[PortReservation] = []  # held_port()'s reservations, held until the process exits


def held_port(host: str = "127.0.0.1") -> int:
    """A port reserved for the rest of this process (a test session, a benchmark run): for
    servers started on it, perhaps several times, whose lifetime the caller does not track."""
    reservation = reserve_port(host)
    _HELD.append(reservation)
    return reservation.port
