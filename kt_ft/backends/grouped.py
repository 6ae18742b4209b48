"""Portable fast backend: (token, slot) pairs sorted by expert once per call, dense GEMMs per
expert on contiguous slices, hand-written backward.

Layout choices (measured on a 16-core Sapphire-Rapids-class Xeon, see docs/benchmarks.md):
* each expert's rows are padded to a multiple of ``ROW_PAD`` (padding rows carry routing
  weight 0 and are never read back): oneDNN builds one GEMM kernel per shape and caches about
  a thousand, so raw per-expert row counts (a new shape almost every call) made every product
  pay a kernel build -- 5x slower on the GPU machine's Xeon;
* products write contiguous slices of buffers kept between calls (no GEMM into a strided view,
  no page faults of fresh allocations); a LoRA correction is written first and the frozen base
  product accumulates onto it (no temporary of the output's size, no pass adding it);
* gate and up LoRA run as one product each way: A_gu = [Ag; Au] [2r, H] and the
  block-diagonal B_gu = diag(Bg, Bu) [2I, 2r], built once per call;
* the rank-sized LoRA products (12 kinds, ~4 MFLOP each per expert at 128 rows) run as one
  ``bmm`` per group of experts with the same padded row count: the rows are laid out with the
  experts ordered by that count, so a group's rows are one [n, c, ...] view. Per expert they
  were 12 x 128 oneDNN calls of 40-90 us each on the Xeon, ~27% of the op at 2048 tokens
  (``scripts/profile_op.py``) for ~1.5% of its FLOPs;
* elementwise work runs once over all pairs in the compute dtype (``silu_backward`` for the
  gate derivative), as autograd would;
* the sum over the k experts of a token is a gather back to token order and one batched
  product (bf16 inputs, fp32 accumulation) instead of a scatter-add;
* the routing-weight gradient comes from products the input gradient needs anyway:
  dY.d = (dY Wd).h + s (dY Bd).(h Ad^T), so the expert outputs are not kept.

Experts that are not the plain silu layout (gpt_oss: transposed, interleaved, biased, clamped
activation) go to ``grouped_variant.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kt_ft.backends.base import ExpertBackend, ExpertWeights, LoraTensors, accum_dtype
from kt_ft.backends.grouped_layout import ROW_PAD, _Group, _Layout, _route_layout, _zero_null_rows
from kt_ft.backends.grouped_variant import variant_backward, variant_forward
from kt_ft.backends.quant_weights import is_quantized


def _nbytes(bufs: dict) -> int:
    """Bytes of the tensors a buffer dict holds (the run summary reports them)."""
    return sum(b.numel() * b.element_size() for b in bufs.values())


class _Workspace:
    """Scratch buffers for a call's temporaries, kept mapped between calls.

    A fresh large CPU allocation comes straight from the OS, and its first write pays a page
    fault per 4 KiB; buffers here are reused by every call of every layer (a call's
    temporaries are dead when it returns; the op runs on one thread). Costs the largest
    call's temporaries in RAM for the life of the process.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        buf = self._bufs.get((key, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._bufs[(key, dtype)] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return _nbytes(self._bufs)


_WS = _Workspace()
# experts kept quantized are dequantized this many bytes (in the compute dtype) at a time at most:
# large enough that a dequantizer call's fixed cost is small against its work (Qwen3-30B-A3B's
# gate_up: ten experts a call), small enough to stay a minor part of a layer's temporaries
CPU_DEQUANT_CHUNK_BYTES = 64 * 2**20


class _SavedBuffers:
    """The three tensors a forward keeps for its backward (gu, p, pd), recycled per
    layer: a set returns to its backend's free list when its backward has run, so the next
    forward of that layer writes into already-mapped memory. ``generation`` changes on every
    reuse; a backward on a context whose set was taken again refuses instead of reading
    another call's data."""

    def __init__(self) -> None:
        self.flat: dict[str, torch.Tensor] = {}
        self.generation = 0

    def view(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = shape[0] * shape[1]
        buf = self.flat.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype)
            self.flat[key] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return _nbytes(self.flat)


