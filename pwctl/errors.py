"""Typed client errors and the one place gRPC status codes map to them (and to exit codes)."""

from __future__ import annotations

import grpc

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_REJECTED = 4


class PathwaysError(Exception):
    """Base of every error the client library raises; `exit_code` is what pwctl exits with."""

    exit_code = EXIT_FAILED


class ConnectionFailed(PathwaysError):
    exit_code = EXIT_FAILED


class InvalidArgument(PathwaysError):
    exit_code = EXIT_USAGE


class NotFound(PathwaysError):
    exit_code = EXIT_NOT_FOUND


class Rejected(PathwaysError):
    """Capacity, conflicts, preconditions, authentication: the server said no."""

    exit_code = EXIT_REJECTED


class Unauthenticated(Rejected):
    pass


class ProgramError(PathwaysError):
    """A computation failed; the message carries the cause from the worker."""


_BY_CODE: dict[grpc.StatusCode, type[PathwaysError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: Rejected,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Rejected,
    grpc.StatusCode.FAILED_PRECONDITION: Rejected,
    grpc.StatusCode.PERMISSION_DENIED: Rejected,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def from_rpc_error(err: grpc.RpcError, address: str) -> PathwaysError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else "") or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionFailed(f"cannot reach the server at {address}: is it running? try `pwctl up`")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ConnectionFailed(f"the server at {address} did not answer in time")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(
            f"the server at {address} rejected the call: {details or 'missing token'} "
            "(set PWCTL_TOKEN to the server's token)"
        )
    cls = _BY_CODE.get(code, PathwaysError)
    return cls(details or code.name.lower())
