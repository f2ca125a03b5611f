"""A run that fails before it started (here cancelled by its client while it waited for
admission) takes the runs submitted already that read its outputs with it: the reader on the
other island, admitted as soon as it failed, fails within seconds naming it (the controller
drops it on its worker) instead of waiting there for the input until the hang timeout, holding
that island's gang order for the runs behind it (server/controller/dispatch.py `_fail_readers`).

Real processes: a controller with a window of one node per island and a 30 s hang timeout, a
worker on island a (frozen with SIGSTOP, so that the run it holds never finishes and the
producer behind it waits) and one on island b, and a `pw` program in its own process."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from test_scheduling import ClientProc

pytestmark = pytest.mark.timeout(120)


@pytest.mark.cluster(islands=2, devices=1, controller_args=["--window", "1", "--hang-timeout", "30"],
                     heartbeat_timeout=60)
def test_a_reader_on_another_island_fails_at_once_with_the_run_that_failed_before_it_started(
        cluster: LocalCluster, tmp_path: Path) -> None:
    client = ClientProc(cluster, "never_made.py", str(tmp_path))
    try:
        wait_for(lambda: (tmp_path / "ready").exists() or client.proc.poll() is not None, 60, "the client warmed up")
        cluster.stop_worker("w-a")  # frozen, but its connection (and, for 60 s, its heartbeat) stay
        try:
            (tmp_path / "go").write_text("go")
            wait_for(lambda: (tmp_path / "failed").exists() or client.proc.poll() is not None, 45,
                     "the reader to fail")
        finally:
            cluster.cont_worker("w-a")
            (tmp_path / "go2").write_text("go")
            out = client.result(timeout=60)
    finally:
        client.kill()
    reader = out["reader"]
    first = f"run {out['made_run']:#x} that computes it failed before it started: input buffer "
    assert reader.startswith("ProgramError: input 0 (buffer ") and first in reader, out
    assert "of this run was lost: test: given up" in reader and "hang detected" not in reader, out
    assert out["reader_s"] < 5, out  # at once, not at the hang timeout (30 s)
    assert out["next_on_b"] == [[2.0] * 4] and out["next_on_b_s"] < 10, out  # not held behind the reader
    assert out["held"] == [[1.0] * 4], out
