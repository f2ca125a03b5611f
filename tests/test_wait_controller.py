"""The test clusters' wait for their controller (tests/conftest.py `LocalCluster.wait_controller`):
a controller still starting after the wait's `timeout` (a loaded machine) is waited for while it
makes progress; one that makes none fails after `timeout`; one that exited fails at once, with
its log's tail."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import LocalCluster

# what Python runs in place of `-m server.controller` (its flags follow): first something of its
# own, then the controller itself
_THEN_CONTROLLER = "import runpy; runpy.run_module('server.controller', run_name='__main__', alter_sys=True)"
BUSY_START = ("import time\nend = time.monotonic() + 4\nwhile time.monotonic() < end:\n    pass\n"
              + _THEN_CONTROLLER)  # busy for 4 s: a slow start, making progress
HUNG_START = "import time; time.sleep(600)"  # alive, no CPU time, no log
FAILED_START = "import sys; print('the controller could not start: boom', flush=True); sys.exit(3)"


def test_a_controller_slow_to_start_but_busy_is_waited_for(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c") as c:
        c.start_controller(wait=False, program=("-c", BUSY_START))
        started = time.monotonic()
        c.wait_controller(timeout=2.0)  # the old wait: a TimeoutError after 2 s
        assert time.monotonic() - started > 3.0
        with c.client() as client:
            client.info()


def test_a_controller_that_makes_no_progress_fails_after_the_timeout(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c") as c:
        c.start_controller(wait=False, program=("-c", HUNG_START))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not answer \(no progress for 2 s"):
            c.wait_controller(timeout=2.0, cap=60.0)
        assert time.monotonic() - started < 10


def test_a_controller_that_exited_fails_at_once_with_its_log(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c") as c:
        c.start_controller(wait=False, program=("-c", FAILED_START))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?s)controller exited with 3:.*could not start: boom"):
            c.wait_controller(timeout=30.0)
        assert time.monotonic() - started < 10
