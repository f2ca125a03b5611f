"""Typed client library over the generated stubs; the CLI and the `pw` API sit on it.

Every call maps gRPC failures to the typed errors of `pwctl.errors`, so callers never
see a raw `grpc.RpcError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

from . import settings
from .errors import ConnectionFailed, Unavailable
from .tls import TlsConfig
from .transport import DEFAULT_RETRY, BidiStream, RetryPolicy, Transport

R = TypeVar("R")
# hosts or devices per ListHosts / ListDevices answer: the server's largest page (limits.MAX_PAGE),
# ~520 KiB of devices or ~700 KiB of hosts; 8,192 devices in one answer instead of two (one fewer
# round trip and server pass: 8.7 -> 6.0 ms at 2,048 hosts)
PAGE = 10_000


class Client:
    """A connection to one controller. Cheap to create; close() or use as a context manager.

    Every call goes through one `Transport` (typed errors, retries of idempotent reads)."""

    def __init__(self, server: str | None = None, token: str | None = None, timeout: float = 30.0,
                 retry: RetryPolicy = DEFAULT_RETRY, tls: TlsConfig | None = None,
                 own_connection: bool = False) -> None:
        target = settings.resolve(server, token)
        self.address = target.address
        self.token = target.token
        self.tls = tls or target.tls  # TLS as `settings` finds it, unless given (pwctl/tls.py)
        self.timeout = timeout
        self._transport = Transport(self.address, target.token, timeout=timeout, retry=retry, tls=self.tls,
                                    own_connection=own_connection)
        self._stub = cgrpc.ControllerStub(self._transport.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._transport.metadata

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._transport.close()

    def _read(self, method: Callable[..., R], request: Any, timeout: float | None = None) -> R:
        """An idempotent read: retried while the server is unavailable, within the timeout."""
        return self._transport.unary(method, request, timeout=timeout, idempotent=True)

    def _write(self, method: Callable[..., R], request: Any, timeout: float | None = None) -> R:
        """A call with an effect: never retried."""
        return self._transport.unary(method, request, timeout=timeout)

    def session(self, requests: Iterator[cpb.ClientMessage]) -> BidiStream[cpb.SessionEvent]:
        """Opens the program session (the `pw` runtime's stream), fed by `requests`."""
        return self._transport.bidi(self._stub.Session, requests)

    # ---- cluster ----
    def info(self, timeout: float | None = None) -> cpb.ServerInfo:
        return self._read(self._stub.GetInfo, cpb.GetInfoRequest(), timeout)

    def shutdown(self) -> None:
        self._write(self._stub.Shutdown, cpb.ShutdownRequest())

    def islands(self) -> list[Any]:
        return list(self._read(self._stub.ListIslands, cpb.ListIslandsRequest()).islands)

    def hosts(self, island: str = "", state: int = 0, limit: int = 0) -> list[Any]:
        """Hosts sorted by (island, name): all of them, or the first `limit`; `state` a HostState
        (0: any). Read a page at a time, so that no answer grows with the cluster."""
        return self.hosts_page(island, state, limit)[0]

    def hosts_page(self, island: str = "", state: int = 0, limit: int = 0) -> tuple[list[Any], int]:
        """`hosts`, and how many match over all pages."""
        return self._pages(self._stub.ListHosts, "hosts", limit, island=island, state=state)

    def devices(self, island: str = "", state: int = 0, limit: int = 0) -> list[Any]:
        """Devices sorted by (island, host, local index); as `hosts`, with a DeviceState."""
        return self.devices_page(island, state, limit)[0]

    def devices_page(self, island: str = "", state: int = 0, limit: int = 0) -> tuple[list[Any], int]:
        return self._pages(self._stub.ListDevices, "devices", limit, island=island, state=state)

    def _pages(self, method: Any, field: str, limit: int, **filters: Any) -> tuple[list[Any], int]:
        request = cpb.ListHostsRequest if field == "hosts" else cpb.ListDevicesRequest
        out: list[Any] = []
        token = ""
        while True:
            page = min(PAGE, limit - len(out)) if limit else PAGE
            reply = self._read(method, request(limit=page, page_token=token, **filters))
            out += getattr(reply, field)
            token = reply.next_page_token
            if not token or (limit and len(out) >= limit):
                return out, reply.total

    def delete_host(self, name: str, force: bool = False) -> None:
        self._write(self._stub.DeleteHost, cpb.DeleteHostRequest(name=name, force=force))

    def delete_island(self, name: str) -> None:
        self._write(self._stub.DeleteIsland, cpb.DeleteIslandRequest(name=name))

    # ---- slices ----
    def create_slice(self, spec: cpb.SliceSpec, dry_run: bool = False, owner: str = "") -> cpb.CreateSliceResponse:
        return self._write(self._stub.CreateSlice, cpb.CreateSliceRequest(spec=spec, dry_run=dry_run, owner=owner))

    def slices(self, owner: str = "") -> list[cpb.Slice]:
        return list(self._read(self._stub.ListSlices, cpb.ListSlicesRequest(owner=owner)).slices)

    def get_slice(self, name: str, timeout: float | None = None) -> cpb.Slice:
        return self._read(self._stub.GetSlice, cpb.GetSliceRequest(name=name), timeout)

    def delete_slice(self, name: str, force: bool = False) -> None:
        self._write(self._stub.DeleteSlice, cpb.DeleteSliceRequest(name=name, force=force))

    # ---- jobs ----
    def submit_job(self, request: cpb.SubmitJobRequest) -> cpb.Job:
        return self._write(self._stub.SubmitJob, request)

    def jobs(self, state: str = "", all: bool = False) -> list[cpb.Job]:
        return list(self._read(self._stub.ListJobs, cpb.ListJobsRequest(state=state, all=all)).jobs)

    def get_job(self, job_id: str) -> cpb.Job:
        return self._read(self._stub.GetJob, cpb.GetJobRequest(id=job_id))

    def cancel_job(self, job_id: str) -> cpb.Job:
        return self._write(self._stub.CancelJob, cpb.CancelJobRequest(id=job_id))

    def logs(self, job_id: str, follow: bool = False, tail: int = 0) -> Iterator[cpb.LogChunk]:
        request = cpb.StreamLogsRequest(id=job_id, follow=follow, tail=tail)
        return self._transport.server_stream(self._stub.StreamLogs, request)

    # ---- observe ----
    def watch(self, interval_s: float = 1.0, timeout: float | None = None, device_limit: int = 0,
              page_token: str = "", queue_limit: int = 0) -> Iterator[cpb.ClusterStatus]:
        """The cluster's status now, then every `interval_s` (server-streamed) until closed; with
        `device_limit`, one page of devices from `page_token` on; with `queue_limit`, at most
        that many entries per island queue (the counts cover every gang)."""
        request = cpb.WatchRequest(interval_s=interval_s, device_limit=device_limit, page_token=page_token,
                                   queue_limit=queue_limit)
        return self._transport.server_stream(self._stub.Watch, request, timeout)

    def status(self, device_limit: int = 0, page_token: str = "", queue_limit: int = 0) -> cpb.ClusterStatus:
        """One snapshot: the first message of the Watch stream (an idempotent read, so retried
        while the server is unavailable, like the other reads)."""
        retry = self._transport.retry
        attempt = 1
        while True:
            stream = self.watch(timeout=self.timeout, device_limit=device_limit, page_token=page_token,
                                queue_limit=queue_limit)
            try:
                for status in stream:
                    return status
                raise ConnectionFailed(f"the server at {self.address} closed the status stream without an update")
            except Unavailable:
                if attempt >= retry.max_attempts:
                    raise
            finally:
                stream.close()  # type: ignore[attr-defined]
            time.sleep(retry.backoff(attempt))
            attempt += 1

    def trace(self, job: str = "", program: str = "") -> str:
        return self._read(self._stub.GetTrace, cpb.GetTraceRequest(job=job, program=program)).chrome_trace_json

    def trace_window(self, job: str = "", program: str = "", since_unix_ns: int = 0,
                     last: int = 0) -> cpb.TraceResponse:
        """A trace of the node runs that ended since `since_unix_ns` (0: any), the last `last` (0: all
        the controller returns); the answer also says how many the selection had in all."""
        return self._read(self._stub.GetTrace, cpb.GetTraceRequest(job=job, program=program,
                                                                   since_unix_ns=since_unix_ns, last=last))

