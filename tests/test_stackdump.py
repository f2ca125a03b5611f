"""`kill -USR1` on a controller or a worker writes every thread's stack to its log and the
process goes on serving (server/stackdump.py)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import LocalCluster, wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.mark.cluster(islands=1, devices=1)
def test_sigusr1_dumps_every_threads_stack_and_the_processes_go_on(cluster: LocalCluster) -> None:
    worker = cluster.workers["w-a"]
    assert cluster.controller is not None
    os.kill(cluster.controller.pid, signal.SIGUSR1)
    os.kill(worker.pid, signal.SIGUSR1)
    wait_for(lambda: "most recent call first" in cluster.controller_logs(), 10, "the controller's stacks")
    wait_for(lambda: "most recent call first" in worker.log.read_text(errors="replace"), 10, "the worker's stacks")
    # both still serve: the worker is ready with the same pid, the controller answers
    assert cluster.wait_ready(["w-a"])["w-a"].pid == worker.pid
    assert "Traceback" not in cluster.controller_logs()
