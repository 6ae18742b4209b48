"""Experts computed on the training device (GPU-resident and streamed ones) with grouped products.

The device share of a layer (``runtime/device_experts.py``) holds up to all E experts of the layer.
A Python loop over experts costs ~25 small kernels (and as many autograd nodes) per expert and
pass: measured on the H200 for Qwen3-30B-A3B (128 experts, 2048 tokens, 4 layers), the loop took
~1 s per step where transformers' grouped experts take ~70 ms. Here every projection is one
grouped product over the group's experts (``grouped_products.py``: ``torch._grouped_mm`` over the
rows sorted by expert, or its loop where it does not run): ``grouped_expert_forward`` under
autograd, and ``FusedGroupedExperts``, the same formula as one autograd node with a hand-written
backward, the routing weights' product and the scatter back to tokens inside (on the plain
layout's weights or on the wide one's, ``grouped_wide.py``).

Shapes: N rows (pairs of the group's experts, sorted by expert), G experts, H hidden, I expert
intermediate, r LoRA rank. The base layout follows ``ExpertWeights.spec`` (``backends/base.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kt_ft.backends.activation import gated_act, gated_act_backward_into, gated_act_into
from kt_ft.backends.base import ExpertWeights, LoraTensors, accum_dtype
from kt_ft.backends.grouped_products import Groups, _t, base_mm, grouped_mm, grouped_mm_k
from kt_ft.backends.quant_weights import rebuild_quantized


def grouped_expert_forward(
    x: torch.Tensor, base: ExpertWeights, lora: LoraTensors, scaling: float, groups: Groups
) -> torch.Tensor:
    """Every expert of a group on its rows, differentiable (autograd) w.r.t. x and the LoRA.

    x [N, H] (rows sorted by expert, ``groups.counts`` rows each), ``base`` the group's G experts on
    x's device (``gate_up`` [G, 2I, H], ``down`` [G, H, I]; transposed layouts per ``base.spec``),
    ``lora`` their LoRA slices ([G, r, H], [G, I, r], ..., the compute dtype), s = ``scaling``:
    g = x Wg^T + s (x Ag^T) Bg^T, u = x Wu^T + s (x Au^T) Bu^T, h = act(g, u),
    d = h Wd^T + s (h Ad^T) Bd^T (+ the frozen biases where the family has them) -> d [N, H], x's dtype.
    """
    spec = base.spec
    inter = base.intermediate
    rank = lora.gate_a.shape[1]
    gs, us = spec.gate_up_cols(inter)
    gu = base_mm(x, base.gate_up, groups, not spec.transposed)
    if base.gate_up_bias is not None:
        gu = gu + base.gate_up_bias.index_select(0, groups.row_expert)
    # gate and up LoRA A as one product: [Ag; Au] [G, 2r, H]
    p = grouped_mm(x, _t(torch.cat([lora.gate_a, lora.up_a], 1)), groups)  # [N, 2r]
    lo_g = grouped_mm(p[:, :rank].contiguous(), _t(lora.gate_b), groups)  # [N, I]
    lo_u = grouped_mm(p[:, rank:].contiguous(), _t(lora.up_b), groups)
    g = gu[:, gs] + scaling * lo_g
    u = gu[:, us] + scaling * lo_u
    h = gated_act(g, u, spec).contiguous()  # [N, I]
    d = base_mm(h, base.down, groups, not spec.transposed)  # [N, H]
    d = d + scaling * grouped_mm(grouped_mm(h, _t(lora.down_a), groups), _t(lora.down_b), groups)
    if base.down_bias is not None:
        d = d + base.down_bias.index_select(0, groups.row_expert)
    return d


class FusedGroupedExperts(torch.autograd.Function):
    """``grouped_expert_forward`` and its gradient as one autograd node, with the routing weights'
    product and the scatter back to tokens inside: the same numbers, a fraction of the host work.

    apply(x [T, H], w [T, k], gate_a, gate_b, up_a, up_b, down_a, down_b (fp32 [G, ...] LoRA),
    base, scaling, groups, pairs [N] int64 (flat (token, slot) indices sorted by expert), k,
    lora_cast) -> out [T, H] float32 (float64 for float64 weights) with out[t] = sum over the pairs
    of token t of w * d (``grouped_expert_forward``'s d). Gradients for x, w and the six LoRA tensors.

    Why: under autograd the device share of one layer is ~40 graph nodes a pass (LoRA casts,
    slices, the seven grouped products, activation, weighting, scatter), and a LLaMA-Factory step
    on the GPU is bound by host time, not the GPU's (a profiled DeepSeek-V2-Lite step: 0.9 s of GPU
    work in 2.4 s): each node costs its launch plus the autograd engine's bookkeeping. Here the
    forward queues ~20 kernels and the backward ~35, with no per-node engine work. ``lora_cast``:
    a callable giving the LoRA in the compute dtype as ``stack_lora`` lays it out (cached by its
    caller across the passes of a step while the parameters are unchanged)."""

    @staticmethod
    def forward(
        ctx, x, w, ga, gb, ua, ub, da, db, base, scaling, groups, pairs, k, lora_cast, out_dtype=None
    ):
        out, saved, ctx.meta = fused_forward(
            x, w, (ga, gb, ua, ub, da, db), base, scaling, groups, pairs, k, lora_cast, out_dtype
        )
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = fused_backward(
            grad_out, ctx.saved_tensors, ctx.meta, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        return (*grads, None, None, None, None, None, None, None)


class FusedMeta(NamedTuple):
    """What ``fused_backward`` needs besides the saved tensors: sizes, dtypes and the layout."""

    spec: object
    inter: int
    scaling: float
    groups: Groups
    x_shape: torch.Size
    x_dtype: torch.dtype
    w_shape: torch.Size
    w_dtype: torch.dtype
    lora_dtypes: tuple
    quant_base: tuple | None  # quantized weights: the structure to rebuild them from the saved leaves
    wide: object | None = None  # the wide layout's buffers (``grouped_wide.WideExperts``) the forward read
    n_saved: int = 13  # saved tensors before the weights


def weight_tensors(base: ExpertWeights) -> tuple[torch.Tensor, ...]:
    """The dense weight tensors a backward of ``base`` reads (saved beside the activations)."""
    return base.wide.tensors() if base.wide is not None else (base.gate_up, base.down)


def fused_forward(
    x, w, lora, base, scaling, groups, pairs, k, lora_cast, out_dtype=None, load_lora=True, into=None
):
    """``FusedGroupedExperts``'s forward as a plain function (no autograd; also what a CUDA graph of
    the layer captures, ``runtime/graphed.py``): -> (out [T, H], the saved tensors, meta). Arguments as
    ``FusedGroupedExperts.apply``'s, ``lora`` the six LoRA tensors. ``out_dtype``: the output's dtype
    when every pair of the call is here (the weights' dtype saves the backward its fp32 passes:
    the output's gradient then comes in that dtype); else, and by default, the accum dtype.
    ``load_lora=False``: the wide layout's LoRA blocks already hold ``lora`` (the caller wrote them:
    ``graphed.py`` does once per change, outside its graphs). ``into``: tensors to write results
    into instead of new ones (the wide layout's ``xw``, ``hw`` and ``out``: a CUDA graph's static
    buffers, so its replay needs no copy of them); the saved tuple then holds those tensors."""
    ga, gb, ua, ub, da, db = lora
    dt = base.gate_up.dtype
    acc = accum_dtype(dt)
    spec = base.spec
    inter = base.intermediate
    tok = torch.div(pairs, k, rounding_mode="floor")
    if base.wide is not None:
        return _wide_forward(x, w, lora, base, scaling, groups, pairs, k, tok, out_dtype, load_lora, into)
    # [G, 2r, H] ([Ag; Au]), [G, 2I, 2r] (Bg, Bu in the gate / up rows, zeros elsewhere), Ad, Bd; dt
    a_gu, b_gu, ad, bd = lora_cast(ga, gb, ua, ub, da, db)
    xs = x.to(dt).index_select(0, tok)  # [N, H]
    quant = getattr(base.gate_up, "fmt", None) is not None  # kept quantized (any layout)
    # [N, 2I]: through the [G, H, 2I] view of the weights (one grouped product when dense)
    gu = base_mm(xs, base.gate_up, groups, not spec.transposed)
    if base.gate_up_bias is not None:
        gu += base.gate_up_bias.index_select(0, groups.row_expert)
    pa = grouped_mm(xs, _t(a_gu), groups)  # [N, 2r]: [x Ag^T | x Au^T]
    # both LoRA B products in one: [pg | pu] [G, 2r, 2I] puts pg Bg^T in the gate columns and
    # pu Bu^T in the up ones (the other blocks are zeros: exact)
    gu.add_(grouped_mm(pa, _t(b_gu), groups), alpha=scaling)
    gs, us = spec.gate_up_cols(inter)
    g, u = gu[:, gs], gu[:, us]
    h = gated_act(g, u, spec).contiguous()  # [N, I]
    pd = grouped_mm(h, _t(ad), groups)  # [N, r]
    d = base_mm(h, base.down, groups, not spec.transposed)
    d += scaling * grouped_mm(pd, _t(bd), groups)
    if base.down_bias is not None:
        d += base.down_bias.index_select(0, groups.row_expert)
    ws, out = _combine(d, w, pairs, tok, x.shape, acc, out_dtype)
    # quantized weights: their stored tensors are saved (streamed ones are views of a stream
    # buffer, which the saved-tensor hooks of ``runtime/streamed.py`` fetch back at backward), and
    # the structure to rebuild them on ctx
    if quant:
        quant_base = (base.gate_up.leaves_structure(), base.down.leaves_structure())
        w_saved = (*base.gate_up.leaves(), *base.down.leaves())
    else:
        quant_base = None
        w_saved = (base.gate_up, base.down)
    saved = (xs, gu, pa, h, pd, d, ws, tok, pairs, a_gu, b_gu, ad, bd, *w_saved)
    meta = FusedMeta(
        spec,
        inter,
        scaling,
        groups,
        x.shape,
        x.dtype,
        w.shape,
        w.dtype,
        tuple(t.dtype for t in lora),
        quant_base,
    )
    return out, saved, meta


def _combine(d, w, pairs, tok, x_shape, acc, out_dtype, out=None):
    """-> (ws [N] accum dtype: each row's routing weight, out [T, H]: the rows weighted and summed
    per token). Every (token, slot) pair of the call here: a gather, no atomics (``combine_all``,
    written into ``out`` where given)."""
    ws = w.reshape(-1).index_select(0, pairs).to(acc)  # [N]
    if pairs.numel() == w.numel():
        return ws, combine_all(d, w, pairs, acc, out_dtype, out=out)
    res = torch.zeros(x_shape[0], x_shape[1], dtype=acc, device=d.device)
    for lo_, hi in _row_slices(d.shape[0]):  # the weighted accum-dtype rows one slice at a time
        res.index_add_(0, tok[lo_:hi], d[lo_:hi] * ws[lo_:hi, None])  # promoted to ws's accum dtype
    return ws, (res if out is None else out.copy_(res))


def _wide_forward(x, w, lora, base, scaling, groups, pairs, k, tok, out_dtype, load_lora=True, into=None):
    """``fused_forward`` on weights in the wide layout (``grouped_wide.py``): the LoRA B products
    folded into the base ones. Saved: (xw [N, H + 2r] = [xs | pa], gu [N, 2I], hw [N, I + r] =
    [h | pd], d [N, H] or None (``_down_backward_unweighted`` needs none), ws, tok, pairs) and the
    two buffers."""
    wide = base.wide
    spec, inter, hid, r = base.spec, wide.inter, wide.hidden, wide.rank
    dt = wide.gu_buf.dtype
    acc = accum_dtype(dt)
    if load_lora:
        wide.load_lora(*lora, scaling)
    n = pairs.numel()
    into = into or {}
    # x with 2r zero columns, gathered per pair: the pa columns are then filled in place
    xw = torch.cat([x.to(dt), x.new_zeros(x.shape[0], 2 * r, dtype=dt)], 1)
    xw = torch.index_select(xw, 0, tok, out=into["xw"]) if "xw" in into else xw.index_select(0, tok)
    xw[:, hid:] = grouped_mm(xw[:, :hid], _t(wide.a_gu), groups)  # pa = xs A_gu^T [N, 2r]
    gu = grouped_mm(xw, _t(wide.gu_rows), groups)  # [N, 2I] = xs W^T + s pa B^T
    if base.gate_up_bias is not None:
        gu += base.gate_up_bias.index_select(0, groups.row_expert)
    gs, us = spec.gate_up_cols(inter)
    hw = into["hw"] if "hw" in into else torch.empty(n, inter + r, dtype=dt, device=x.device)
    gated_act_into(gu[:, gs], gu[:, us], spec, hw[:, :inter])
    hw[:, inter:] = grouped_mm(hw[:, :inter], _t(wide.a_d), groups)  # pd = h A_d^T [N, r]
    d = grouped_mm(hw, _t(wide.d_rows), groups)  # [N, H] = h W_d^T + s pd B_d^T
    if base.down_bias is not None:
        d += base.down_bias.index_select(0, groups.row_expert)
    ws, out = _combine(d, w, pairs, tok, x.shape, acc, out_dtype, out=into.get("out"))
    # d is left out where the backward can take the routing weights' gradient in h's space
    # (``_wide_backward``): every pair here, the output (so its gradient) in the rows' dtype, no bias
    keep_d = n != w.numel() or (out_dtype or acc) != dt or base.down_bias is not None
    saved = (xw, gu, hw, d if keep_d else None, ws, tok, pairs, *wide.tensors())
    meta = FusedMeta(
        spec, inter, scaling, groups, x.shape, x.dtype, w.shape, w.dtype,
        tuple(t.dtype for t in lora), None, wide, 7,
    )  # fmt: skip
    return out, saved, meta


def _output_grads(grad_out, d, ws, tok, pairs, w_shape, w_dtype, needs_w, gd):
    """The gradient of the rows d [N, H] (written into ``gd``, [N, H] d's dtype, any row stride)
    and of the routing weights ([T, k] ``w_dtype``, or None) from the output's gradient [T, H].

    Every pair of the call here with grad_out in d's dtype: whole, in that dtype (a routing
    weight's gradient is its row's dot with the token's gradient, summed in fp32; one [N, H]
    temporary, which ``LayerShape.gpu_act_bytes`` counts). Else a slice of rows at a time: the
    gathered accum-dtype rows of grad_out exist for one slice only
    (whole, they were 3 x [N, H] fp32 at once: ~0.4 GiB a Qwen3-30B-A3B layer at 2,048 tokens,
    which the GPU memory cap's plan does not hold)."""
    if pairs.numel() == w_shape.numel() and grad_out.dtype == d.dtype:
        # one gather of grad_out serves both gradients; the weights in d's dtype keep the product
        # on the same-dtype kernel (an fp32 broadcast into the strided gd ran at a third of the
        # speed on an H100), and a row's weight gradient is its dot with d in sorted order, then
        # scattered to its pair: no gather of d (was d into pair order and a batched product)
        gos = grad_out.index_select(0, tok)  # [N, H]
        torch.mul(gos, ws.to(d.dtype)[:, None], out=gd)
        if not needs_w:
            return None
        return _in_pair_order(gos.mul_(d).sum(1, dtype=torch.float32), pairs, w_shape, w_dtype)
    grad_ws = torch.empty(d.shape[0], dtype=grad_out.dtype, device=d.device) if needs_w else None
    for lo_, hi in _row_slices(d.shape[0]):
        gos = grad_out.index_select(0, tok[lo_:hi])  # [n, H] grad_out's dtype
        if grad_ws is not None:
            grad_ws[lo_:hi] = (gos * d[lo_:hi]).sum(1)  # promoted to gos's accum dtype
        gd[lo_:hi] = gos.mul_(ws[lo_:hi, None])
        del gos
    return None if grad_ws is None else _in_pair_order(grad_ws, pairs, w_shape, w_dtype)


def _in_pair_order(grad_ws: torch.Tensor, pairs: torch.Tensor, w_shape, w_dtype) -> torch.Tensor:
    """The routing weights' gradient [w_shape] ``w_dtype`` from the rows' ones grad_ws [N] (row i
    holds flat pair ``pairs[i]``); zero for pairs not among the rows (computed elsewhere)."""
    n = w_shape.numel()
    grad_w = (torch.empty if pairs.numel() == n else torch.zeros)(
        n, dtype=grad_ws.dtype, device=grad_ws.device
    )
    return grad_w.index_copy_(0, pairs, grad_ws).view(w_shape).to(w_dtype)


def _input_grad(dxs, grad_out, tok, pairs, x_shape, x_dtype, w_shape):
    """grad_x [T, H] ``x_dtype`` from the rows' input gradients dxs [N, H]: a token's k rows summed
    (every pair of the call here: a gather, no atomics), else scattered a slice at a time."""
    if pairs.numel() == w_shape.numel():
        return _by_token(dxs, pairs, w_shape[-1]).sum(1, dtype=grad_out.dtype).to(x_dtype)
    grad_x = torch.zeros(x_shape, dtype=grad_out.dtype, device=grad_out.device)
    for lo_, hi in _row_slices(dxs.shape[0]):  # the accum-dtype copy one slice at a time
        grad_x.index_add_(0, tok[lo_:hi], dxs[lo_:hi].to(grad_out.dtype))
    return grad_x.to(x_dtype)


def _wide_backward(grad_out, saved, meta: FusedMeta, needs_x: bool, needs_w: bool):
    """``fused_backward`` of ``_wide_forward``: the LoRA A products of the backward folded into the
    base ones through the buffers' left columns ([W; A])."""
    xw, gu, hw, d, ws, tok, pairs = saved[:7]
    wide, spec, inter, s = meta.wide, meta.spec, meta.inter, meta.scaling
    groups, hid, r = meta.groups, wide.hidden, wide.rank
    n, dt = hw.shape[0], hw.dtype
    if d is None:
        dh, grad_w, grad_da, grad_db = _down_backward_unweighted(grad_out, hw, ws, tok, pairs, meta, needs_w)
    else:
        gdw = torch.empty(n, hid + r, dtype=dt, device=hw.device)  # [gd | ts]
        grad_w = _output_grads(grad_out, d, ws, tok, pairs, meta.w_shape, meta.w_dtype, needs_w, gdw[:, :hid])
        gd = gdw[:, :hid]
        ts = grouped_mm(gd, wide.b_d, groups)  # [N, r] = s gd B_d
        gdw[:, hid:] = ts
        grad_db = grouped_mm_k(gd.t(), hw[:, inter:], groups).mul_(s)  # [G, H, r]
        grad_da = grouped_mm_k(ts.t(), hw[:, :inter], groups)  # [G, r, I]
        dh = grouped_mm(gdw, wide.d_cols, groups)  # [N, I] = gd W_d + ts A_d
        del gdw, gd, ts
    gs, us = spec.gate_up_cols(inter)
    dgw = torch.empty(n, 2 * inter + 2 * r, dtype=dt, device=hw.device)  # [dgu | dpa]
    dgu = dgw[:, : 2 * inter]
    gated_act_backward_into(dh, gu[:, gs], gu[:, us], spec, dgu[:, gs], dgu[:, us])
    del dh
    grad_bgu = grouped_mm_k(dgu.t(), xw[:, hid:], groups).mul_(s)  # [G, 2I, 2r]
    dpa = grouped_mm(dgu, wide.b_gu, groups)  # [N, 2r] = s dgu B_gu
    dgw[:, 2 * inter :] = dpa
    grad_agu = grouped_mm_k(dpa.t(), xw[:, :hid], groups)  # [G, 2r, H]
    grad_x = None
    if needs_x:
        dxs = grouped_mm(dgw, wide.gu_cols, groups)  # [N, H] = dgu W_gu + dpa A_gu
        grad_x = _input_grad(dxs, grad_out, tok, pairs, meta.x_shape, meta.x_dtype, meta.w_shape)
    return (grad_x, grad_w, *_lora_grads(grad_agu, grad_bgu, grad_da, grad_db, gs, us, r, meta.lora_dtypes))


def _down_backward_unweighted(grad_out, hw, ws, tok, pairs, meta: FusedMeta, needs_w: bool):
    """The wide backward's down part from the rows' unweighted gradient: -> (dh [N, I], grad_w
    [T, k] ``meta.w_dtype`` or None (``needs_w`` False), grad_da [G, r, I], grad_db [G, H, r]).

    Row i's output is w_i d_i, d_i = h_i W_d^T + s (h_i A_d^T) B_d^T, so with g_i its token's
    gradient: dh_i = w_i dh'_i where dh'_i = g_i W_d + s (g_i B_d) A_d (one product of [g | s g B_d]
    with the buffer's [W_d; A_d] columns), and the weight's gradient d_i . g_i = h_i . dh'_i, a dot
    over I instead of H. Why: no [N, H] d saved by the forward (a CUDA graph's largest copy), no
    [N, H] weighted copy of g; the LoRA down gradients take the weight through their r-wide
    factors instead."""
    wide, inter, s, groups = meta.wide, meta.inter, meta.scaling, meta.groups
    hid, r = wide.hidden, wide.rank
    dt = hw.dtype
    gow = torch.empty(hw.shape[0], hid + r, dtype=dt, device=hw.device)  # [g | s g B_d]
    gos = torch.index_select(grad_out.to(dt), 0, tok, out=gow[:, :hid])
    ts = grouped_mm(gos, wide.b_d, groups)  # [N, r] = s g B_d
    gow[:, hid:] = ts
    dh = grouped_mm(gow, wide.d_cols, groups)  # [N, I]: dh', before the row's weight
    wsc = ws.to(dt)[:, None]  # [N, 1]
    grad_db = grouped_mm_k(gos.t(), hw[:, inter:] * wsc, groups).mul_(s)  # [G, H, r] = s Σ g^T (w pd)
    del gow, gos
    grad_da = grouped_mm_k((ts * wsc).t(), hw[:, :inter], groups)  # [G, r, I] = Σ (w ts)^T h
    grad_w = None
    if needs_w:
        grad_ws = (hw[:, :inter] * dh).sum(1, dtype=torch.float32)  # [N]
        grad_w = _in_pair_order(grad_ws, pairs, meta.w_shape, meta.w_dtype)
    return dh.mul_(wsc), grad_w, grad_da, grad_db


def fused_backward(grad_out, saved, meta: FusedMeta, needs_x: bool, needs_w: bool):
    """``FusedGroupedExperts``'s backward as a plain function: grad_out [T, H] (the forward's output
    dtype: accum, or the weights' with ``out_dtype``), the tensors and meta ``fused_forward`` gave
    -> (grad_x or None, grad_w or None, six LoRA grads)."""
    if meta.wide is not None:
        return _wide_backward(grad_out, saved, meta, needs_x, needs_w)
    xs, gu, pa, h, pd, d, ws, tok, pairs, a_gu, b_gu, ad, bd, *w_saved = saved
    if meta.quant_base is not None:
        (gu_struct, n_gu), (d_struct, _) = meta.quant_base
        w_gu = rebuild_quantized(gu_struct, w_saved[:n_gu])
        w_d = rebuild_quantized(d_struct, w_saved[n_gu:])
    else:
        w_gu, w_d = w_saved
    # the spec and sizes only: the weights the backward reads come through saved_tensors
    # (where streamed ones are re-fetched: ``runtime/streamed.py``'s saved-tensor hooks)
    spec, inter, s, groups, x_shape, x_dtype, w_shape, w_dtype, lora_dtypes = meta[:9]
    r = ad.shape[1]
    # dL/dd [N, H] and the routing weights' gradient
    gd = torch.empty_like(d)
    grad_w = _output_grads(grad_out, d, ws, tok, pairs, w_shape, w_dtype, needs_w, gd)
    # down: d = h Wd^T + s (h Ad^T) Bd^T
    # dh = gd @ Wd [G, H, I]
    dh = base_mm(gd, w_d, groups, spec.transposed)
    t = grouped_mm(gd, bd, groups)  # [N, r]: gd @ Bd
    grad_db = grouped_mm_k(gd.t(), pd, groups).mul_(s)  # [G, H, r]
    del gd
    ts = t * s
    grad_da = grouped_mm_k(ts.t(), h, groups)  # [G, r, I]
    dh += grouped_mm(ts, ad, groups)
    gs, us = spec.gate_up_cols(inter)
    g, u = gu[:, gs], gu[:, us]
    dgu = torch.empty_like(gu)
    gated_act_backward_into(dh, g, u, spec, dgu[:, gs], dgu[:, us])
    del dh
    # gate / up LoRA B (the stacked [G, 2I, 2r]: its gate and up blocks), then A ([Ag; Au])
    grad_bgu = grouped_mm_k(dgu.t(), pa, groups).mul_(s)  # [G, 2I, 2r]
    dpa = grouped_mm(dgu, b_gu, groups).mul_(s)  # [N, 2r]
    grad_agu = grouped_mm_k(dpa.t(), xs, groups)  # [G, 2r, H]
    grad_x = None
    if needs_x:
        # dxs = dgu @ Wgu [G, 2I, H]
        wgu_x = base_mm(dgu, w_gu, groups, spec.transposed)
        del dgu
        dxs = wgu_x.add_(grouped_mm(dpa, a_gu, groups))
        grad_x = _input_grad(dxs, grad_out, tok, pairs, x_shape, x_dtype, w_shape)
    return (grad_x, grad_w, *_lora_grads(grad_agu, grad_bgu, grad_da, grad_db, gs, us, r, lora_dtypes))


def _lora_grads(grad_agu, grad_bgu, grad_da, grad_db, gs, us, r, dtypes) -> list[torch.Tensor]:
    """The six LoRA gradients (gate A, gate B, up A, up B, down A, down B) in ``dtypes`` from the
    stacked ones: [Ag; Au] [G, 2r, H], B_gu [G, 2I, 2r] (its gate rows' first r columns, its up
    rows' last r), Ad, Bd."""
    lo = (grad_agu[:, :r], grad_bgu[:, gs, :r], grad_agu[:, r:], grad_bgu[:, us, r:], grad_da, grad_db)
    return [g_.to(dtype) for g_, dtype in zip(lo, dtypes)]


def _by_token(rows: torch.Tensor, pairs: torch.Tensor, k: int) -> torch.Tensor:
    """rows [T k, X] sorted by expert (row i holds flat pair ``pairs[i]``, a permutation of 0..T k-1)
    -> [T, k, X] in pair order: one gather through the inverse permutation."""
    n = pairs.numel()
    inv = torch.empty_like(pairs).scatter_(0, pairs, torch.arange(n, device=pairs.device))
    return rows.index_select(0, inv).view(n // k, k, rows.shape[1])


def combine_all(
    d: torch.Tensor,
    w: torch.Tensor,
    pairs: torch.Tensor,
    acc: torch.dtype,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d [T k, H] (every pair of the call, sorted by expert), w [T, k] -> out [T, H] ``out_dtype``
    (default ``acc``), out[t] = sum_j w[t, j] d[pair (t, j)]: a gather of d into pair order and one
    batched product (fp32 accumulation inside it), where a scatter with float atomics into a zeroed
    [T, H] fp32 output took a [T k, H] fp32 temporary and T k H atomic adds. With w in d's dtype
    the product is d's dtype, rounded once (the MoE block rounds the share to that dtype anyway);
    else the weighted rows are summed in ``acc``. ``out``: [T, H] to write the result into
    (``out_dtype``'s; a CUDA graph's static buffer)."""
    t, k = w.shape
    dg = _by_token(d, pairs, k)  # [T, k, H]
    want = out_dtype or acc
    if out is not None and w.dtype == d.dtype == want and out.is_contiguous():
        return torch.bmm(w.reshape(t, 1, k), dg, out=out.view(t, 1, -1)).view(t, -1)
    if w.dtype == d.dtype:
        res = torch.bmm(w.reshape(t, 1, k), dg).view(t, -1)
    else:
        res = (dg.to(acc) * w.to(acc)[..., None]).sum(1)
    return res.to(want) if out is None else out.copy_(res)


BACKWARD_SLICE_ROWS = 4096  # rows of (token, expert) pairs a slice of the backward's fp32 work


def _row_slices(n: int):
    """(start, end) of ``BACKWARD_SLICE_ROWS``-row slices covering 0..n."""
    rows = BACKWARD_SLICE_ROWS
    return ((i, min(i + rows, n)) for i in range(0, n, rows))


def stack_lora(ga, gb, ua, ub, da, db, dtype: torch.dtype, spec) -> tuple[torch.Tensor, ...]:
    """The six LoRA tensors ([G, r, H], [G, I, r], ..., any dtype) as ``FusedGroupedExperts`` reads
    them, in ``dtype``: ([Ag; Au] [G, 2r, H], B_gu [G, 2I, 2r] with Bg in the gate rows' first r
    columns, Bu in the up rows' last r columns and zeros elsewhere (rows in the base layout's gate /
    up order, ``spec.gate_up_cols``), Ad, Bd)."""
    g, inter, r = gb.shape[0], gb.shape[1], gb.shape[2]
    gs, us = spec.gate_up_cols(inter)
    b_gu = torch.zeros(g, 2 * inter, 2 * r, dtype=dtype, device=gb.device)
    b_gu[:, gs, :r] = gb
    b_gu[:, us, r:] = ub
    return torch.cat([ga, ua], 1).to(dtype), b_gu, da.to(dtype), db.to(dtype)
