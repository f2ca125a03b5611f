"""The IFRT proxy protocol's message classes, built at run time from the installed jaxlib.

Why run time and not generated stubs: the protocol's client is compiled into the installed jaxlib
(`jaxlib/libjax_common.so`), and the `.proto` files it was built with are embedded in that library
as serialized `FileDescriptorProto`s. Building the classes from exactly those bytes (with
`google.protobuf`'s descriptor pool and message factory) makes the server's messages match the
client that will talk to it by construction, for whatever jaxlib is installed; generated stubs
would be a copy of one jaxlib's protos that a test must compare against the installed one anyway,
and that would go stale at every jaxlib upgrade. The cost is one scan of the library (~0.3 s, done
once per process, lazily, when the first proxy session arrives or `protocol()` is called).

The scan: a serialized `FileDescriptorProto` starts with field 1 (its file name, `0x0a <len>
"....proto"`), and its fields follow in ascending field-number order (how protobuf serializes);
from each such file name we walk the wire format while the fields are `FileDescriptorProto`
fields in order, and keep what parses back to a descriptor with that name.

Versions: `GetVersion` negotiates the highest protocol version both sides support
(`negotiate`), and a client outside the supported range gets a clear error naming both ranges.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

SERVICE_FILE = "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto"
SERVICE_NAME = "xla.ifrt.proxy.GrpcIfrtService"
# Files whose messages travel inside the protocol's opaque bytes fields (compile options,
# the IFRT program and sharding serializations); added to the pool with their closures.
EXTRA_FILES = (
    "xla/pjrt/proto/compile_options.proto",
    "xla/python/ifrt/sharding_serdes.proto",
    "xla/python/pjrt_ifrt/xla_sharding.proto",
)

# The protocol versions this server implements: the semantics it follows (first Execute without
# result handles, status handles only with fill_status, ...) were checked against a client
# speaking version 25 (jaxlib 0.10.2 offers 16-25).
MIN_PROTOCOL_VERSION = 25
MAX_PROTOCOL_VERSION = 25
# IFRT serialization (serdes) versions this server reads: up to 3 (what jaxlib 0.10.2 sends).
MIN_SERDES_VERSION = 0
MAX_SERDES_VERSION = 3

SESSION_METADATA_HEADER = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
HOST_BUFFER_METADATA_HEADER = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"

# FileDescriptorProto's fields: number -> wire type (2 length-delimited, 0 varint).
_FILE_FIELDS = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 14: 0}


class ProtocolError(Exception):
    """The installed jaxlib does not carry the protocol, or a client's versions are unsupported."""


