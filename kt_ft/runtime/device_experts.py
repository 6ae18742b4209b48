"""The experts of one MoE layer computed on the training device: resident and streamed ones.

Three placements share a layer's (token, slot) pairs: resident experts (``resident.py``: base
weights copied once to the device), streamed experts (``streamed.py``: base weights copied
from RAM into a reusable device buffer each time the layer runs) and the CPU op (every other
expert). This module splits the pairs and computes the device share -- resident and streamed
alike, one formula, one graph -- with plain torch ops under autograd; the CPU op gets the
device pairs masked (id -1, weight 0: ``kernels/base.py``) and skips them.

What stays the same whatever the placement: the CPU keeps the full fused base weights (the
checkpoint, merge and convert read them), the expert LoRA stays the six CPU fp32 parameters
of ``KTExperts`` (the device share takes slices of them with ``index_select(...).to(device)``,
so autograd sends its gradients back into the same parameters: the optimizer and the fused
checkpoint see no difference), and nothing new is an ``nn.Parameter`` or buffer.

Per device expert e and its pairs (x, w), s the LoRA scaling, in the base weights' dtype:
g = x Wg^T + s (x Ag^T) Bg^T, u = x Wu^T + s (x Au^T) Bu^T, h = act(g, u),
d = h Wd^T + s (h Ad^T) Bd^T, out_t += w d (accumulated in float32; float64 for float64).
The family's layout and activation (``ExpertSpec``: gpt_oss's transposed, interleaved,
biased, clamped experts) are read through ``ExpertWeights.expert`` / ``gated_act``, as the
reference backend does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kt_ft.backends.base import ExpertWeights, LoraTensors, accum_dtype, lora_key
from kt_ft.backends.grouped_device import FusedGroupedExperts, grouped_expert_forward, stack_lora
from kt_ft.backends.grouped_products import Groups, sort_by_id
from kt_ft.runtime.function import prefetch_grad_out
from kt_ft.runtime.graphed import LayerGraphs
from kt_ft.runtime.inner_graph import inner_grads, take_inner
from kt_ft.runtime.resident import ResidentExperts
from kt_ft.runtime.streamed import StreamedExperts


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64 on ids' device: how often each of 0..n-1 occurs in ``ids`` (int64, any shape).

    ``torch.bincount`` on CUDA reads ``ids.max()`` back to the host to size its output, a host
    sync per call even with ``minlength`` (two per layer and pass in a profiled run); a
    ``scatter_add_`` into [n] zeros queues without one."""
    flat = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


