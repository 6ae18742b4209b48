"""Crash-safe file writes: write to a hidden temporary name in the same directory, then rename.

``os.replace`` within one directory is atomic on POSIX filesystems, so a reader (or a resume
after SIGKILL) sees either the old file or the complete new one, never a truncated one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def tmp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is fsynced and renamed to ``target``."""
    target = Path(target)
    tmp = tmp_name(target)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(target: str | os.PathLike, obj: Any) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
