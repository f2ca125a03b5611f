"""The standard gRPC health service on the controller's and the workers' ports (server/health.py).

A real cluster whose controller requires the token: the health service answers without one (what
Kubernetes' `grpc:` probes send), every other call without it is still UNAUTHENTICATED, and a
watcher sees SERVING, then NOT_SERVING when the server shuts down, then the end of its stream.
"""

from __future__ import annotations

import grpc
import pytest
from conftest import LocalCluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

pytestmark = pytest.mark.timeout(90)


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def watch_until_end(stream: grpc.Future) -> tuple[list[int], grpc.StatusCode | None]:
    """Every status a Watch stream delivered, and how it ended (None: it ended cleanly)."""
    seen: list[int] = []
    try:
        for resp in stream:
            seen.append(resp.status)
    except grpc.RpcError as e:
        return seen, e.code()
    return seen, None


@pytest.mark.cluster(islands=1)
def test_health_serving_without_token_and_only_health(cluster: LocalCluster) -> None:
    assert cluster.token, "the controller requires the token by default"
    assert check(cluster.address) == SERVING
    assert check(cluster.address, "pathways.v1.Controller") == SERVING
    with grpc.insecure_channel(cluster.address) as ch:
        # an unknown service name is NOT_FOUND, as the standard says
        with pytest.raises(grpc.RpcError) as unknown:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # the exemption is the health service alone: the controller's own calls still need the token
        with pytest.raises(grpc.RpcError) as denied:
            cgrpc.ControllerStub(ch).GetInfo(cpb.GetInfoRequest(), timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    worker = cluster.hosts()["w-a"]
    assert check(worker.address) == SERVING
    assert check(worker.address, "pathways.v1.Worker") == SERVING


@pytest.mark.cluster(islands=1)
def test_health_not_serving_on_shutdown(cluster: LocalCluster) -> None:
    worker_address = cluster.hosts()["w-a"].address
    with grpc.insecure_channel(cluster.address) as ctl, grpc.insecure_channel(worker_address) as wk:
        ctl_watch = health_pb2_grpc.HealthStub(ctl).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        wk_watch = health_pb2_grpc.HealthStub(wk).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(ctl_watch).status == SERVING
        assert next(wk_watch).status == SERVING

        cluster.stop_controller()  # SIGTERM: the controller's clean shutdown
        seen, ended = watch_until_end(ctl_watch)
        assert seen == [NOT_SERVING], f"controller watch after SIGTERM: {seen}"
        assert ended in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

        w = cluster.workers["w-a"].proc
        w.terminate()
        w.wait(timeout=30)
        seen, ended = watch_until_end(wk_watch)
        assert seen == [NOT_SERVING], f"worker watch after SIGTERM: {seen}"
        assert ended in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class _GoneCaller:
    """A Watch call's context whose caller is gone: its first write fails the way gRPC's does
    when the peer was killed as the status changed (gRPC's ExecuteBatchError is private)."""

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        self.writes += 1
        raise RuntimeError('Failed "execute_batch": the call is over')


def test_watch_write_to_a_gone_caller_is_a_cancellation() -> None:
    """A Watch whose write fails ends as a cancellation (no traceback logged by gRPC), not with
    the write's error, on the worker's health service too, which no guard interceptor wraps."""
    import asyncio

    from server.health import Health

    async def main() -> None:
        health = Health("pathways.v1.Worker")
        await health.serving()
        gone = _GoneCaller()
        with pytest.raises(asyncio.CancelledError):
            await health._servicer.Watch(health_pb2.HealthCheckRequest(), gone)
        assert gone.writes == 1
        assert health._servicer._watcher_count_by_service == {}  # the watcher left its count

    asyncio.run(main())