class DeviceExperts:
    """The device share of one layer: ``resident`` experts (local indices 0..R-1), then
    ``streamed`` ones (R..R+S-1). ``base``: the layer's full CPU base weights."""

    def __init__(
        self, base: ExpertWeights, resident: ResidentExperts | None, streamed: StreamedExperts | None
    ) -> None:
        if resident is None and streamed is None:
            raise ValueError("DeviceExperts needs resident or streamed experts")
        res_ids = resident.ids if resident is not None else ()
        str_ids = streamed.ids if streamed is not None else ()
        both = sorted(set(res_ids) & set(str_ids))
        if both:
            raise ValueError(f"expert ids {both} are both resident and streamed")
        self.resident = resident
        self.streamed = streamed
        self.num_experts = base.num_experts
        self.dtype = base.gate_up.dtype
        self.spec = base.spec
        self.ids = tuple(res_ids) + tuple(str_ids)  # local index -> expert id
        self.num_resident = len(res_ids)
        self._ids_cpu = torch.tensor(self.ids, dtype=torch.long)
        self._ids_dev: torch.Tensor | None = None  # _ids_cpu on the device
        self._local_cpu = torch.full((self.num_experts,), -1, dtype=torch.long)
        self._local_cpu[self._ids_cpu] = torch.arange(len(self.ids))
        self._local: torch.Tensor | None = None  # _local_cpu on the device
        self._all = self.ids == tuple(range(self.num_experts))  # every expert, in order: no gather
        # the LoRA rows on the device, reused by a checkpointed recompute; dropped by the backward
        self._lora_key: tuple | None = None
        self._lora_dev: list[torch.Tensor] | None = None
        self.lora_copies = 0  # host -> device copies of the LoRA rows (a test counts them)
        # first local index of a placement -> (key, its LoRA in the weights' dtype): ``_lora_cast``
        self._casts: dict[int, tuple] = {}
        self.cpu_follows = len(self.ids) < self.num_experts  # False: the CPU op is skipped entirely
        # device -> the CPU op's expert ids there (``cpu_ids``)
        self._cpu_ids = {torch.device("cpu"): (self._local_cpu < 0).nonzero().flatten()}
        # CUDA graphs of the expert work, for a layer whose experts are all resident (``graphed.py``)
        self.graphs: LayerGraphs | None = None

    def cpu_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """[E - len(ids)] int64, sorted: the experts the CPU op computes (on ``device``, default
        the CPU; one copy kept per device)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        if device not in self._cpu_ids:
            self._cpu_ids[device] = self._cpu_ids[torch.device("cpu")].to(device)
        return self._cpu_ids[device]

    def begin(self, device: torch.device) -> None:
        """The layer's forward starts on ``device``: resident weights there (once), the streamed
        ones' copy queued (and the next streamed layer's prefetch: ``streamed.py``)."""
        if self.resident is not None:
            self.resident.to_device(device)
        if self._local is None or self._local.device != device:
            self._local = self._local_cpu.to(device)
            self._ids_dev = self._ids_cpu.to(device)
        if self.streamed is not None:
            self.streamed.begin(device)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] int64 (on the device) -> their device indices [T, k] (-1: not on the device);
        the ids themselves when the device holds every expert in order."""
        return ids if self._all else self._local[ids]

    def split(
        self, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [T, k] int64, weights [T, k] (on the device) -> (local [T, k]: device index of each
        pair or -1, cpu_ids [T, k]: ids with device pairs masked to -1, cpu_weights [T, k]: weights
        with device pairs zeroed -- differentiable, so their gradient there is 0 from the CPU op)."""
        local = self._local[ids]
        on_device = local >= 0
        return local, ids.masked_fill(on_device, -1), weights.masked_fill(on_device, 0)

    def start(
        self,
        x: torch.Tensor,
        local: torch.Tensor,
        weights: torch.Tensor,
        lora: LoraTensors,
        scaling: float,
        lora_on_device: bool = False,
    ) -> Callable[[], torch.Tensor]:
        """Queue the device experts' share of the layer output; returns ``finish``, to be called
        after the CPU op, which gives that share attached to the autograd graph.

        x [T, H], local [T, k] (from ``split``), weights [T, k], the layer's full LoRA (six fp32
        [E, ...] parameters: on the CPU, or on x's device when ``lora_on_device``) -> ``finish()``
        [T, H] float32 (float64 for float64 weights; x's dtype when every expert of the layer is
        resident) on x's device, differentiable w.r.t. x, weights and lora.

        Why two steps: the share is computed here on a graph of its own (``_DeviceShare``), and
        ``finish`` attaches it to the model's graph *after* the CPU op. Autograd runs the most
        recently created node first, so in the backward the device experts' kernels are queued
        before the CPU op's backward blocks (and the CPU op's incoming gradient copy is started
        before them): the GPU computes while the CPU does, both ways. At most one host sync (the
        pairs per placement) comes before any product is queued; none when every expert of the
        layer is resident, or every one streamed.
        """
        if self.graphs is not None and lora_on_device and not self.cpu_follows and self.streamed is None:
            # every expert resident: the layer's expert work replayed from a CUDA graph where one
            # is captured for this token count (``graphed.py``); None: run it eagerly below
            out = self.graphs.run(x, local, weights, tuple(lora), local.shape[1])
            if out is not None:
                return lambda: out
        order, parts = self._route(local)
        if not parts:
            zeros = torch.zeros(x.shape[0], x.shape[1], dtype=accum_dtype(self.dtype), device=x.device)
            self._done()
            return lambda: zeros
        if lora_on_device:  # the parameters live here: their rows, gradients by plain autograd
            src = lora[0].device
            ids = (
                self._ids_dev
                if self._ids_dev is not None and self._ids_dev.device == src
                else self._ids_cpu.to(src)
            )
            lo = tuple(lora) if self._all else tuple(t.index_select(0, ids) for t in lora)
            # a model left off the LoRA's device (built for a GPU, run on the CPU): the rows follow x
            lo = tuple(t.to(x.device) for t in lo)
        else:
            # this layer's LoRA rows of the device experts on the device; their gradients go back
            # into the CPU parameters (``_LoraToDevice``)
            lo = _LoraToDevice.apply(self, x.device, *lora)
        inputs = (x, weights, *lo)
        k = local.shape[1]
        # the LoRA's identity for the cast cache (``_lora_cast``): the parameters and their version
        # counters, which the optimizer's in-place steps advance (not the rows taken above: fresh
        # tensors each call, whose addresses and versions can repeat with other values)
        key = (*lora_key(lora), *(id(p) for p in lora))
        if not self.cpu_follows and self.streamed is None:
            # every expert of the layer resident: no CPU op to order the work around, so the share
            # goes on the model's graph as it is (a graph of its own and the nested backward that
            # differentiates it cost ~1.4 ms of host time a layer and pass in a profiled run); the share
            # in x's dtype, which the block rounds it to anyway: its gradient then comes in that dtype
            out = self._compute(x, weights, LoraTensors(*lo), scaling, order, parts, k, key, x.dtype)
            self._done()
            return lambda: out
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
            out = self._compute(x, weights, LoraTensors(*lo), scaling, order, parts, k, key)
            self._done()
            return lambda: out
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        # streamed weights saved for the backward are kept as references, not tensors: the
        # backward takes them from the device buffer again (``streamed.py``: reused or re-copied)
        hooks = self.streamed.saved_tensor_hooks() if self.streamed is not None else contextlib.nullcontext()
        with torch.enable_grad(), hooks:
            out = self._compute(leaves[0], leaves[1], LoraTensors(*leaves[2:]), scaling, order, parts, k, key)
        self._done()
        return lambda: _DeviceShare.apply((out, leaves, self), *inputs)

    def lora_on(self, device: torch.device, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The device experts' rows of the six CPU LoRA ``params`` ([E, ...] fp32) on ``device``
        ([len(ids), ...]): copied at the forward and reused by the recompute of a checkpointed layer
        while the parameters are unchanged (their version counters and storages: the optimizer
        updates them in place between steps)."""
        key = (device, *lora_key(params))
        if self._lora_dev is None or self._lora_key != key:
            rows = params if self._all else [p.index_select(0, self._ids_cpu) for p in params]
            self._lora_dev = [t.detach().to(device, copy=True) for t in rows]
            self._lora_key = key
            self.lora_copies += 1
        return self._lora_dev

    def drop_lora(self) -> None:
        self._lora_dev = self._lora_key = None

    def _done(self) -> None:
        if self.streamed is not None:
            self.streamed.done()

    def _route(self, local: torch.Tensor) -> tuple[torch.Tensor, list[_Part]]:
        """(order [T*k]: flat pair indices sorted by device index, the others (-1) first; the
        placements with pairs, in that order)."""
        flat = local.reshape(-1)
        order = sort_by_id(flat, len(self.ids))
        counts_dev = count_ids(flat + 1, len(self.ids) + 1)  # [pairs elsewhere, e0, e1, ...]
        r, n = self.num_resident, len(self.ids)
        spans = [(lambda: self.resident.weights, 0, r)] if r else []
        if n > r:
            spans.append((self.streamed.weights, r, n))
        if not self.cpu_follows and len(spans) == 1:
            # every pair is on the device, in one placement: no need to ask the device how many
            get, j0, j1 = spans[0]
            rows = flat.numel()
            return order, [_Part(get, j0, j1, 0, rows, Groups(counts_dev[1:], rows))] if rows else []
        counts = counts_dev.tolist()  # the one host sync
        parts, off = [], counts[0]
        for get, j0, j1 in spans:
            host = counts[1 + j0 : 1 + j1]
            rows = sum(host)
            if rows:
                parts.append(_Part(get, j0, j1, off, rows, Groups(counts_dev[1 + j0 : 1 + j1], rows, host)))
            off += rows
        return order, parts

    def _compute(
        self,
        x,
        weights,
        lo: LoraTensors,
        scaling: float,
        order,
        parts: list[_Part],
        k: int,
        key: tuple,
        out_dtype: torch.dtype | None = None,
    ):
        """The formula of the module doc for every device expert with pairs -> [T, H] accum dtype
        (``out_dtype`` where given and one placement has pairs):
        one grouped product per projection for the resident experts and one for the streamed ones,
        each placement's share one autograd node (``backends/grouped_device.py``
        ``FusedGroupedExperts``; ``compute_reference`` is its twin under plain autograd). ``key``
        names the LoRA's current values (``start``) for the cast cache."""
        out = None
        for part in parts:
            src = part.weights()  # streamed: the current stream waits (on the device) for their copy here
            pairs = order[part.offset : part.offset + part.rows]
            rows = LoraTensors(*(t[part.j0 : part.j1] for t in lo))
            share = FusedGroupedExperts.apply(
                x,
                weights,
                *rows,
                src,
                scaling,
                part.groups,
                pairs,
                k,
                self._lora_cast(part.j0, key),
                out_dtype if len(parts) == 1 else None,
            )
            out = share if out is None else out + share
        return out

    def _lora_cast(self, j0: int, key: tuple):
        """For a placement starting at local index ``j0``: the six LoRA slices -> ``stack_lora``'s
        layout in the weights' dtype, computed once while ``key`` (the parameters and their version
        counters) is unchanged, so the forward, the checkpointed recompute and every micro-batch of
        a step share one cast."""

        def cast(ga, gb, ua, ub, da, db):
            hit = self._casts.get(j0)
            if hit is None or hit[0] != key:
                hit = (key, stack_lora(ga, gb, ua, ub, da, db, self.dtype, self.spec))
                self._casts[j0] = hit
            return hit[1]

        return cast

    def compute_reference(
        self, x, weights, lo: LoraTensors, scaling: float, order, parts: list[_Part], k: int
    ):
        """``_compute`` under plain autograd, one op at a time (``grouped_expert_forward``): the
        reference twin the tests compare ``FusedGroupedExperts`` with."""
        dt = self.dtype
        out = torch.zeros(x.shape[0], x.shape[1], dtype=accum_dtype(dt), device=x.device)
        lo = LoraTensors(*(t.to(dt) for t in lo))
        w_flat = weights.reshape(-1)
        xd = x.to(dt)
        for part in parts:
            src = part.weights()
            pairs = order[part.offset : part.offset + part.rows]
            tok = torch.div(pairs, k, rounding_mode="floor")
            d = grouped_expert_forward(
                xd.index_select(0, tok),
                src,
                LoraTensors(*(t[part.j0 : part.j1] for t in lo)),
                scaling,
                part.groups,
            )
            w = w_flat.index_select(0, pairs).to(out.dtype)
            out = out.index_add(0, tok, d.to(out.dtype) * w[:, None])
        return out


