"""Typed SQLAlchemy 2.x models of everything the controller persists.

The schema only changes through Alembic revisions in `migrations/versions`; a test
checks that the models and the migrated database agree.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

if TYPE_CHECKING:
    from pydantic import TypeAdapter


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class IslandRow(Base):
    """Devices joined by a fast interconnect; collectives run only inside one."""

    __tablename__ = "islands"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    hosts: Mapped[list[HostRow]] = relationship(back_populates="island")


class HostRow(Base):
    """One worker process; `name` is its stable identity across restarts."""

    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    island_id: Mapped[int] = mapped_column(ForeignKey("islands.id"))
    address: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))  # "ready" | "lost"
    pid: Mapped[int] = mapped_column(Integer, default=0)
    device_kind: Mapped[str] = mapped_column(String(16))
    machine_id: Mapped[str] = mapped_column(String(128), default="")
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)
    # SHA-256 hex digest of the credential the host proves itself with (NULL: from before 0006)
    credential_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)

    island: Mapped[IslandRow] = relationship(back_populates="hosts")
    devices: Mapped[list[DeviceRow]] = relationship(back_populates="host", order_by="DeviceRow.local_index")


class DeviceRow(Base):
    """One accelerator (or virtual CPU device) of a host."""

    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("host_id", "local_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id"))
    local_index: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))  # "available" | "lost"

    host: Mapped[HostRow] = relationship(back_populates="devices")


# JSON columns hold plain lists; every read goes through a pydantic adapter so a malformed value
# fails loudly instead of flowing into the resource manager. The adapters are built on first use:
# pydantic is about a tenth of the controller's start-up imports, and a fresh database has no rows.
@functools.cache
def _list_adapter(item: type) -> TypeAdapter[list[Any]]:
    from pydantic import TypeAdapter

    return TypeAdapter(list[item])  # type: ignore[valid-type]


def int_list(value: object) -> list[int]:
    """Validates a JSON column value as a list of ints (pydantic, strict about shape)."""
    return _list_adapter(int).validate_python(value)


class SliceRow(Base):
    """A virtual slice: the request it was made from and its state; the mapping is in SliceDeviceRow.

    `mesh` is a JSON list of ints or NULL (a 1-D mesh of `devices`); `island` and `kind` are ""
    when the request left them open. `status` is "ready" | "remapped" | "degraded"; `generation`
    grows on every remap or restore.
    """

    __tablename__ = "slices"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    owner: Mapped[str] = mapped_column(String(128), default="")
    devices: Mapped[int] = mapped_column(Integer)
    mesh: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    island: Mapped[str] = mapped_column(String(64), default="")
    kind: Mapped[str] = mapped_column(String(16), default="")
    exclusive: Mapped[bool] = mapped_column(Boolean, default=False)
    host_axis: Mapped[int | None] = mapped_column(Integer, nullable=True)  # mesh axis across hosts
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    generation: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    mapping: Mapped[list[SliceDeviceRow]] = relationship(
        back_populates="slice", order_by="SliceDeviceRow.virtual_index", cascade="all, delete-orphan"
    )
    remaps: Mapped[list[SliceRemapRow]] = relationship(
        back_populates="slice", order_by="SliceRemapRow.id", cascade="all, delete-orphan"
    )

    def mesh_shape(self) -> tuple[int, ...] | None:
        return None if self.mesh is None else tuple(int_list(self.mesh))


class SliceDeviceRow(Base):
    """Virtual device `virtual_index` of a slice maps to physical device `device_id`."""

    __tablename__ = "slice_devices"
    __table_args__ = (UniqueConstraint("slice_id", "virtual_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    slice_id: Mapped[int] = mapped_column(ForeignKey("slices.id", ondelete="CASCADE"), index=True)
    virtual_index: Mapped[int] = mapped_column(Integer)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)

    slice: Mapped[SliceRow] = relationship(back_populates="mapping")


class SliceRemapRow(Base):
    """One remap of a slice: when, why, and the mapping before and after (JSON lists of device ids)."""

    __tablename__ = "slice_remaps"

    id: Mapped[int] = mapped_column(primary_key=True)
    slice_id: Mapped[int] = mapped_column(ForeignKey("slices.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    reason: Mapped[str] = mapped_column(Text, default="")
    old_devices: Mapped[list[int]] = mapped_column(JSON)
    new_devices: Mapped[list[int]] = mapped_column(JSON)

    slice: Mapped[SliceRow] = relationship(back_populates="remaps")


def str_list(value: object) -> list[str]:
    """Validates a JSON column value as a list of strings."""
    return _list_adapter(str).validate_python(value)


class JobRow(Base):
    """A submitted driver script (`pwctl submit`) and how it ended.

    `state` is pending | running | succeeded | failed | cancelled. `exit_code` is NULL until the
    driver exited by itself (a driver killed by a signal has none; `reason` names the signal).
    `args` and `slices` are JSON lists of strings; `slices` is every slice the job owned or used.
    Program and run counts live in `programs` (owner "job:<id>").
    """

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    state: Mapped[str] = mapped_column(String(16), index=True)
    entrypoint: Mapped[str] = mapped_column(String(256))
    args: Mapped[list[str]] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    pid: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    slices: Mapped[list[str]] = mapped_column(JSON)
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True)


class ProgramRow(Base):
    """A program registered by one owner (client:<id> or job:<id>) and its run history.

    One row per (program_id, owner): the same graph registered by two owners is two rows.
    Counters are flushed in batches from memory, never per run.
    """

    __tablename__ = "programs"
    __table_args__ = (UniqueConstraint("program_id", "owner"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    program_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    owner: Mapped[str] = mapped_column(String(128), index=True)
    nodes: Mapped[int] = mapped_column(Integer, default=0)
    slices: Mapped[list[str]] = mapped_column(JSON)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    runs: Mapped[int] = mapped_column(Integer, default=0)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    last_run_at: Mapped[datetime | None] = mapped_column(nullable=True)


class ClientSessionRow(Base):
    """A `pw` client's session (one stream per client process or job driver), kept so that the
    session can resume when the controller restarts: its id and id prefix, and a hash of the
    resume token only the client holds. Deleted when the session ends; rows left by a crashed
    controller are resumable for the grace period after the next one starts
    (server/controller/session_store.py)."""

    __tablename__ = "client_sessions"

    client_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    id_prefix: Mapped[int] = mapped_column(Integer)
    token_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(String(32), default="")
    name: Mapped[str] = mapped_column(String(128), default="")
    opened_at: Mapped[datetime] = mapped_column(default=utcnow)


class CounterRow(Base):
    """A named sequence that must never go back, across controller restarts too.

    `slice_auto_seq`: the highest N of an automatic slice name "slice-N" ever given. A deleted
    slice's row is gone, so without it a restarted controller could give a deleted slice's name
    to a new slice, and a function still bound to the old one would reach the new one.
    """

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(Integer)
