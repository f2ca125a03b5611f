"""Typed SQLAlchemy 2.x models of everything the controller persists.

The schema only changes through Alembic revisions in `migrations/versions`; a test
checks that the models and the migrated database agree.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


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
