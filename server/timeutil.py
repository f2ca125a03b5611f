"""UTC timestamps as the wire and the JSON views carry them (ISO-8601, 'Z')."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(dt: datetime | None) -> str:
    if dt is None:
        return ""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def now_iso() -> str:
    return iso(datetime.now(UTC))
