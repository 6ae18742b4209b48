"""The host allocator policy (kt_ft/runtime/host_alloc.py): KT_FT_MMAP_THRESHOLD parses as documented,
bad values are refused naming the setting, and the threshold is set once a process (checked in a
fresh interpreter: the setting is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kt_ft.runtime import host_alloc


@pytest.mark.parametrize(
    ("raw", "want"), [("4M", 4 * 2**20), ("512k", 512 * 2**10), ("65536", 65536), ("0", 0)]
)
def test_threshold_parses(monkeypatch, raw, want):
    monkeypatch.setenv("KT_FT_MMAP_THRESHOLD", raw)
    assert host_alloc.threshold_bytes() == want


@pytest.mark.parametrize("raw", ["4G", "lots", "-1", "1.5M"])
def test_bad_threshold_is_refused(monkeypatch, raw):
    monkeypatch.setenv("KT_FT_MMAP_THRESHOLD", raw)
    with pytest.raises(ValueError, match="KT_FT_MMAP_THRESHOLD"):
        host_alloc.threshold_bytes()


def test_apply_sets_it_once_and_zero_leaves_glibc_alone():
    code = (
        "import logging, platform; from kt_ft.runtime import host_alloc\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "log = logging.getLogger('t')\n"
        "got = host_alloc.apply(log); again = host_alloc.apply(log)\n"
        "glibc = platform.libc_ver()[0] == 'glibc'\n"
        "print(got, again, glibc)\n"
    )
    for env, want in (("8M", 8 * 2**20), ("64M", 32 * 2**20), ("0", 0)):  # glibc's cap: 32 MiB
        res = subprocess.run(
            [sys.executable, "-c", code],
            env={**_env(), "KT_FT_MMAP_THRESHOLD": env},
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        got, again, glibc = res.stdout.split()
        if glibc == "True":
            assert int(got) == int(again) == want, (env, res.stdout)
            assert ("host allocator:" in res.stderr) == (want > 0), res.stderr
        else:
            assert int(got) == 0


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "KT_FT_MMAP_THRESHOLD"}
