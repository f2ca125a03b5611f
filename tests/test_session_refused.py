"""A session the controller refuses before its welcome reaches the `pw` program as the controller's
refusal: its one-line reason, its type and so its exit status (pwctl/errors.py: a usage error 2, a
refusal 4), as pwctl's own commands say it.

The runtime kept only the refusal's text, raised as ConnectionFailed (exit status 1), as if the
controller were not there: a driver acting as a job it is not (PermissionDenied: no job secret), a
wrong token (Unauthenticated), like the INVALID_ARGUMENT of a priority or weight out of the
controller's range, lost what they were.

Real processes: a controller and a worker, the `pw` program in its own process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pwctl.errors import EXIT_REJECTED
from tests.conftest import REPO, LocalCluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

# says a pwctl error as pwctl does (one line, its exit status); anything else goes up as it would
PROGRAM = """\
import sys
import pwctl as pw

try:
    pw.make_virtual_device_set()
except pw.PathwaysError as e:
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
print("connected")
"""


@pytest.mark.parametrize(("extra", "expected"), [
    ({"PWCTL_JOB_ID": "job-nope"}, "PermissionDenied: this session cannot act as job 'job-nope': only the job's "
                                   "driver can, with the secret the controller gave it ($PWCTL_JOB_SECRET)"),
    ({"PWCTL_TOKEN": "not-the-token"}, "Unauthenticated: the server at {address} rejected the call: missing or "
                                       "wrong token"),
])
def test_a_session_refused_before_its_welcome_says_the_controllers_reason_and_exit_status(
        module_cluster: LocalCluster, extra: dict[str, str], expected: str) -> None:
    env = module_cluster.env(**extra)
    r = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    # before: 'error: ConnectionFailed: ...' (the reason's text only), exit status 1
    expected = expected.format(address=module_cluster.address)
    assert r.stderr.startswith(f"error: {expected}") and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.returncode == EXIT_REJECTED and r.stdout == "", (r.returncode, r.stdout)