@dataclass
class _Ctx:
    base: ExpertWeights
    # [T, H] the chunk's input as given (the runner keeps it for the backward anyway): the backward
    # gathers the pairs' rows from it again instead of keeping them, k x [T, H] in the compute
    # dtype a layer (Kimi-K2's shapes at 2,048 tokens: 14 GB of host memory over its 60 layers)
    x: torch.Tensor
    tok: torch.Tensor  # [N] token of each row (padding rows: token 0)
    inv: torch.Tensor  # [T*k] row of flat pair t*k + slot
    layout: _Layout  # rows per expert (padded), in row order, and the equal-count groups
    ws: torch.Tensor  # [N, 1] routing weight of each row (padding rows: 0), compute dtype
    gu: torch.Tensor  # [N, 2I] gate/up pre-activations (LoRA included)
    p: torch.Tensor  # [N, 2r] xs @ A_gu^T
    pd: torch.Tensor  # [N, r] h @ Ad^T
    lora: LoraTensors  # compute-dtype copies (A_gu, B_gu are made from them again: not kept)
    shape: tuple[int, int]  # (T, k)
    scaling: float
    saved: _SavedBuffers  # owner of gu, p, pd
    generation: int  # saved.generation when this context was made


def _gate_up_lora(lc: LoraTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_gu = [Ag; Au] [E, 2r, H], B_gu = diag(Bg, Bu) [E, 2I, 2r]: gate_b top-left, up_b bottom-right),
    in workspace buffers (a call's temporaries: ~20 MB a DeepSeek-V2-Lite layer). One product with
    the block-diagonal B_gu (half zeros) measured faster than two into gu's or dp's strided halves."""
    e, inter, rank = lc.gate_b.shape
    dt = lc.gate_b.dtype
    a_gu = torch.cat(
        [lc.gate_a, lc.up_a], dim=1, out=_WS.get("lora_a_gu", (e, 2 * rank, lc.gate_a.shape[2]), dt)
    )
    b_gu = _WS.get("lora_b_gu", (e, 2 * inter, 2 * rank), dt).zero_()
    b_gu[:, :inter, :rank] = lc.gate_b
    b_gu[:, inter:, rank:] = lc.up_b
    return a_gu, b_gu


class GroupedTorchBackend(ExpertBackend):
    name = "torch"
    row_pad = ROW_PAD  # rows of each expert padded to a multiple of this (see the module doc)

    def __init__(self) -> None:
        self._free: list[_SavedBuffers] = []
        self._sets = 0  # saved-state sets made (each lives as long as the backend)

    # --- what a subclass may replace: the compute dtype and the four frozen-base products ------

    def _compute_dtype(self, base: ExpertWeights) -> torch.dtype:
        """Dtype of the activations, LoRA copies and every temporary: the weights' own."""
        return base.gate_up.dtype

    # Each adds its product onto ``out``, which holds the LoRA term already: the LoRA products write
    # straight into the buffer the base product then accumulates into, so no [N, 2I] / [N, H]
    # temporary and no pass adding it (per expert here the sum stays in cache; the native
    # backend's GEMMs accumulate in the tile). Padding rows' values are never read back.

    def _gate_up(self, layout: _Layout, base: ExpertWeights, xs: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows of e] += xs[rows of e] @ gate_up[e]^T ([N, H] -> [N, 2I]), every expert with rows."""
        self._base_products(layout, base.gate_up, lambda sl, w: out[sl].add_(torch.mm(xs[sl], w.t())))

    def _down(self, layout: _Layout, base: ExpertWeights, h: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows of e] += h[rows of e] @ down[e]^T ([N, I] -> [N, H])."""
        self._base_products(layout, base.down, lambda sl, w: out[sl].add_(torch.mm(h[sl], w.t())))

    def _down_grad(self, layout: _Layout, base: ExpertWeights, gys: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows of e] += gys[rows of e] @ down[e] ([N, H] -> [N, I]): grad through the frozen down."""
        self._base_products(layout, base.down, lambda sl, w: out[sl].add_(torch.mm(gys[sl], w)))

    def _gate_up_grad(
        self, layout: _Layout, base: ExpertWeights, dgu: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out[rows of e] += dgu[rows of e] @ gate_up[e] ([N, 2I] -> [N, H])."""
        self._base_products(layout, base.gate_up, lambda sl, w: out[sl].add_(torch.mm(dgu[sl], w)))

    # --- how the base products reach each expert's weight ------------------------------------

    def _base_products(self, layout: _Layout, w, product: Callable[[slice, torch.Tensor], object]) -> None:
        """``product(rows of e, w[e])`` for every expert e with rows. Dense ``w`` [E, M, K]: through
        ``_for_experts``. Kept quantized (``QuantizedExperts``): the experts with rows are dequantized
        a run of consecutive ids at a time into one reused buffer of at most ``CPU_DEQUANT_CHUNK_BYTES``
        (one expert if larger), then each one's product runs on its slice: one dequantizer call (one
        start of the native kernel's thread team, ~10 us a thread) a run instead of one an expert."""
        if not is_quantized(w):
            self._for_experts(layout, lambda e, sl: product(sl, w[e]))
            return
        rows_of = dict(layout.slices)
        ids = sorted(rows_of)
        per = max(1, CPU_DEQUANT_CHUNK_BYTES // (w.shape[1] * w.shape[2] * w.dtype.itemsize))
        i = 0
        while i < len(ids):
            j = i + 1
            while j < len(ids) and ids[j] == ids[j - 1] + 1 and j - i < per:
                j += 1
            lo, hi = ids[i], ids[j - 1] + 1
            buf = _WS.get("dequant", (hi - lo, sum(w.part_rows), w.cols), w.dtype)
            chunk = w.experts(lo, hi, out=buf)
            for e in ids[i:j]:
                product(rows_of[e], chunk[e - lo])
            i = j

    def _for_experts(self, layout: _Layout, *products: Callable[[int, slice], object]) -> None:
        """Run every ``product(e, rows)`` for each expert e with rows, kind by kind: alternating big
        and rank-sized products per expert measured several times slower on the Xeon than running
        each kind back to back. Products write disjoint rows / experts of preallocated buffers."""
        for fn in products:
            for e, sl in layout.slices:
                fn(e, sl)

    def _for_groups(self, layout: _Layout, *products: Callable[[_Group], object]) -> None:
        """Run every ``product(group)`` for each group of equal-count experts, kind by kind (the
        rank-sized LoRA products, one ``bmm`` a group)."""
        for fn in products:
            for g in layout.groups:
                fn(g)

    # --- rows between token order and expert order (the native backend: one C++ pass each) --------

    def _gather(
        self, base: ExpertWeights, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """out [N, C] = src[idx] in out's dtype (src [T, C], any float dtype). Returns out."""
        return torch.index_select(src.to(out.dtype), 0, idx, out=out)

    def _combine(
        self, base: ExpertWeights, src: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor | None, t: int
    ) -> torch.Tensor:
        """[T, C] = sum over each token's k slots j of weights[t, j] * src[inv[t k + j]] (weights None:
        1), src [N, C] in the compute dtype. Back to token order, then [T,1,k] @ [T,k,C]: fp32
        accumulation, one rounding to the compute dtype (.sum(1, dtype=float32) first converted the
        whole [T k, C] gather to float32: 180 -> 91 ms at 4096 tokens, Qwen3-30B-A3B layer, 2 threads)."""
        k, cols = inv.numel() // t, src.shape[1]
        rows = torch.index_select(src, 0, inv, out=_WS.get("tok_rows", (t * k, cols), src.dtype)).view(
            t, k, cols
        )
        w = rows.new_ones(t, 1, k) if weights is None else weights.view(t, 1, k)
        return torch.bmm(w, rows).view(t, cols)

    # --- the activation between the products (the native backend fuses each into one pass) ---------

    def _activation(
        self, base: ExpertWeights, gu: torch.Tensor, h: torch.Tensor, keep: torch.Tensor | None
    ) -> None:
        """h [N, I] = silu(gu[:, :I]) * gu[:, I:] (gu [N, 2I], the compute dtype); ``keep`` (a
        narrower dtype, or None) gets a copy of gu for the backward."""
        inter = h.shape[1]
        torch.ops.aten.silu.out(gu[:, :inter], out=h)
        h.mul_(gu[:, inter:])
        if keep is not None:
            keep.copy_(gu)

    def _activation_backward(
        self, base: ExpertWeights, gu: torch.Tensor, q: torch.Tensor, ws: torch.Tensor, dgu: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From gu [N, 2I] (as kept: possibly narrower than the compute dtype), q [N, I] (the grad of
        h per unit routing weight) and ws [N, 1] (routing weights): writes dgu [N, 2I] (the grads of
        gate and up for dh = ws q) and returns (h = silu(g) u [N, I], grad_ws = rowsum(h q) [N] in
        the accumulation dtype). h lives in the workspace; q may be overwritten."""
        dt, n_pairs, inter = q.dtype, q.shape[0], q.shape[1]
        if gu.dtype != dt:
            gu = _WS.get("b_gu", tuple(gu.shape), dt).copy_(gu)
        g, u = gu[:, :inter], gu[:, inter:]
        silu_g = torch.ops.aten.silu.out(g, out=_WS.get("b_silu", (n_pairs, inter), dt))
        h = torch.mul(silu_g, u, out=_WS.get("h", (n_pairs, inter), dt))
        # dY.d with d = h Wd^T + s (h Ad^T) Bd^T is h.q. Summed in the compute dtype (its CPU
        # reduction accumulates in float32) and then widened: sum(dtype=float32) first copied the
        # [N, I] product to float32 (2.5x slower for this line)
        hq = torch.mul(h, q, out=_WS.get("b_nI", (n_pairs, inter), dt))
        grad_ws = hq.sum(-1).to(accum_dtype(dt))
        dh = q.mul_(ws)  # [N, I] grad of h
        dhu = torch.mul(dh, u, out=hq)
        torch.ops.aten.silu_backward(dhu, g, grad_input=dgu[:, :inter])
        torch.mul(dh, silu_g, out=dgu[:, inter:])
        return h, grad_ws

    def _saved_gu_dtype(self, base: ExpertWeights, dt: torch.dtype) -> torch.dtype:
        """Dtype gu is kept in between a forward and its backward: the compute dtype."""
        return dt

    def _take_saved(self) -> _SavedBuffers:
        if self._free:
            saved = self._free.pop()
        else:
            saved, self._sets = _SavedBuffers(), self._sets + 1
        saved.generation += 1
        return saved

    def host_bytes(self) -> tuple[int, int]:
        """(saved-state sets made, bytes of those back in the free list): at the end of a run every
        set is back, so this is the memory the backward state of this backend's layers holds."""
        return self._sets, sum(s.nbytes() for s in self._free)

    def forward(self, x, ids, weights, base: ExpertWeights, lora: LoraTensors, scaling, needs_grad):
        if not base.is_plain:  # transposed / interleaved / biased / clamped experts (gpt_oss)
            return variant_forward(x, ids, weights, base, lora, scaling, needs_grad)
        dt = self._compute_dtype(base)
        num_experts, two_i, hidden = base.gate_up.shape
        inter = two_i // 2
        rank = lora.gate_a.shape[1]
        t, k = ids.shape
        s = scaling
        lc = LoraTensors(*(w.detach().to(dt) for w in lora))
        a_gu, b_gu = _gate_up_lora(lc)

        tok, inv, ws, layout = _route_layout(ids, weights.to(dt), num_experts, row_pad=self.row_pad)
        n_pairs = tok.numel()
        saved = self._take_saved() if needs_grad else None

        def buf(key, cols):  # saved for backward: recycled per layer; else call-local scratch
            shape = (n_pairs, cols)
            return saved.view(key, shape, dt) if saved is not None else _WS.get(f"f_{key}", shape, dt)

        # [N, H]: scratch, not saved (the backward gathers it again from x: ``_Ctx.x``)
        xs = self._gather(base, x, tok, _WS.get("f_xs", (n_pairs, hidden), dt))

        keep_dt = self._saved_gu_dtype(base, dt)
        # gu in the compute dtype; kept for the backward as it is, or (keep_dt narrower) a copy is
        gu = buf("gu", two_i) if keep_dt == dt else _WS.get("f_gu", (n_pairs, two_i), dt)
        p = buf("p", 2 * rank)
        self._for_groups(
            layout,
            lambda g: torch.bmm(g.view(xs), g.pick(a_gu).transpose(1, 2), out=g.view(p)),
            # s * p B_gu^T into gu (beta 0: gu's old contents are not read), the base product adds on
            lambda g: g.view(gu).baddbmm_(g.view(p), g.pick(b_gu).transpose(1, 2), beta=0, alpha=s),
        )
        self._gate_up(layout, base, xs, gu)

        # [N, I] in a workspace buffer: a fresh allocation this size comes from the OS and pays a page
        # fault per 4 KiB at its first write (~200k faults a DeepSeek-V2-Lite layer at 2,048 tokens)
        h = _WS.get("h", (n_pairs, inter), dt)
        keep = saved.view("gu", (n_pairs, two_i), keep_dt) if keep_dt != dt and saved is not None else None
        self._activation(base, gu, h, keep)
        gu = gu if keep is None else keep
        d = _WS.get("f_d", (n_pairs, hidden), dt)
        pd = buf("pd", rank)
        self._for_groups(
            layout,
            lambda g: torch.bmm(g.view(h), g.pick(lc.down_a).transpose(1, 2), out=g.view(pd)),
            lambda g: g.view(d).baddbmm_(g.view(pd), g.pick(lc.down_b).transpose(1, 2), beta=0, alpha=s),
        )
        self._down(layout, base, h, d)
        h = None  # the products above capture the name
        _zero_null_rows(d, layout.counts)

        # out_t = sum_k w_tk d_tk: back to token order, then [T,1,k] @ [T,k,H] (fp32 accumulation)
        out = self._combine(base, d, inv, weights.to(dt), t)
        if not needs_grad:
            return out, None
        return out, _Ctx(base, x, tok, inv, layout, ws, gu, p, pd, lc, (t, k), s, saved, saved.generation)

    def backward(self, ctx: _Ctx, grad_out: torch.Tensor):
        if not isinstance(ctx, _Ctx):  # a grouped_variant context
            return variant_backward(ctx, grad_out)
        if ctx.saved.generation != ctx.generation:
            raise RuntimeError(
                "kt-ft torch backend: this forward's saved state was reused by a later forward of the "
                "same layer (a second backward through an old graph after a new forward is not supported)"
            )
        base, lc, s, ws = ctx.base, ctx.lora, ctx.scaling, ctx.ws
        dt = ctx.p.dtype  # the compute dtype (gu may be kept narrower: _saved_gu_dtype)
        acc = accum_dtype(dt)
        t, k = ctx.shape
        n_pairs, hidden = ctx.tok.numel(), ctx.x.shape[1]
        rank = lc.gate_a.shape[1]
        inter = ctx.gu.shape[1] // 2
        num_experts = lc.gate_a.shape[0]
        a_gu, b_gu = _gate_up_lora(lc)
        gys = self._gather(base, grad_out, ctx.tok, _WS.get("b_gys", (n_pairs, hidden), dt))

        # down projection: qa = dY Bd, q = dY (Wd + s Bd Ad) = dY Wd + s qa Ad: the gradient of the
        # expert's input to down per unit routing weight, its LoRA term first (the base adds on)
        q = _WS.get("b_q", (n_pairs, inter), dt)
        qa = _WS.get("b_qa", (n_pairs, rank), dt)
        lay = ctx.layout
        self._for_groups(
            lay,
            lambda g: torch.bmm(g.view(gys), g.pick(lc.down_b), out=g.view(qa)),
            lambda g: g.view(q).baddbmm_(g.view(qa), g.pick(lc.down_a), beta=0, alpha=s),
        )
        self._down_grad(lay, base, gys, q)
        # the activation's backward: h again, dgu, and the routing-weight gradient h.q
        dgu = _WS.get("b_dgu", (n_pairs, 2 * inter), dt)
        h, grad_ws = self._activation_backward(base, ctx.gu, q, ws, dgu)
        q = None
        dpd = qa.mul_(ws).mul_(s)  # [N, r] grad of pd = h Ad^T (qa is not needed any more)
        wpd = ctx.pd * ws * s  # [N, r]: dBd = dY^T (s w pd)
        # the weight gradients as [r, X] = (rows^T [r, c]) @ (rows [c, X]) per expert: the product streams
        # the wide operand's rows; the transposed form ([X, c] @ [c, r]) ran at ~10 GFLOP/s on 2 cores
        # (a quarter of the op's LoRA time); transposed back once, small
        grads_t = {  # the B grads as [E, r, X] (X = H for down, I for gate and up)
            "down_b": _WS.get("b_gdb", (num_experts, rank, hidden), dt),
            "gate_b": _WS.get("b_ggb", (num_experts, rank, inter), dt),
            "up_b": _WS.get("b_gub", (num_experts, rank, inter), dt),
        }
        down_a = torch.empty(lc.down_a.shape, dtype=dt)
        self._for_groups(
            lay,
            lambda g: g.put(grads_t["down_b"], torch.bmm(g.view(wpd).transpose(1, 2), g.view(gys))),
            lambda g: g.put(down_a, torch.bmm(g.view(dpd).transpose(1, 2), g.view(h))),
        )
        gys = h = None  # free the views

        dxs = _WS.get("b_dxs", (n_pairs, hidden), dt)
        dp = _WS.get("b_dp", (n_pairs, 2 * rank), dt)
        da_gu = torch.empty(num_experts, 2 * rank, hidden, dtype=dt)  # gate_a, up_a leave the op as its views
        p = ctx.p
        self._for_groups(
            lay,
            lambda g: g.put(
                grads_t["gate_b"],
                torch.bmm(g.view(p)[:, :, :rank].transpose(1, 2), g.view(dgu)[:, :, :inter]),
            ),
            lambda g: g.put(
                grads_t["up_b"], torch.bmm(g.view(p)[:, :, rank:].transpose(1, 2), g.view(dgu)[:, :, inter:])
            ),
            lambda g: torch.bmm(g.view(dgu), g.pick(b_gu), out=g.view(dp)),  # dp = s [dg Bg, du Bu]
        )
        dp.mul_(s)
        xs = self._gather(base, ctx.x, ctx.tok, _WS.get("b_xs", (n_pairs, hidden), dt))
        self._for_groups(
            lay,
            lambda g: g.put(da_gu, torch.bmm(g.view(dp).transpose(1, 2), g.view(xs))),
            lambda g: torch.bmm(g.view(dp), g.pick(a_gu), out=g.view(dxs)),
        )
        self._gate_up_grad(lay, base, dgu, dxs)
        _zero_null_rows(dxs, lay.counts)
        _zero_null_rows(grad_ws, lay.counts)

        # experts without tokens got no product: their LoRA grads are zero
        empty = [e for e, n in enumerate(lay.counts) if n == 0]
        for buf in (*grads_t.values(), down_a, da_gu):
            if empty:
                buf[empty] = 0
        grads = {n: t_.transpose(1, 2).contiguous() for n, t_ in grads_t.items()}  # -> [E, X, r]
        grads["gate_b"].mul_(s)
        grads["up_b"].mul_(s)
        grads["down_a"] = down_a
        grads["gate_a"], grads["up_a"] = da_gu[:, :rank], da_gu[:, rank:]

        grad_x = self._combine(base, dxs, ctx.inv, None, t).to(acc)  # the sum over a token's k slots
        grad_w = grad_ws.index_select(0, ctx.inv).view(t, k)
        if ctx.saved not in self._free:  # a repeated backward (retain_graph) returns it once
            self._free.append(ctx.saved)
        return grad_x, grad_w, LoraTensors(**{n: grads[n].to(acc) for n in lc._fields})
