"""A worker's host declared lost ends the client's calls waiting there (`WorkerClient.abandon`),
including one being made as the loss is told: after the caller's last look whether the host is
lost (`gone`) and before the call is where `abandon` finds it. Before, such a call waited at the
worker for its whole deadline (at a frozen worker: the wait plus 5 s), which a `pw` call on a
slice that moved showed as 6 s instead of half of one (tests/test_slice_generations.py).

Real processes: a controller and a worker, a session opened on the controller
(tests/test_trust_worker.py) and the real `WorkerClient`."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from pwctl.worker_client import WorkerClient
from tests.conftest import LocalCluster
from tests.test_trust_worker import meta, open_session, upload, worker_channels

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

WHY = "the worker does not answer: its host w-a was lost"


def told_then(conn: WorkerClient) -> Callable[[], str]:
    """A `gone` that finds the host not lost, the loss told right after it looked."""
    def gone() -> str:
        conn.abandon(WHY)
        return ""
    return gone


def test_a_loss_told_as_a_call_is_made_ends_it_at_once(module_cluster: LocalCluster) -> None:
    address = module_cluster.hosts()["w-a"].address
    with worker_channels(module_cluster) as (_, _, stub, cch):
        s = open_session(module_cluster, cch)
        c = WorkerClient(address, module_cluster.token, s.credential)
        unary = WorkerClient(address, module_cluster.token, s.credential)
        unary.waits.close()  # its waits are unary calls
        missing = s.id(9)  # never uploaded: each call waits its whole 3 s unless abandoned
        calls: dict[str, Callable[[], tuple[object, str]]] = {
            "fetch": lambda: c.fetch(missing, 3.0, gone=told_then(c)),
            "fetch_parts": lambda: c.fetch_parts(missing, 3.0, gone=told_then(c)),
            "wait on the stream": lambda: c.wait([missing], 3.0, gone=told_then(c)),
            "unary wait": lambda: unary.wait([missing], 3.0, gone=told_then(unary)),
        }
        try:
            assert c.wait([missing], 0.1) == (False, "") and c.waits.opened == 1  # the stream is open
            for name, call in calls.items():
                t0 = time.monotonic()
                got = call()
                took = time.monotonic() - t0
                assert got[1] == WHY and took < 2.0, (name, got, took)
            # calls made later are made as usual, on the same stream
            upload(stub, meta(module_cluster, s), s.id(1), np.arange(3.0))
            assert c.wait([s.id(1)], 1.0) == unary.wait([s.id(1)], 1.0) == (True, "")
            value, error = c.fetch(s.id(1), 1.0)
            assert error == "" and value is not None and value.tolist() == [0.0, 1.0, 2.0]
            assert c.waits.opened == 1
        finally:
            for w in (c, unary):
                w.close()
                assert w.join(10)
            s.close()
