"""`kt-ft bench --preset tiny` as a smoke test: it runs, prints the table and writes one JSON
record per backend and ceiling. No speed is asserted (CI machines vary; see README Performance)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_tiny_writes_records(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.cli", "bench", "--preset", "tiny", "--tokens", "32",
         "--backends", "torch,reference", "--repeat", "1", "--threads", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tiny: H 256, I 128, E 8, top-2" in proc.stdout
    records = json.loads(out.read_text())["records"]
    ops = {r["name"]: r for r in records if r["kind"] == "op"}
    assert set(ops) == {"torch", "reference"}
    for r in ops.values():
        assert r["tokens"] == 32 and r["seconds"] > 0 and r["tok_s"] > 0 and r["tflops"] > 0
    assert any(r["kind"] == "gemm" for r in records)


def test_bench_unknown_preset_is_an_error():
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.cli", "bench", "--preset", "huge"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--preset 'huge' is unknown; valid choices: tiny" in proc.stderr
