"""Sizes and durations as operators write them on the command line ('512MiB', '24h'): parsed
the same way by `pwctl server start` (which refuses a bad value before it starts anything) and by
the controller."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '100MB', '0' (off), '1000000' -> bytes; ValueError with a readable message."""
    t = text.strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}
    number = t.rstrip("kKmMgGiIbB")
    unit = t[len(number):].lower()
    if unit not in units or not number.replace(".", "", 1).isdigit():
        raise ValueError(f"invalid size {text!r}: expected e.g. 512MiB, 2GiB or a number of bytes")
    return int(float(number) * units[unit])


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '24h', '7d' -> seconds; raises ValueError with a readable message."""
    t = text.strip().lower()
    scale = _UNITS.get(t[-1:])
    number = t[:-1] if scale is not None else t
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise ValueError(f"invalid duration {text!r}: expected e.g. 90s, 30m, 24h, 7d or 0") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"invalid duration {text!r}: must be a finite number, 0 or more")
    return value
