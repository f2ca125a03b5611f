"""`pwctl server start` (and `up`) when the controller it spawned does not answer in time: the
process is stopped, not left running where `pwctl server stop` cannot find it (its pid file is
written only once it listens)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import free_port

from pwctl import paths
from pwctl.errors import PathwaysError
from pwctl.local import controller


@pytest.mark.timeout(60)
def test_a_controller_that_does_not_answer_in_time_is_stopped(pw_home: Path) -> None:
    db = f"sqlite:///{pw_home / 'pw.db'}"
    proc, offset = controller._spawn_controller(f"127.0.0.1:{free_port()}", db, "parallel", 5.0, ["--no-token"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # it cannot answer, nor write its pid file
        with pytest.raises(PathwaysError) as e:
            controller._wait_controller(proc, offset, db, timeout=1.0)
        assert f"the controller (pid {proc.pid}) did not answer within 1 s and was stopped" in str(e.value)
        assert proc.poll() is not None, "the controller that did not answer is still running"
        assert not paths.server_pid_path().exists()
        assert controller.running_controller() is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
