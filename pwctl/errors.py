"""Typed client errors, the one place gRPC status codes map to them, and the CLI's exit codes.

Every error the client library raises is a `PathwaysError`. One raised for a failed RPC keeps the
gRPC status (`code`) and the server's message (`details`); its class says what callers act on:

    PathwaysError                 exit 1   (UNKNOWN, INTERNAL, ...: the code is kept)
    ├── ConnectionFailed          exit 1
    │   ├── Unavailable           exit 1   UNAVAILABLE: the peer is down or unreachable
    │   └── DeadlineExceeded      exit 1   DEADLINE_EXCEEDED
    ├── InvalidArgument           exit 2   INVALID_ARGUMENT, OUT_OF_RANGE
    ├── NotFound                  exit 3   NOT_FOUND
    ├── Rejected                  exit 4   the server said no:
    │   ├── AlreadyExists                  ALREADY_EXISTS (conflict)
    │   ├── ResourceExhausted              RESOURCE_EXHAUSTED (capacity, limits)
    │   ├── FailedPrecondition             FAILED_PRECONDITION (state conflict)
    │   ├── PermissionDenied               PERMISSION_DENIED
    │   └── Unauthenticated                UNAUTHENTICATED
    └── ProgramError              exit 1   a computation failed (the worker's cause)

`exit_code_for` is the CLI's table; `PathwaysError.exit_code` reads it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # gRPC loads with the first RPC's error: `pwctl --help` and friends do not need it
    import grpc

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_REJECTED = 4
EXIT_TIMEOUT = 124  # `wait --timeout` expired, as timeout(1) exits
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class PathwaysError(Exception):
    """Base of every error the client library raises.

    `code` is the gRPC status the server (or the channel) gave, None when the error did not come
    from an RPC; `details` is the server's own message."""

    def __init__(self, message: str = "", *, code: grpc.StatusCode | None = None, details: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.details = details

    @property
    def exit_code(self) -> int:
        """What `pwctl` exits with for this error."""
        return exit_code_for(self)


class ConnectionFailed(PathwaysError):
    """The peer could not be reached or did not answer."""


class Unavailable(ConnectionFailed):
    pass


class DeadlineExceeded(ConnectionFailed):
    pass


class InvalidArgument(PathwaysError):
    pass


class NotFound(PathwaysError):
    pass


class Rejected(PathwaysError):
    """Capacity, conflicts, preconditions, authentication: the server said no."""


class AlreadyExists(Rejected):
    pass


class ResourceExhausted(Rejected):
    pass


class FailedPrecondition(Rejected):
    pass


class PermissionDenied(Rejected):
    pass


class Unauthenticated(Rejected):
    pass


class ProgramError(PathwaysError):
    """A computation failed; the message carries the cause from the worker."""


# The CLI's exit codes, by the first class of an error's MRO found here.
_EXIT_CODES: dict[type[PathwaysError], int] = {
    InvalidArgument: EXIT_USAGE,
    NotFound: EXIT_NOT_FOUND,
    Rejected: EXIT_REJECTED,
    PathwaysError: EXIT_FAILED,
}


def exit_code_for(err: BaseException) -> int:
    for cls in type(err).__mro__:
        code = _EXIT_CODES.get(cls)
        if code is not None:
            return code
    return EXIT_FAILED


@functools.cache
def _by_code() -> dict[grpc.StatusCode, type[PathwaysError]]:
    import grpc

    return {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
        grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
        grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
        grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
        grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
        grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    }


@functools.cache
def _by_number() -> dict[int, grpc.StatusCode]:
    import grpc

    return {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC status whose number is `number`, for a status a message carries (worker.proto
    `WaitReply.code`); UNKNOWN for a number gRPC does not define."""
    import grpc

    return _by_number().get(number, grpc.StatusCode.UNKNOWN)


def from_rpc_error(err: grpc.RpcError, address: str, peer: str = "server") -> PathwaysError:
    """The typed error for a failed RPC to `peer` ("server", "worker") at `address`."""
    import grpc

    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code: grpc.StatusCode = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details: str = (details_fn() if callable(details_fn) else "") or ""
    return from_status(code, details, address, peer)


def from_status(code: grpc.StatusCode, details: str, address: str, peer: str = "server") -> PathwaysError:
    """The typed error for status `code` with message `details` from `peer` at `address` (a
    failed RPC's, or a refusal a stream carries as a message: worker.proto `WaitReply.code`)."""
    import grpc

    cls = _by_code().get(code, PathwaysError)
    if code == grpc.StatusCode.UNAVAILABLE:
        advice = ": is it running? try `pwctl up`" if peer == "server" else " (host lost?)"
        message = f"cannot reach the {peer} at {address}{advice}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"the {peer} at {address} did not answer in time"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        message = (f"the {peer} at {address} rejected the call: {details or 'missing token'} "
                   "(set PWCTL_TOKEN to the server's token)")
    else:
        message = details or code.name.lower()
    return cls(message, code=code, details=details)
