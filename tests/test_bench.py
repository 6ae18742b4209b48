"""`kt-ft bench --preset tiny` as a smoke test: it runs, prints the table and writes one JSON
record per backend and ceiling. No speed is asserted (CI machines vary; see README Performance)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest


def test_bench_tiny_writes_records(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.integrations.cli.main", "bench", "--preset", "tiny", "--parts", "op", "--tokens", "32",
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
        [sys.executable, "-m", "kt_ft.integrations.cli.main", "bench", "--preset", "huge"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--preset 'huge' is unknown; valid choices: tiny" in proc.stderr


def test_bench_step_tiny_runs_each_system(tmp_path):
    """The full-step part on the tiny preset: kt-ft (with its CPU backend, with every expert
    streamed, and with placement: auto under the 24 GiB cap: on the CPU device here) and plain PEFT each train (finite losses, positive times,
    peak RSS recorded); on the CPU the offload system is skipped with a reason."""
    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.integrations.cli.main", "bench", "--preset", "tiny", "--parts", "step", "--backends", "torch",
         "--seq", "64", "--steps", "1", "--threads", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "full training step, tiny: 2 of 2 layers" in proc.stdout
    steps = {r["name"]: r for r in json.loads(out.read_text())["records"] if r["kind"] == "step"}
    assert set(steps) == {"kt-ft[torch]", "kt-ft[stream]", "kt-ft[auto]", "peft-cpu"}, proc.stdout[-2000:]
    for r in steps.values():
        assert r["tokens"] == 64 and r["seconds"] > 0 and r["peak_rss_bytes"] > 0
        # auto warms up until its calibration step has passed (placement/runtime.py): more steps
        n = len(r["losses"])
        assert (n > 2 if r["name"] == "kt-ft[auto]" else n == 2) and all(
            math.isfinite(v) for v in r["losses"]
        )
    # same model, same data: the first step's loss (before any update) agrees across systems
    a, b = steps["kt-ft[torch]"]["losses"][0], steps["peft-cpu"]["losses"][0]
    assert abs(a - b) < 0.05 * abs(b), (a, b)
    assert steps["kt-ft[stream]"]["losses"][0] == pytest.approx(
        a, rel=1e-3
    )  # the same model, other placement
    assert steps["kt-ft[auto]"]["losses"][0] == pytest.approx(a, rel=1e-3)
    assert "every expert streamed" in steps["kt-ft[stream]"]["note"]
    assert "resident/streamed/CPU L0 8/0/0" in steps["kt-ft[auto]"]["note"]  # the tiny model fits 24 GiB
    assert re.search(r"streamed \d+\.\d\d GB in the step \(\d+ layer copies", steps["kt-ft[stream]"]["note"])
    assert "skipping offload" in proc.stdout


def test_bench_unknown_part_is_an_error():
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.integrations.cli.main", "bench", "--parts", "op,speed"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "'speed' is unknown; valid choices: op, step, placement" in proc.stderr


def test_bench_placement_tiny_smoke(tmp_path):
    """`--parts placement` on the tiny preset, one cap that fits every expert, `placement: auto`
    alone (test_bench_step_tiny_runs_each_system runs the all-CPU, streamed and PEFT systems): it
    trains; its record says its split (all resident on the CPU "device", whose rates are measured
    there) and carries a prediction; the plot is written. ``--profile DIR --trace --no-replan`` reach
    the worker as its own flags: one more step profiled into DIR, with its timeline."""
    out, png, prof = tmp_path / "placement.json", tmp_path / "placement.png", tmp_path / "prof"
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.integrations.cli.main", "bench", "--preset", "tiny", "--parts", "placement", "--backends", "torch",
         "--seq", "32", "--steps", "1", "--threads", "1", "--caps", "2", "--systems", "kt-ft", "--placements", "auto",
         "--json", str(out), "--profile", str(prof), "--trace", "--no-replan",
         "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KT_FT_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = {(r["name"], r["cap_gib"]): r for r in json.loads(out.read_text())["records"]}
    assert set(recs) == {("kt-ft[auto]", 2.0)}, proc.stdout[-2000:]
    auto = recs[("kt-ft[auto]", 2.0)]
    assert auto["kind"] == "placement" and auto["predicted_s"] > 0 and auto["tok_s"] > 0
    assert "resident/streamed/CPU L0 8/0/0, L1 8/0/0" in auto["note"]
    assert [p.name for p in prof.iterdir()] and {p.suffix for p in prof.iterdir()} == {".txt", ".json"}
    assert "Self CPU" in next(prof.glob("*.txt")).read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in proc.stdout
    else:
        assert png.stat().st_size > 0


def test_bench_modules_stay_small_and_probes_run_only_as_main():
    """Each module of `kt-ft bench`, its probes too, does one job in at most 500 lines; a probe runs
    only as ``python -m kt_ft.integrations.bench.probes.<name>`` (its work in ``main``, behind
    ``__main__``: importing it runs nothing, which tests/test_layers.py's import of every module
    relies on)."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "kt_ft" / "integrations" / "bench"
    sizes = {p.relative_to(bench).as_posix(): len(p.read_text().splitlines()) for p in bench.rglob("*.py")}
    assert "e2e.py" in sizes and "probes/load_memory.py" in sizes
    assert {name: n for name, n in sizes.items() if n > 500} == {}
    for path in (bench / "probes").glob("*.py"):
        if path.name != "__init__.py":
            text = path.read_text()
            assert "\ndef main(" in text and '\nif __name__ == "__main__":\n' in text, path.name
