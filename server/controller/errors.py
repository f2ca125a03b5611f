"""Errors the controller's components raise; the servicer maps them to gRPC status codes."""

from __future__ import annotations

import grpc


class ControllerError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(ControllerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ControllerError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ControllerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Rejected(ControllerError):
    """Cannot be done now: capacity, in use, a precondition."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InUse(ControllerError):
    code = grpc.StatusCode.FAILED_PRECONDITION
