"""kt-ft's host copy of a layer's routed experts is freed once the backend holds a copy of its own
(kt-kernel: ``ExpertBackend.holds_base_copy``), where nothing else reads it: layers whose experts
all stay on the CPU under a fixed placement (``moe/patch.py``). Here a stand-in backend that copies
the weights at ``prepare`` plays kt-kernel's part (kt-kernel's own test: test_kt_kernel.py).

Results are compared with the float64 reference backend on a kept copy of the weights; bound as in
test_kernels: 1e-4 of the truth's max per tensor (float32).
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import assert_close, run_backend
from helpers.moe_inputs import make_problem
from helpers.resident import GPU_RULE, build, kt_layers

from kt_ft.backends.base import ExpertWeights, LoraTensors
from kt_ft.backends.grouped import GroupedTorchBackend
from kt_ft.backends.kt_kernel import KTKernelBackend, chain_backward_order
from kt_ft.backends.registry import BACKENDS
from kt_ft.runtime.function import CPUExpertsFunction, ExpertRunner

CPU_RULE = (
    "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: torch}\n- default: {device: cuda}\n"
)


class OwnCopyBackend(GroupedTorchBackend):
    """The torch backend on a copy of the weights made at ``prepare`` (as kt-kernel packs its own)."""

    def prepare(self, weights, threads=None, max_tokens=4096):
        self.own = ExpertWeights(weights.gate_up.clone(), weights.down.clone())
        super().prepare(self.own, threads, max_tokens)

    def holds_base_copy(self) -> bool:
        return hasattr(self, "own")

    def forward(self, x, ids, weights, base, lora, scaling, needs_grad):
        return super().forward(x, ids, weights, self.own, lora, scaling, needs_grad)


def _call(runner, params, x, ids, w, gy):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = CPUExpertsFunction.apply(xx, ids, ww, runner, *params)
    out.backward(gy)
    got = {"out": out, "grad_x": xx.grad, "grad_weights": ww.grad}
    got.update({f"grad_{n}": p.grad for n, p in zip(LoraTensors._fields, params)})
    return got


@pytest.mark.parametrize("backend", [OwnCopyBackend, GroupedTorchBackend])
def test_runner_frees_the_host_copy_only_when_the_backend_holds_one(backend, rng):
    """With ``free_base_when_held``: freed after the first forward when the backend holds its own
    copy (the storage gone, the shapes kept), kept otherwise; two calls right either way."""
    base, lora, x, ids, w, gy = make_problem(29, 6, 2, 32, 16, 4, torch.float32, rng)
    keep = ExpertWeights(base.gate_up.double(), base.down.double())
    runner = ExpertRunner(backend(), base, 2.0, chunk_size=64, threads=None)
    runner.free_base_when_held = True
    params = [t.clone().requires_grad_() for t in lora]
    for _ in range(2):
        got = _call(runner, params, x, ids, w, gy)
        cur = LoraTensors(*(p.detach().double() for p in params))
        truth = run_backend("reference", keep, cur, x.double(), ids, w.double(), gy.double(), 2.0)
        assert_close(truth, got, 1e-4)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=rng) * 0.05)
                p.grad = None
    freed = backend is OwnCopyBackend
    assert runner.base_freed is freed
    assert base.gate_up.shape == keep.gate_up.shape
    assert (base.gate_up.untyped_storage().nbytes() == 0) is freed
    assert (base.down.untyped_storage().nbytes() == 0) is freed


def test_patch_frees_layers_that_stay_on_the_cpu_only(tmp_path, monkeypatch):
    """Under a CPU-only rule every layer's host copy goes after the first forward, and training
    goes on; with GPU-resident experts (the device copy is made from the host one, and a re-plan
    may move more) none is marked, and a layer whose copy is gone refuses to take resident experts."""
    monkeypatch.setitem(BACKENDS, "torch", type("OwnCopy", (OwnCopyBackend,), {"name": "torch"}))
    cpu, gpu = tmp_path / "cpu.yaml", tmp_path / "gpu.yaml"
    cpu.write_text(CPU_RULE)
    gpu.write_text(GPU_RULE)
    batch = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    for rule, freed in ((cpu, True), (gpu, False)):
        model = build(rule)
        layers = kt_layers(model)
        assert [m.runner.free_base_when_held for m in layers] == [freed] * len(layers)
        for _ in range(2):
            loss = model(input_ids=batch, labels=batch).loss
            assert torch.isfinite(loss)
            loss.backward()
        assert [m.runner.base_freed for m in layers] == [freed] * len(layers)
        assert all(m.gate_b.grad is not None and m.gate_b.grad.abs().sum() > 0 for m in layers)
        if freed:
            with pytest.raises(RuntimeError, match="layer 0: experts \\[1\\] cannot move to the GPU"):
                layers[0].set_placement((1,), ())


def test_backward_order_links_kt_kernel_backends_only():
    """Each kt-kernel layer's backward done starts the repack of the layer before it (forward order
    given); other backends are skipped, not linked through."""
    a, b, c = KTKernelBackend(), GroupedTorchBackend(), KTKernelBackend()
    d = KTKernelBackend()
    assert chain_backward_order([a, b, c, d]) == 2
    assert a._next_backward is None and c._next_backward is a and d._next_backward is c
    assert chain_backward_order([b]) == 0
