"""``native`` backend: the ``torch`` backend's algorithm (``grouped.py``) computed in fp32, with its
four frozen-base products through kt-ft's own C++ GEMMs (``native.py``), which read the bf16
expert weights in place: widened to fp32 inside the packed tile (scalar, AVX2, AVX-512F paths) or
multiplied as bf16 with the activations rounded to bf16 and fp32 sums (AVX512-BF16, AMX paths;
``KT_FT_NATIVE_ISA`` picks, default the best the CPU runs). Experts kept quantized (FP8, INT8,
INT4, MXFP4: ``kt_ft.backends.quant``) are read in their stored bytes: each GEMM work item decodes
the rows or columns of W it reads to bf16 first (``kernels/quant_decode.h``, ``native_quant.py``),
so no expert is ever dequantized whole and the numbers are those of the dequantized bf16 weights.

Why: on a CPU without native bf16 arithmetic (AVX2, no AVX512-BF16/AMX) torch's bf16 matmul
runs at ~1 GFLOP/s while fp32 GEMMs run at tens; an fp32 copy of the weights would double the
experts' RAM. The activation between the products (silu(g) * u forward; its backward with the
routing-weight gradient) is one C++ pass each way (``kernels/expert_act.cpp``: ~9 torch passes over
[pairs, I] arrays in the backward), and so are the row moves between token and expert order
(``kernels/expert_rows.cpp``: the gathers, widening bf16 rows, and the routing-weighted sums).
The rank-r LoRA products stay in torch, in fp32.

Differences from ``torch``: activations and temporaries are fp32 (twice the bytes of bf16 ones;
on the AMX / AVX512-BF16 paths the gate/up pre-activations kept for the backward are bf16),
and the padding rows of each expert (``ROW_PAD``: kept, as they let the LoRA products run one
``bmm`` per group of experts with equal padded counts) are not computed by the base products, only
zeroed (padding was for oneDNN's per-shape kernel cache; here it would be computed for nothing:
~7.5 of ~55 rows an expert at 512 tokens of DeepSeek-V2-Lite). Only the default silu layout;
weights that are neither bf16 nor quantized in a format it decodes go through torch's own GEMMs
(the ``torch`` backend's path).
"""

from __future__ import annotations

import os

import torch

from kt_ft.backends import native, native_quant
from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.grouped import _WS, GroupedTorchBackend, _Layout
from kt_ft.backends.quant_weights import is_quantized
from kt_ft.base.errors import KTConfigError

