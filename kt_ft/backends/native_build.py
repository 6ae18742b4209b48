"""Compile kt-ft's C++ CPU kernels (``kernels/*.cpp`` at the repository root) into one shared library.

Imports nothing but the standard library: ``hatch_build.py`` loads this file by path at install
time, before torch or kt_ft can be imported. One binary runs on every x86-64 CPU: the baseline
is x86-64-v2 and the AVX2 path carries function-level target attributes, chosen at run time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

LIB_NAME = "libktft_cpu.so"
HASH_NAME = "SOURCE_HASH"  # beside a built library: the hash of the sources it was built from
# kt_ft/backends/native_build.py -> the repository root (a source tree or an sdist; not a wheel)
SOURCE_DIR = Path(__file__).resolve().parents[2] / "kernels"
FLAGS = ["-O3", "-march=x86-64-v2", "-mtune=generic", "-std=c++17", "-shared", "-fPIC", "-pthread"]
TIMEOUT_S = 300


def sources(src_dir: Path = SOURCE_DIR) -> list[Path]:
    """The C++ files of the library, sorted (empty when this is an installed wheel)."""
    return sorted(src_dir.glob("*.cpp")) if src_dir.is_dir() else []


def source_hash(src_dir: Path = SOURCE_DIR) -> str | None:
    """sha256 (16 hex) of the sources, the headers they include and the flags, or None without sources."""
    files = sources(src_dir)
    if not files:
        return None
    h = hashlib.sha256(" ".join(FLAGS).encode())
    for f in files + sorted(src_dir.glob("*.h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def compiler() -> str | None:
    """$CXX, else g++, else c++ (None when none is on PATH)."""
    for cand in (os.environ.get("CXX"), "g++", "c++"):  # CXX: the toolchain convention, not a kt-ft setting
        if cand and shutil.which(cand):
            return cand
    return None


def build(out_dir: Path, src_dir: Path = SOURCE_DIR) -> tuple[Path | None, str]:
    """Compile the sources into ``out_dir/LIB_NAME`` (written atomically, with ``HASH_NAME``).

    Returns (the library's path, "") or (None, why not: no sources, no compiler, or the
    compiler's own error output).
    """
    files = sources(src_dir)
    if not files:
        return None, f"no C++ sources in {src_dir}"
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX or install g++)"
    out_dir.mkdir(parents=True, exist_ok=True)
    # several processes (ranks) may build at once: each writes its own file, then renames
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *FLAGS, *map(str, files), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        return None, f"{' '.join(cmd)}: {e}"
    if res.returncode != 0:
        os.unlink(tmp)
        err = (res.stderr or res.stdout).strip().splitlines()
        return None, f"{' '.join(cmd)} failed ({res.returncode}): " + " | ".join(err[-8:])
    lib = out_dir / LIB_NAME
    os.replace(tmp, lib)
    (out_dir / HASH_NAME).write_text(source_hash(src_dir) or "")
    return lib, ""
