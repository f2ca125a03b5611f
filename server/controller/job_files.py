"""A job's files: its entrypoint's path, its working directory (an uploaded zip) and its log.

The log (the driver's stdout and stderr) is written by the job's supervisor (jobsup.py), which
keeps at most `--job-log-max-mb` of it (DEFAULT_LOG_MAX_MB): output.log rotates at half of that
into output.log.1, and older output is dropped (counted in log.json).

Every limit here bounds what one request can make the controller write or read.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import zipfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from pwctl.limits import share_problem
from schemas.pathways.v1 import controller_pb2 as cpb

from . import jobsup
from .errors import InvalidArgument

MAX_SCRIPT_BYTES = 10 * 1024 * 1024
MAX_ZIP_BYTES = 50 * 1024 * 1024
MAX_UNZIPPED_BYTES = 500 * 1024 * 1024  # a zip bomb stops here
LOG_CHUNK = 256 * 1024  # read from a job's log per message
DEFAULT_LOG_MAX_MB = 16  # kept per job; the controller flag --job-log-max-mb changes it

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


def validate_submit(req: cpb.SubmitJobRequest) -> tuple[PurePosixPath, float]:
    """The entrypoint and weight of a valid submission; InvalidArgument says what is wrong."""
    if not req.script:
        raise InvalidArgument("the script is empty")
    if len(req.script) > MAX_SCRIPT_BYTES:
        raise InvalidArgument(f"the script is {len(req.script) / 2**20:.1f} MiB; the limit is "
                              f"{MAX_SCRIPT_BYTES // 2**20} MiB (put data in --working-dir)")
    entry = check_relative_path(req.entrypoint, "entrypoint")
    if entry.suffix not in (".py", ".sh"):  # job_process.INTERPRETERS
        raise InvalidArgument(f"entrypoint {entry}: a driver is a .py (Python) or .sh (bash) script")
    if len(req.working_dir_zip) > MAX_ZIP_BYTES:
        raise InvalidArgument(
            f"the working directory is {len(req.working_dir_zip) / 2**20:.1f} MiB zipped; the limit is "
            f"{MAX_ZIP_BYTES // 2**20} MiB"
        )
    problem = share_problem("job", req.priority, req.weight)
    if problem:
        raise InvalidArgument(problem)
    if len(req.name) > 128 or any(not c.isprintable() for c in req.name):
        raise InvalidArgument("the job name must be at most 128 printable characters")
    for a in req.args:
        if "\0" in a:
            raise InvalidArgument("arguments must not contain NUL characters")
    return entry, req.weight or 1.0  # 0: not set


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
    return _tail(path, lines)[0]


def _tail(path: Path, lines: int) -> tuple[int, int]:
    """(where the last `lines` lines start, how many lines were found: fewer when the file has fewer)."""
    try:
        size = path.stat().st_size
    except OSError:
        return 0, 0
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
                    return start + idx + 1, count
            pos = start
    return 0, count + (1 if size else 0)


class LogReader:
    """Reads what is kept of a job's output (output.log.1, then output.log) and follows it across
    the supervisor's rotations (a new output.log: the old file is read to its end first)."""

    def __init__(self, job_dir: Path) -> None:
        self.dir = job_dir
        self.fh: BinaryIO | None = None
        self.next: BinaryIO | None = None  # output.log while fh is output.log.1

    def _open(self, name: str) -> BinaryIO | None:
        try:
            return open(self.dir / name, "rb")
        except FileNotFoundError:
            return None

    def start(self, tail: int) -> str:
        """Positions at the start (tail=0) or at the last `tail` lines; returns a notice to show
        first when earlier output was dropped ('' when nothing was)."""
        cur = self._open(jobsup.LOG)  # first: a rotation after this leaves `old` the older part
        old = self._open(jobsup.LOG_OLD)
        if old is not None and cur is not None and os.fstat(old.fileno()).st_ino == os.fstat(cur.fileno()).st_ino:
            cur.close()
            cur = self._open(jobsup.LOG)
        from_start = True
        if tail > 0 and cur is not None:
            offset, found = _tail(self.dir / jobsup.LOG, tail)
            if found >= tail or old is None:
                from_start = found < tail
                cur.seek(offset)
                if old is not None:
                    old.close()
                    old = None
            else:
                offset, more = _tail(self.dir / jobsup.LOG_OLD, tail - found)
                from_start = more < tail - found
                old.seek(offset)
        self.fh, self.next = (old, cur) if old is not None else (cur, None)
        try:
            state = json.loads((self.dir / jobsup.LOG_STATE).read_text())
            dropped, cap = int(state["dropped"]), int(state["max_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        if not from_start or dropped <= 0:
            return ""
        return (f"[pathways: output truncated: the first {dropped / 2**20:.1f} MiB were dropped; a job keeps "
                f"its last {cap / 2**20:g} MiB of output (controller flag --job-log-max-mb)]\n")

    def read(self) -> bytes:
        """The next bytes of output (b"" when there are none yet)."""
        while True:
            if self.fh is None:
                self.fh = self._open(jobsup.LOG)
                if self.fh is None:
                    return b""
            data = self.fh.read(LOG_CHUNK)
            if data:
                return data
            if self.next is not None:
                self.fh.close()
                self.fh, self.next = self.next, None
                continue
            try:
                rotated = os.stat(self.dir / jobsup.LOG).st_ino != os.fstat(self.fh.fileno()).st_ino
            except FileNotFoundError:
                return b""
            if not rotated:
                return b""
            data = self.fh.read(LOG_CHUNK)  # written just before the rotation
            if data:
                return data
            self.fh.close()
            self.fh = None

    def close(self) -> None:
        for fh in (self.fh, self.next):
            if fh is not None:
                fh.close()
        self.fh = self.next = None