def _varint(buf: Any, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _file_end(buf: Any, start: int) -> int:
    """Where the FileDescriptorProto that starts at `start` ends (see the module docstring)."""
    i, last = start, 0
    while i < len(buf):
        try:
            tag, j = _varint(buf, i)
            number, wire = tag >> 3, tag & 7
            if _FILE_FIELDS.get(number) != wire or number < last or (number == 1 and last == 1):
                break
            size, j = _varint(buf, j)
            if wire == 2:
                j += size
                if j > len(buf):
                    break
        except ValueError:
            break
        last, i = number, j
    return i


def scan_file_descriptors(library: Path) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """Every serialized FileDescriptorProto embedded in `library`, by file name (first wins)."""
    found: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0
        while (k := buf.find(b".proto", pos)) >= 0:
            pos = k + 1
            end_of_name = k + len(b".proto")
            for length in range(7, 128):  # a one-byte length: names are shorter than 128
                s = end_of_name - length
                if s < 2 or not 32 < buf[s] < 127:
                    break
                if buf[s - 1] != length or buf[s - 2] != 0x0A:
                    continue
                name = bytes(buf[s:end_of_name]).decode("ascii", "replace")
                try:
                    fd = descriptor_pb2.FileDescriptorProto.FromString(buf[s - 2 : _file_end(buf, s - 2)])
                except message.DecodeError:
                    break
                if fd.name == name and (fd.package or fd.message_type) and name not in found:
                    found[name] = fd
                break
    return found


def jaxlib_library() -> Path:
    """The installed jaxlib's shared library that embeds the IFRT proxy client and its protos."""
    import jaxlib

    path = Path(jaxlib.__file__).parent / "libjax_common.so"
    if not path.exists():
        raise ProtocolError(f"{path} not found: this jaxlib does not ship the IFRT proxy client")
    return path


@dataclass(frozen=True)
class Protocol:
    """A descriptor pool holding the protocol's closure, and its message classes by full name."""

    pool: descriptor_pool.DescriptorPool
    files: tuple[str, ...]
    _classes: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # by full name

    def cls(self, full_name: str) -> Any:
        """The message class for `full_name`, e.g. `xla.ifrt.proxy.IfrtRequest` (typed Any: built at run
        time, so no static type exists); looked up once (handlers ask on every request)."""
        found = self._classes.get(full_name)
        if found is None:
            found = self._classes[full_name] = message_factory.GetMessageClass(
                self.pool.FindMessageTypeByName(full_name))
        return found

    def __getattr__(self, name: str) -> Any:
        """`proto.IfrtRequest` for `xla.ifrt.proxy.IfrtRequest` (the protocol's own package)."""
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.cls(f"xla.ifrt.proxy.{name}")
        except KeyError:
            raise AttributeError(name) from None


def build(descriptors: dict[str, descriptor_pb2.FileDescriptorProto]) -> Protocol:
    """A Protocol from scanned descriptors: the service file, `EXTRA_FILES`, and their imports."""
    pool = descriptor_pool.DescriptorPool()
    added: list[str] = []

    def add(name: str) -> None:
        if name in added:
            return
        fd = descriptor_pool.Default().FindFileByName(name) if name not in descriptors else None
        if fd is not None:  # a well-known type the library did not embed: Python's own copy
            proto = descriptor_pb2.FileDescriptorProto()
            fd.CopyToProto(proto)
        else:
            proto = descriptors[name]
        for dep in proto.dependency:
            add(dep)
        pool.Add(proto)
        added.append(name)

    if SERVICE_FILE not in descriptors:
        raise ProtocolError(f"the installed jaxlib embeds no {SERVICE_FILE}: it has no IFRT proxy client")
    try:
        for name in (SERVICE_FILE, *EXTRA_FILES):
            if name in descriptors or name == SERVICE_FILE:
                add(name)
    except KeyError as e:
        raise ProtocolError(f"the installed jaxlib's protos are incomplete: {e}") from None
    return Protocol(pool=pool, files=tuple(added))


_lock = threading.Lock()
_protocol: Protocol | None = None


def protocol() -> Protocol:
    """The process's Protocol, built from the installed jaxlib on first use."""
    global _protocol
    with _lock:
        if _protocol is None:
            _protocol = build(scan_file_descriptors(jaxlib_library()))
        return _protocol


@dataclass(frozen=True)
class Version:
    protocol_version: int
    serdes_version: int


def negotiate(client_min: Version, client_max: Version) -> Version:
    """The highest versions both sides speak, or ProtocolError naming both ranges."""
    proto_v = min(client_max.protocol_version, MAX_PROTOCOL_VERSION)
    if proto_v < max(client_min.protocol_version, MIN_PROTOCOL_VERSION):
        raise ProtocolError(
            f"IFRT proxy protocol versions {client_min.protocol_version}-{client_max.protocol_version} offered by "
            f"the client; this server speaks {MIN_PROTOCOL_VERSION}-{MAX_PROTOCOL_VERSION}: use a jaxlib whose "
            "proxy client speaks one of them (0.10.2 does)"
        )
    serdes = min(client_max.serdes_version, MAX_SERDES_VERSION)
    if serdes < max(client_min.serdes_version, MIN_SERDES_VERSION):
        raise ProtocolError(
            f"IFRT serialization versions {client_min.serdes_version}-{client_max.serdes_version} offered by the "
            f"client; this server reads {MIN_SERDES_VERSION}-{MAX_SERDES_VERSION}"
        )
    return Version(proto_v, serdes)