BF16 = torch.bfloat16


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX, where torch's oneDNN bf16 GEMMs are fast: torch's own CPU probes where
    this torch has them (2.11 dropped ``_is_avx512_bf16_supported``), else the kernel's CPU flags.
    False where oneDNN's own ``ONEDNN_MAX_CPU_ISA`` caps it below its bf16 GEMMs (e.g. ``AVX2``):
    torch's bf16 products are then as slow as on a CPU without them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()  # oneDNN's variable, read as oneDNN does
    if cap and cap not in ("ALL", "DEFAULT") and not any(t in cap for t in ("BF16", "AMX", "FP16", "AVX10")):
        return False
    cpu = torch._C._cpu
    probes = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(p) for p in probes):
        return any(bool(p()) for p in probes)
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class NativeBackend(GroupedTorchBackend):
    name = "native"
    auto_note = (
        " (this CPU has no native bf16, where torch's bf16 GEMMs are slow; `kt-ft bench --parts op` "
        "measures both here, docs/benchmarks.md has figures)"
    )

    def __init__(self) -> None:
        super().__init__()
        self._threads: int | None = None

    @classmethod
    def unavailable_reason(cls, dtype: torch.dtype | None = None, spec=None) -> str | None:
        if spec is not None and not spec.is_default:
            return (
                f"the native backend computes silu(gate) * up on [E, 2I, H] weights only, these experts "
                f"are {spec.describe()}: use kt_backend torch"
            )
        if dtype is not None and dtype != BF16:
            return (
                f"it reads bf16 expert weights, the model's are {dtype} (torch's own GEMMs already run "
                "that dtype natively: use kt_backend torch)"
            )
        return native.unavailable_reason()

    @classmethod
    def auto_skip_reason(cls, dtype: torch.dtype | None = None, spec=None) -> str | None:
        if cpu_has_native_bf16():
            # measured on a 2-core AMX Xeon (docs/benchmarks.md): the AMX path's op runs on par with
            # torch's, not clearly faster, so the fixed order keeps torch; `auto`'s measurement times both
            return "this CPU has native bf16 (AVX512-BF16/AMX), where torch's bf16 GEMMs run natively"
        return None

    def prepare(self, base: ExpertWeights, threads: int | None = None, max_tokens: int = 4096) -> None:
        if not base.is_plain:
            raise KTConfigError(f"kt_backend='native': {self.unavailable_reason(None, base.spec)}")
        why = native.unavailable_reason()
        if why is not None and base.gate_up.dtype == BF16:
            raise KTConfigError(f"kt_backend='native': {why}")
        self._threads = threads

    def _native(self, base: ExpertWeights) -> bool:
        # bf16 experts, or experts kept quantized that the C++ GEMMs decode (computing in bf16)
        w = base.gate_up
        return w.dtype == BF16 and (not is_quantized(w) or native_quant.unsupported(w) is None)

    def _compute_dtype(self, base: ExpertWeights) -> torch.dtype:
        return torch.float32 if self._native(base) else base.gate_up.dtype

    def _saved_gu_dtype(self, base: ExpertWeights, dt: torch.dtype) -> torch.dtype:
        # the gate/up pre-activations wait in RAM from a layer's forward to its backward, every
        # layer at once: bf16 halves them (DeepSeek-V2-Lite at 2,048 tokens: 72 MiB a layer less)
        # at one narrowing and one widening pass, on the paths that round the products' inputs to
        # bf16 anyway (AMX, AVX512-BF16); the fp32 paths keep fp32 (their results stay fp32-exact)
        if self._native(base) and native.active_isa() in native.ROUNDS_TO_BF16:
            return BF16
        return dt

    def _gather(self, base, src, idx, out):
        if not self._native(base) or src.dtype not in (torch.float32, BF16):
            return super()._gather(base, src, idx, out)
        return native.gather_rows(src, idx, out, threads=self._threads)

    def _combine(self, base, src, inv, weights, t):
        if not self._native(base):
            return super()._combine(base, src, inv, weights, t)
        # a fresh [T, C] result (it leaves the op: the runner hands it on)
        out = torch.empty(t, src.shape[1], dtype=torch.float32)
        return native.combine_rows(
            src, inv, None if weights is None else weights.contiguous(), out, threads=self._threads
        )

    def _activation(self, base, gu, h, keep):
        if not self._native(base):
            return super()._activation(base, gu, h, keep)
        native.silu_mul_forward(gu, h, keep, threads=self._threads)

    def _activation_backward(self, base, gu, q, ws, dgu):
        if not self._native(base):
            return super()._activation_backward(base, gu, q, ws, dgu)
        n_pairs, inter = q.shape
        h = _WS.get("h", (n_pairs, inter), q.dtype)
        grad_ws = native.silu_mul_backward(
            gu, q, ws.view(-1), h, dgu, torch.empty(n_pairs, dtype=torch.float32), threads=self._threads
        )
        return h, grad_ws

    def _grouped(self, trans_w: bool, layout: _Layout, w: torch.Tensor, a: torch.Tensor, out: torch.Tensor):
        # one call per product kind for all experts: one thread team, work balanced across experts
        plan = getattr(layout, "_native_plan", None)
        if plan is None:
            used = layout.used
            rows = [(e, sl.start, used[e], sl.stop - sl.start - used[e]) for e, sl in layout.slices]
            plan = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).t().contiguous()
            layout._native_plan = plan  # the layout is per call: made once, used by all four products
        threads = self._threads or torch.get_num_threads()
        # beta 1: out holds the LoRA term (the base class's products accumulate), added in the tile
        if is_quantized(w):  # decoded a work item's slab at a time inside the GEMM
            native_quant.grouped(trans_w, a, w, out, plan, beta=1.0, threads=threads)
            return
        native.grouped_bf16(trans_w, a, w, out, plan[0], plan[1], plan[2], plan[3], beta=1.0, threads=threads)

    def _gate_up(self, layout, base, xs, out):
        if not self._native(base):
            return super()._gate_up(layout, base, xs, out)
        self._grouped(True, layout, base.gate_up, xs, out)

    def _down(self, layout, base, h, out):
        if not self._native(base):
            return super()._down(layout, base, h, out)
        self._grouped(True, layout, base.down, h, out)

    def _down_grad(self, layout, base, gys, out):
        if not self._native(base):
            return super()._down_grad(layout, base, gys, out)
        self._grouped(False, layout, base.down, gys, out)

    def _gate_up_grad(self, layout, base, dgu, out):
        if not self._native(base):
            return super()._gate_up_grad(layout, base, dgu, out)
        self._grouped(False, layout, base.gate_up, dgu, out)
