"""``kt_backend: auto`` by measurement (``kt_ft/runtime/backend_pick.py``): every CPU backend that runs
here timed at the layer's shape, the fastest taken, the figures cached in the placement planner's
slots; the fixed order where nothing is measured."""

from __future__ import annotations

import json

import pytest
import torch

from kt_ft.plan.cost import LayerShape
from kt_ft.runtime import measure
from kt_ft.runtime.backend_pick import pick_backend, runnable

SHAPE = LayerShape(num_experts=4, hidden=64, inter=32, top_k=2)
BF16 = torch.bfloat16


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KT_FT_CACHE_DIR", str(tmp_path))
    return tmp_path / "rates.json"


def fake_rates(monkeypatch, figures: dict[str, float]) -> list[str]:
    """measure_cpu_flops replaced by ``figures`` (backend -> FLOP/s); returns the calls' backends."""
    calls: list[str] = []

    def fake(shape, backend, threads, tokens, rank=8):
        calls.append(backend)
        return figures[backend]

    monkeypatch.setattr(measure, "measure_cpu_flops", fake)
    return calls


def test_auto_takes_the_fastest_measured_backend_and_caches_the_figures(cache, monkeypatch):
    names = runnable(BF16, None)
    if len(names) < 2:
        pytest.skip(f"one CPU backend runs here ({names}): nothing to choose between")
    # the fixed order's first choice timed slowest, its last fastest: the measurement decides
    figures = {n: (i + 1) * 1e9 for i, n in enumerate(names)}
    calls = fake_rates(monkeypatch, figures)
    backend, why = pick_backend("auto", BF16, None, None, shape=SHAPE, threads=1, tokens=64)
    assert backend.name == names[-1] and sorted(calls) == sorted(names), (why, calls)
    assert why.startswith(f"auto: {names[-1]}, the fastest") and "measured now" in why, why
    assert all(f"{n} {figures[n] / 1e9:,.1f}" in why for n in names), why
    # the planner's slots hold them (machine_rates reads the same keys)
    slots = next(iter(json.loads(cache.read_text()).values()))["cpu_flops"]
    assert {measure.cpu_rate_key(SHAPE, n, 1, 64): figures[n] for n in names}.items() <= slots.items()
    calls.clear()
    again, why = pick_backend("auto", BF16, None, None, shape=SHAPE, threads=1, tokens=64)
    assert again.name == names[-1] and calls == [] and "cached" in why, why


def test_auto_timed_for_real_picks_the_backend_with_the_best_figure(cache):
    names = runnable(BF16, None)
    if len(names) < 2:
        pytest.skip(f"one CPU backend runs here ({names})")
    backend, why = pick_backend("auto", BF16, None, None, shape=SHAPE, threads=1, tokens=32)
    slots = next(iter(json.loads(cache.read_text()).values()))["cpu_flops"]
    got = {n: slots[measure.cpu_rate_key(SHAPE, n, 1, 32)] for n in names}
    assert all(f > 0 for f in got.values()), got
    assert backend.name == max(got, key=got.get), (why, got)


@pytest.mark.parametrize("case", ["fp32 experts", "named backend", "no shape"])
def test_the_fixed_order_where_nothing_is_measured(cache, monkeypatch, case):
    calls = fake_rates(monkeypatch, {})  # any measurement would raise KeyError
    dtype, name, shape = BF16, "auto", SHAPE
    if case == "fp32 experts":
        dtype = torch.float32
    elif case == "named backend":
        name = "torch"
    else:
        shape = None
    backend, why = pick_backend(name, dtype, None, None, shape=shape, threads=1, tokens=64)
    assert calls == [] and not cache.exists()
    assert why == "asked for by name" if name != "auto" else "is the fastest backend that runs here" in why, (
        why
    )


def test_replaced_experts_run_the_measured_choice(cache, monkeypatch, tmp_path):
    """Through ``replace_routed_experts`` on a bf16 model with backend auto: every layer runs the
    backend the (faked) timing put first, the summary says so, and a forward + backward runs."""
    from helpers.tiny_models import tiny_model

    from kt_ft.plan.families import FAMILIES
    from kt_ft.plan.loader import load_rules
    from kt_ft.plan.placement import make_plan
    from kt_ft.runtime.patch import replace_routed_experts

    names = runnable(BF16, None)
    if "torch-ep" not in names or len(names) < 2:
        pytest.skip(f"backends here: {names}")
    fake_rates(monkeypatch, {n: (9e9 if n == "torch-ep" else 1e9) for n in names})
    rule = tmp_path / "cpu.yaml"
    rule.write_text("- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: auto}\n")
    model = tiny_model().to(BF16)
    plan = make_plan(model, load_rules(rule), FAMILIES["qwen3_moe"], "auto", 1)
    summary = replace_routed_experts(model, plan, 4, 2.0, 64, seed=0)
    assert summary.backend_reason.startswith("auto: torch-ep, the fastest"), summary.backend_reason
    from kt_ft.runtime.experts import KTExperts

    layers = [m for m in model.modules() if isinstance(m, KTExperts)]
    assert layers and all(m.runner.backend.name == "torch-ep" for m in layers)
    ids = torch.randint(model.config.vocab_size, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(m.gate_b.grad is not None for m in layers)
