"""Typed client library over the generated stubs; the CLI and the `pw` API sit on it.

Every call maps gRPC failures to the typed errors of `pwctl.errors`, so callers never
see a raw `grpc.RpcError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

from . import settings
from .errors import ConnectionFailed, from_rpc_error

R = TypeVar("R")

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 512 * 1024 * 1024),
    ("grpc.max_receive_message_length", 512 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]


class Client:
    """A connection to one controller. Cheap to create; close() or use as a context manager."""

    def __init__(self, server: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        target = settings.resolve(server, token)
        self.address = target.address
        self.token = target.token
        self.timeout = timeout
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {target.token}"),) if target.token else ()
        )
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = cgrpc.ControllerStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def call(self, method: Callable[..., R], request: Any, timeout: float | None = None) -> R:
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address) from None

    def stream(self, method: Callable[..., Iterator[R]], request: Any, timeout: float | None = None) -> Iterator[R]:
        try:
            yield from method(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            raise from_rpc_error(e, self.address) from None

    # ---- cluster ----
    def info(self, timeout: float | None = None) -> cpb.ServerInfo:
        return self.call(self.stub.GetInfo, cpb.GetInfoRequest(), timeout)

    def shutdown(self) -> None:
        self.call(self.stub.Shutdown, cpb.ShutdownRequest())

    def islands(self) -> list[Any]:
        return list(self.call(self.stub.ListIslands, cpb.ListIslandsRequest()).islands)

    def hosts(self, island: str = "") -> list[Any]:
        return list(self.call(self.stub.ListHosts, cpb.ListHostsRequest(island=island)).hosts)

    def devices(self, island: str = "") -> list[Any]:
        return list(self.call(self.stub.ListDevices, cpb.ListDevicesRequest(island=island)).devices)

    # ---- slices ----
    def create_slice(self, spec: cpb.SliceSpec, dry_run: bool = False, owner: str = "") -> cpb.CreateSliceResponse:
        return self.call(self.stub.CreateSlice, cpb.CreateSliceRequest(spec=spec, dry_run=dry_run, owner=owner))

    def slices(self, owner: str = "") -> list[cpb.Slice]:
        return list(self.call(self.stub.ListSlices, cpb.ListSlicesRequest(owner=owner)).slices)

    def get_slice(self, name: str) -> cpb.Slice:
        return self.call(self.stub.GetSlice, cpb.GetSliceRequest(name=name))

    def delete_slice(self, name: str, force: bool = False) -> None:
        self.call(self.stub.DeleteSlice, cpb.DeleteSliceRequest(name=name, force=force))

    # ---- jobs ----
    def submit_job(self, request: cpb.SubmitJobRequest) -> cpb.Job:
        return self.call(self.stub.SubmitJob, request)

    def jobs(self, state: str = "", all: bool = False) -> list[cpb.Job]:
        return list(self.call(self.stub.ListJobs, cpb.ListJobsRequest(state=state, all=all)).jobs)

    def get_job(self, job_id: str) -> cpb.Job:
        return self.call(self.stub.GetJob, cpb.GetJobRequest(id=job_id))

    def cancel_job(self, job_id: str) -> cpb.Job:
        return self.call(self.stub.CancelJob, cpb.CancelJobRequest(id=job_id))

    def logs(self, job_id: str, follow: bool = False, tail: int = 0) -> Iterator[cpb.LogChunk]:
        return self.stream(self.stub.StreamLogs, cpb.StreamLogsRequest(id=job_id, follow=follow, tail=tail))

    # ---- observe ----
    def watch(self, interval_s: float = 1.0, timeout: float | None = None) -> Iterator[cpb.ClusterStatus]:
        """The cluster's status now, then every `interval_s` (server-streamed) until closed."""
        return self.stream(self.stub.Watch, cpb.WatchRequest(interval_s=interval_s), timeout)

    def status(self) -> cpb.ClusterStatus:
        """One snapshot: the first message of the Watch stream."""
        stream = self.watch(timeout=self.timeout)
        try:
            for status in stream:
                return status
        finally:
            stream.close()  # type: ignore[attr-defined]
        raise ConnectionFailed(f"the server at {self.address} closed the status stream without an update")

    def trace(self, job: str = "", program: str = "") -> str:
        return self.call(self.stub.GetTrace, cpb.GetTraceRequest(job=job, program=program)).chrome_trace_json
