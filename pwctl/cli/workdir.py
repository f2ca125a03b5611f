"""`pwctl submit --working-dir`: the directory zipped for the upload, with progress.

The server takes at most 50 MiB zipped. A large directory takes a while to zip, so `submit` says
what it zips (a bar on a terminal, else one line) and stops as soon as the zip passes the limit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidArgument
from .common import hint, stderr

MAX_WORKING_DIR_ZIP = 50 * 1024 * 1024  # the server's limit too
SKIP_DIRS = {"__pycache__", ".git", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def working_dir_files(root: Path) -> list[tuple[Path, int]]:
    """The files `--working-dir` uploads (caches and VCS folders skipped), with their sizes, in order."""
    if not root.is_dir():
        raise InvalidArgument(f"--working-dir {root}: not a directory")
    files: list[tuple[Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            path = Path(dirpath) / f
            try:
                if path.is_file():
                    files.append((path, path.stat().st_size))
            except OSError:
                continue  # gone meanwhile, or a dangling link: nothing to upload
    return files


def zip_working_dir(root: Path, limit: int = MAX_WORKING_DIR_ZIP,
                    progress: Callable[[int, int], None] | None = None,
                    files: list[tuple[Path, int]] | None = None) -> bytes:
    """Zips a directory (skipping caches and VCS folders); InvalidArgument as soon as the zip
    passes `limit` bytes, or a file cannot be read. `progress(bytes_read, bytes_total)` is called
    after each file; `files`: `working_dir_files(root)` when the caller has it already."""
    import io
    import zipfile

    files = working_dir_files(root) if files is None else files
    total = sum(size for _, size in files)
    buf = io.BytesIO()
    done = 0
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, size in files:
            try:
                zf.write(path, path.relative_to(root).as_posix())
            except OSError as e:
                raise InvalidArgument(f"--working-dir {root}: cannot read {path}: {e.strerror or e}") from None
            done += size
            if progress is not None:
                progress(done, total)
            if buf.tell() > limit:
                raise InvalidArgument(
                    f"--working-dir {root} is over {limit // 2**20} MiB zipped after {done / 2**20:,.0f} of its "
                    f"{total / 2**20:,.0f} MiB: leave data out of it (read large files from shared storage)"
                )
    data = buf.getvalue()
    if len(data) > limit:
        raise InvalidArgument(f"--working-dir {root} is {len(data) / 2**20:.1f} MiB zipped; "
                              f"the limit is {limit // 2**20} MiB")
    return data


SHOW_PROGRESS_FROM = 8 * 2**20  # a working dir smaller than this zips in well under a second: no progress


def zip_with_progress(root: Path) -> bytes:
    """`zip_working_dir` with progress on stderr when there is much to zip: a bar on a terminal,
    else one line saying what is being zipped."""
    files = working_dir_files(root)
    total = sum(size for _, size in files)
    if total < SHOW_PROGRESS_FROM:
        return zip_working_dir(root, files=files)
    what = (f"zipping {root}: {len(files):,} files, {total / 2**20:,.0f} MiB "
            f"(at most {MAX_WORKING_DIR_ZIP // 2**20} MiB zipped)")
    hint(what + " ...")
    if not sys.stderr.isatty():
        return zip_working_dir(root, files=files)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(bar_width=24), DownloadColumn(binary_units=True),
                  TimeRemainingColumn(), console=stderr(), transient=True) as bar:
        task = bar.add_task("zipping", total=total)
        return zip_working_dir(root, progress=lambda done, _total: bar.update(task, completed=done), files=files)
