"""A job's files: its entrypoint's path, its working directory (an uploaded zip) and its log.

Every limit here bounds what one request can make the controller write or read.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import zipfile
from pathlib import Path, PurePosixPath

from .errors import InvalidArgument

MAX_SCRIPT_BYTES = 10 * 1024 * 1024
MAX_ZIP_BYTES = 50 * 1024 * 1024
MAX_UNZIPPED_BYTES = 500 * 1024 * 1024  # a zip bomb stops here
LOG_CHUNK = 256 * 1024  # read from a job's log per message

_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


def check_relative_path(name: str, what: str) -> PurePosixPath:
    """A relative path whose parts are plain names (no '..', no absolute path, no odd characters)."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or not p.parts or len(name) > 255:
        raise InvalidArgument(f"invalid {what} {name!r}: give a relative path like train.py")
    for part in p.parts:
        if not _SAFE_PART.match(part):
            raise InvalidArgument(
                f"invalid {what} {name!r}: path parts may hold letters, digits, '_', '.', '+', '-' "
                "and must not start with '.' or '-'"
            )
    return p


def _safe_member(name: str) -> PurePosixPath | None:
    """A zip member's path if it is safe to extract under the job dir (None: skip, e.g. a dir)."""
    if name.endswith("/"):
        return None
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or not p.parts:
        raise InvalidArgument(f"the working directory zip holds an unsafe path {name!r}")
    return p


def extract_zip(data: bytes, dest: Path) -> int:
    """Extracts a working-directory zip under `dest`; returns the number of files."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise InvalidArgument(f"the working directory is not a valid zip file: {e}") from None
    with zf:
        infos = zf.infolist()
        total = sum(i.file_size for i in infos)
        if total > MAX_UNZIPPED_BYTES:
            raise InvalidArgument(
                f"the working directory unpacks to {total / 2**20:.0f} MiB; the limit is "
                f"{MAX_UNZIPPED_BYTES // 2**20} MiB"
            )
        members = []
        for info in infos:
            p = _safe_member(info.filename)
            if p is None:
                continue
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise InvalidArgument(f"the working directory zip holds a symlink {info.filename!r}")
            members.append((info, p))
        for info, p in members:
            target = dest.joinpath(*p.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode | 0o600)
    return len(members)


def tail_offset(path: Path, lines: int) -> int:
    """The byte offset where the last `lines` lines of the file start."""
    try:
        size = path.stat().st_size
    except OSError:
        return 0
    with open(path, "rb") as fh:
        pos = size
        count = 0
        # a final newline ends the last line; it does not start another
        fh.seek(max(0, size - 1))
        if size and fh.read(1) == b"\n":
            pos = size - 1
        block = 64 * 1024
        while pos > 0:
            start = max(0, pos - block)
            fh.seek(start)
            data = fh.read(pos - start)
            idx = len(data)
            while True:
                idx = data.rfind(b"\n", 0, idx)
                if idx < 0:
                    break
                count += 1
                if count == lines:
                    return start + idx + 1
            pos = start
    return 0


def read_chunk(path: Path, pos: int) -> bytes:
    """Up to LOG_CHUNK bytes of the file from `pos` (b"" at its end or when it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(pos)
            return fh.read(LOG_CHUNK)
    except FileNotFoundError:
        return b""
