"""A session's priority is in the controller's range (pwctl/limits.py MAX_PRIORITY), as a job's is.

The controller took any priority in a session's hello (a job's is checked at submission, its
driver's session gets it through PWCTL_PRIORITY, but any client may say what it likes): now it
refuses one out of range with INVALID_ARGUMENT, in one line, and goes on serving. The `pw`
client read PWCTL_PRIORITY with `int(...)`: a value that is not an integer raised ValueError from
inside the runtime (a traceback, not a pwctl error), one out of range went to the controller; now
both are a one-line InvalidArgument (exit status 2 where pwctl maps it), before anything is opened.
PWCTL_WEIGHT likewise (`float(...)`), and PWCTL_DISPATCH (one of parallel and sequential).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc
from schemas.pathways.v1 import worker_pb2 as wpb
from tests.conftest import REPO, LocalCluster, base_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster(islands=1, devices=1)]

# says a pwctl error as pwctl does (one line, its exit status); anything else goes up as it would
PROGRAM = """\
import sys
import pwctl as pw

try:
    pw.make_virtual_device_set()
except pw.PathwaysError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
print("connected")
"""


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("PWCTL_PRIORITY", "high", "an integer in -1000..1000"),
    ("PWCTL_PRIORITY", "1001", "an integer in -1000..1000"),
    ("PWCTL_PRIORITY", "-3000000000", "an integer in -1000..1000"),
    ("PWCTL_WEIGHT", "heavy", "a number in (0, 1e+06]"),
    ("PWCTL_WEIGHT", "nan", "a number in (0, 1e+06]"),
    ("PWCTL_WEIGHT", "1e7", "a number in (0, 1e+06]"),
    # 0 was taken as "not set" while the message said (0, ...]: refused now, as the message says
    ("PWCTL_WEIGHT", "0", "a number in (0, 1e+06]"),
    ("PWCTL_WEIGHT", "-0.0", "a number in (0, 1e+06]"),
    ("PWCTL_WEIGHT", "1e-400", "a number in (0, 1e+06]"),  # a float of 0
    # the controller refused it after connecting, untyped: "unknown dispatch mode", exit 1
    ("PWCTL_DISPATCH", "eager", "parallel or sequential"),
])
def test_a_bad_session_priority_or_weight_in_the_environment_is_one_line(tmp_path: Path, name: str, value: str,
                                                                         expected: str) -> None:
    env = base_env(tmp_path, PWCTL_SERVER="127.0.0.1:9", **{name: value})  # nobody there: nothing may be sent
    r = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.stderr == f"error: {name}={value!r}: expected {expected}\n", r.stderr[-3000:]
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)


def _hello(priority: int, weight: float = 0.0) -> Iterator[cpb.ClientMessage]:
    yield cpb.ClientMessage(hello=cpb.Hello(client_name="raw", priority=priority, weight=weight))


PRIORITY_ERROR = "session priority {:d} is out of range: use -1000..1000"
WEIGHT_ERROR = "session weight {:g} is out of range: use a number in (0, 1e+06]"


@pytest.mark.parametrize("field,refused,welcomed,error", [
    ("priority", (1001, -1001, 2**31 - 1), (1000, -1000, 0), PRIORITY_ERROR),
    # a job's weight is a finite number in (0, 1e6] (job_files.py); a session's went to the
    # scheduler as sent (0 or less: 1): an infinite one made its share's used time NaN as another
    # client was active (policy.catch_up: 0 * inf), its fair-share order undefined from then on
    ("weight", (float("inf"), float("nan"), -1.0, 1e7), (1e6, 0.5, 0.0), WEIGHT_ERROR),  # 0: not set (1)
])
def test_the_controller_refuses_a_session_priority_or_weight_out_of_range_and_goes_on(
        module_cluster: LocalCluster, field: str, refused: tuple[float, ...], welcomed: tuple[float, ...],
        error: str) -> None:
    def hello(value: float) -> Iterator[cpb.ClientMessage]:
        return _hello(int(value)) if field == "priority" else _hello(0, value)

    channel = module_cluster.channel()
    stub = cgrpc.ControllerStub(channel)
    try:
        for value in refused:
            with pytest.raises(grpc.RpcError) as info:
                next(iter(stub.Session(hello(value), timeout=30)))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert info.value.details() == error.format(value)
        for value in welcomed:  # in range: welcomed, and the controller serves on
            call = stub.Session(hello(value), timeout=30)
            assert next(iter(call)).WhichOneof("msg") == "welcome"
            call.cancel()
        assert stub.GetInfo(cpb.GetInfoRequest(), timeout=10).version
    finally:
        channel.close()
    logs = module_cluster.controller_logs()
    assert "Traceback" not in logs, logs[logs.find("Traceback") - 500:][:3000]


def test_a_session_without_hello_or_with_an_unknown_dispatch_mode_is_invalid_argument(
        module_cluster: LocalCluster) -> None:
    """Refused before the welcome with INVALID_ARGUMENT and the reason in one line, as a bad priority
    is (a `pw` client keeps the type: exit 2); it was a SessionEvent(error=...) on an OK stream,
    which the client could only report as a failed connection (exit 1)."""
    channel = module_cluster.channel()
    stub = cgrpc.ControllerStub(channel)
    cases = [
        (iter([cpb.ClientMessage(hello=cpb.Hello(client_name="raw", dispatch="eager"))]),
         "unknown dispatch mode 'eager': use parallel or sequential"),
        (iter([cpb.ClientMessage(hello=cpb.Hello(client_name="raw", dispatch="x" * 5000))]),
         f"unknown dispatch mode '{'x' * 40}...': use parallel or sequential"),
        (iter([cpb.ClientMessage(release=wpb.ReleaseBuffers())]), "a session starts with a hello message"),
        (iter([]), "a session starts with a hello message"),
    ]
    try:
        for messages, error in cases:
            with pytest.raises(grpc.RpcError) as info:
                next(iter(stub.Session(messages, timeout=30)))
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, error)
        assert stub.GetInfo(cpb.GetInfoRequest(), timeout=10).version
    finally:
        channel.close()
    logs = module_cluster.controller_logs()
    assert "Traceback" not in logs, logs[logs.find("Traceback") - 500:][:3000]