@dataclass
class _Part:
    """One placement's share of a layer's pairs: ``weights()`` gives its experts' base weights on
    the device (local indices j0..j1-1); its ``rows`` pairs start at ``offset`` in the sorted order."""

    weights: Callable[[], ExpertWeights]
    j0: int
    j1: int
    offset: int
    rows: int
    groups: Groups


class _LoraToDevice(torch.autograd.Function):
    """apply(device_experts, device, *six CPU LoRA params) -> the device experts' rows of each on
    ``device``; backward: their gradients back to the CPU, into the experts' rows of [E, ...]."""

    @staticmethod
    def forward(ctx, dev, device, *params):
        ctx.dev = dev
        ctx.shapes = [p.shape for p in params]
        return tuple(t.detach() for t in dev.lora_on(device, params))

    @staticmethod
    def backward(ctx, *grads):
        dev = ctx.dev
        dev.drop_lora()  # the layer's last use in this step: free the device rows
        out = []
        for g, shape in zip(grads, ctx.shapes):
            if g is None:
                out.append(None)
                continue
            g = g.to("cpu")
            if not dev._all:
                g = g.new_zeros(shape).index_copy_(0, dev._ids_cpu, g)
            out.append(g)
        return None, None, *out


class _DeviceShare(torch.autograd.Function):
    """apply((out, leaves, device_experts), x, weights, *lora slices) -> out: attaches the device
    share, computed on its own graph from ``leaves`` (detached copies of the inputs), to the
    model's graph."""

    @staticmethod
    def forward(ctx, inner, *inputs):
        out, leaves, dev = inner
        ctx.inner = inner
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, leaves, dev = take_inner(ctx, "device experts")
        if dev.cpu_follows:
            prefetch_grad_out(grad)  # the CPU op's backward (next) gets the same gradient
        if dev.streamed is not None:
            dev.streamed.begin_backward()  # this layer's streamed weights back (reused or re-copied)
        grads = inner_grads(out, leaves, grad.to(out.dtype), zeros_for_unused=True)
        dev._done()
        return None, *grads
