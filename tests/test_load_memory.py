"""Loading keeps one copy of the routed experts in RAM (peak RSS, measured in a subprocess).

A random bf16 qwen3_moe checkpoint with 288 MiB of routed experts (4 layers x 64 experts of
H 512, I 384; per-expert keys as transformers writes them) is loaded the way kt-ft loads it on a
CPU machine (``kt_ft.runtime.loading.load_planned`` with the plan's device map, everything on the
CPU) by the probe ``kt_ft/integrations/bench/probes/load_memory.py --probe`` in a fresh process,
from a cold page cache.

Bound: peak RSS growth (VmHWM after loading, reset after imports and a warm-up load, minus VmRSS
before) <= 1.25 x expert bytes + non-expert bytes + 48 MiB (allocator, loader bookkeeping and
mapped neighbours of the non-expert tensors; measured 2-3% of the experts + 26 MiB here).
transformers' own loading of the experts (the probe's ``transformers`` method) peaks at about
2 x the expert bytes (the file mapping's pages plus the fused copy) and fails this bound.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

MiB = 2**20
SLACK = 48 * MiB


def _script():
    return importlib.import_module("kt_ft.integrations.bench.probes.load_memory")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_load_peak_rss_is_one_copy_of_the_experts(tmp_path):
    lm = _script()
    model_dir, warmup_dir = tmp_path / "model", tmp_path / "warmup"
    lm.build(model_dir, layers=4, hidden=512, moe_intermediate=384, experts=64)
    lm.build(warmup_dir, 1, 64, 32, 8, vocab=128)
    r = lm.run_probe("kt-ft", model_dir, warmup_dir)
    experts, other = r["expert_bytes"], r["other_bytes"]
    bound = 1.25 * experts + other + SLACK
    print(
        f"experts {experts / MiB:.0f} MiB, other {other / MiB:.0f} MiB: peak RSS growth {r['peak'] / MiB:.0f} MiB "
        f"(private {r['anon'] / MiB:.0f}, file-backed {r['file'] / MiB:.0f}), bound {bound / MiB:.0f} MiB; "
        f"{r['seconds']} s"
    )
    assert experts == 4 * 64 * 3 * 384 * 512 * 2  # every routed expert loaded, bf16
    assert r["expert_devices"] == ["cpu"]
    assert r["peak"] <= bound
