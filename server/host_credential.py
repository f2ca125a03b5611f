"""Where a worker keeps the credential its controller issued for its host name
(server/controller/hostcreds.py): `DATA_DIR/hosts/<name>.credential`, the folder mode 0700 and
the file 0600, written atomically. A worker that restarts under the same name proves with it
that it is the same host; without the file (another machine, a wiped data directory) it must
wait until its old host is lost, or an operator deletes it (`pwctl host delete`)."""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path

from . import paths

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+-]{0,127}")


def credential_path(name: str) -> Path | None:
    """The file of host `name`'s credential (None for a name that is no safe file name)."""
    if not _SAFE.fullmatch(name):
        return None
    return paths.data_dir() / "hosts" / f"{name}.credential"


def load(name: str) -> str:
    """The credential kept for host `name`, "" when there is none."""
    path = credential_path(name)
    if path is None:
        return ""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def save(name: str, credential: str) -> None:
    """Keeps `credential` for host `name` (0600, in a 0700 folder); a failure is one warning:
    the worker still holds it in memory."""
    path = credential_path(name)
    if path is None:
        return
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        os.chmod(path.parent, 0o700)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(credential + "\n")
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot keep the host credential in %s: %s", path, e)
