"""The ``torch`` backend's path for experts that are not the plain silu layout (gpt_oss).

``GroupedTorchBackend`` hands a call here when its ``ExpertWeights`` is not plain (see
``ExpertWeights.is_plain``): a transposed base (``gate_up`` [E, H, 2I], ``down`` [E, I, H],
computed as x @ W), gate/up interleaved along the 2I axis, frozen biases, and the activation of
``ExpertSpec`` (``activation.py``). Same plan as the plain path (pairs sorted by expert and
padded, per-expert GEMMs on contiguous slices, hand-written backward that never forms B @ A),
written separately so the plain path stays exactly as tuned; the base weights are read in
place, never copied or reordered:

* the gate/up LoRA runs as one product each way, A_gu = [Ag; Au] [E, 2r, H] and B_gu
  [E, 2I, 2r] with Bg on the gate rows and Bu on the up rows *in the base's 2I order*
  (interleaved for gpt_oss), so the LoRA correction lands on the base product's columns;
* biases are added per row (each row's expert), in the compute dtype; they are frozen, so the
  backward has no bias gradients, but the down bias is part of each expert's output d and so
  of the routing-weight gradient: dY.d = (dY Wd).h + s (dY Bd).(h Ad^T) + dY.bd;
* the activation's derivative (clamp masks included) is ``gated_act_backward``.

Temporaries are plain allocations (the plain path's workspace and buffer recycling are not
ported here yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kt_ft.backends.activation import gated_act, gated_act_backward
from kt_ft.backends.base import ExpertWeights, LoraTensors, accum_dtype
from kt_ft.backends.grouped_layout import _expert_slices, _route, _zero_null_rows


@dataclass
class VariantCtx:
    base: ExpertWeights
    xs: torch.Tensor  # [N, H] inputs of the expert-sorted, padded rows, compute dtype
    tok: torch.Tensor  # [N] token of each row
    inv: torch.Tensor  # [T*k] row of flat pair t*k + slot
    counts: list[int]  # rows per expert (padded)
    ws: torch.Tensor  # [N, 1] routing weight per row (padding rows: 0)
    gu: torch.Tensor  # [N, 2I] gate/up pre-activations (LoRA and bias included), base column order
    p: torch.Tensor  # [N, 2r] xs @ A_gu^T
    pd: torch.Tensor  # [N, r] h @ Ad^T
    lora: LoraTensors  # compute-dtype copies
    a_gu: torch.Tensor  # [E, 2r, H]
    b_gu: torch.Tensor  # [E, 2I, 2r]
    shape: tuple[int, int]  # (T, k)
    scaling: float


def _w_gate_up(base: ExpertWeights, e: int) -> torch.Tensor:
    """Expert e's gate/up weight as the right operand of x @ W: [H, 2I] (a view)."""
    return base.gate_up[e] if base.spec.transposed else base.gate_up[e].t()


def _w_down(base: ExpertWeights, e: int) -> torch.Tensor:
    """Expert e's down weight as the right operand of h @ W: [I, H] (a view)."""
    return base.down[e] if base.spec.transposed else base.down[e].t()


def _b_gu(base: ExpertWeights, gate_b: torch.Tensor, up_b: torch.Tensor) -> torch.Tensor:
    """[E, I, r] x2 -> [E, 2I, 2r]: gate_b on the gate rows / first r columns, up_b on the up rows /
    last r columns, rows in the base's 2I order."""
    e, inter, rank = gate_b.shape
    gs, us = base.spec.gate_up_cols(inter)
    out = gate_b.new_zeros(e, 2 * inter, 2 * rank)
    out[:, gs, :rank] = gate_b
    out[:, us, rank:] = up_b
    return out


def _add_row_bias(y: torch.Tensor, bias: torch.Tensor | None, counts: list[int]) -> None:
    """y[rows of e] += bias[e] for every expert with rows (in place, y's dtype)."""
    if bias is None:
        return
    b = bias.to(y.dtype)
    for e, sl in _expert_slices(counts):
        y[sl] += b[e]


def variant_forward(
    x, ids, weights, base: ExpertWeights, lora: LoraTensors, scaling: float, needs_grad: bool
):
    """Same contract as ``ExpertBackend.forward``: (out [T, H] compute dtype, VariantCtx | None)."""
    dt = base.gate_up.dtype
    num_experts, inter, hidden = base.num_experts, base.intermediate, base.hidden
    rank = lora.gate_a.shape[1]
    t, k = ids.shape
    s = scaling
    gs, us = base.spec.gate_up_cols(inter)
    lc = LoraTensors(*(w.detach().to(dt) for w in lora))
    a_gu = torch.cat([lc.gate_a, lc.up_a], dim=1)
    b_gu = _b_gu(base, lc.gate_b, lc.up_b)

    tok, inv, ws, counts = _route(ids, weights.to(dt), num_experts)
    n_rows = tok.numel()
    xs = x.to(dt).index_select(0, tok)  # [N, H]
    p = torch.empty(n_rows, 2 * rank, dtype=dt)
    lo = torch.empty(n_rows, 2 * inter, dtype=dt)
    gu = torch.empty(n_rows, 2 * inter, dtype=dt)
    for e, sl in _expert_slices(counts):
        torch.mm(xs[sl], a_gu[e].t(), out=p[sl])
    for e, sl in _expert_slices(counts):
        torch.mm(p[sl], b_gu[e].t(), out=lo[sl])
    for e, sl in _expert_slices(counts):
        torch.mm(xs[sl], _w_gate_up(base, e), out=gu[sl])
    gu.add_(lo, alpha=s)
    del lo
    _add_row_bias(gu, base.gate_up_bias, counts)

    h = gated_act(gu[:, gs], gu[:, us], base.spec)  # [N, I]
    pd = torch.empty(n_rows, rank, dtype=dt)
    lo = torch.empty(n_rows, hidden, dtype=dt)
    d = torch.empty(n_rows, hidden, dtype=dt)
    for e, sl in _expert_slices(counts):
        torch.mm(h[sl], lc.down_a[e].t(), out=pd[sl])
    for e, sl in _expert_slices(counts):
        torch.mm(pd[sl], lc.down_b[e].t(), out=lo[sl])
    for e, sl in _expert_slices(counts):
        torch.mm(h[sl], _w_down(base, e), out=d[sl])
    d.add_(lo, alpha=s)
    del lo, h
    _add_row_bias(d, base.down_bias, counts)
    _zero_null_rows(d, counts)  # masked pairs (negative ids) point there

    # out_t = sum_k w_tk d_tk: back to token order, then [T,1,k] @ [T,k,H]
    out = torch.bmm(weights.to(dt).view(t, 1, k), d.index_select(0, inv).view(t, k, hidden)).view(t, hidden)
    if not needs_grad:
        return out, None
    return out, VariantCtx(base, xs, tok, inv, counts, ws, gu, p, pd, lc, a_gu, b_gu, (t, k), s)


def variant_backward(ctx: VariantCtx, grad_out: torch.Tensor):
    """Same contract as ``ExpertBackend.backward``: (grad_x [T, H], grad_weights [T, k], LoRA grads),
    all in accum_dtype."""
    base, lc, s, ws, counts = ctx.base, ctx.lora, ctx.scaling, ctx.ws, ctx.counts
    dt = ctx.xs.dtype
    acc = accum_dtype(dt)
    t, k = ctx.shape
    n_rows, hidden = ctx.xs.shape
    rank = lc.gate_a.shape[1]
    inter = base.intermediate
    num_experts = base.num_experts
    gs, us = base.spec.gate_up_cols(inter)
    g, u = ctx.gu[:, gs], ctx.gu[:, us]
    h = gated_act(g, u, base.spec)
    gys = grad_out.to(dt).index_select(0, ctx.tok)  # [N, H]

    # down projection: q = dY Wd^T-side product [N, I], qa = dY Bd [N, r]
    q = torch.empty(n_rows, inter, dtype=dt)
    qa = torch.empty(n_rows, rank, dtype=dt)
    for e, sl in _expert_slices(counts):
        torch.mm(gys[sl], lc.down_b[e], out=qa[sl])
    for e, sl in _expert_slices(counts):
        torch.mm(gys[sl], _w_down(base, e).t(), out=q[sl])
    grad_ws = (h * q).sum(-1, dtype=acc) + s * (ctx.pd * qa).sum(-1, dtype=acc)  # [N]
    if base.down_bias is not None:  # d includes the down bias: dY . bd
        bd = base.down_bias.to(acc)
        for e, sl in _expert_slices(counts):
            grad_ws[sl] += gys[sl].to(acc) @ bd[e]
    dpd = qa.mul_(ws).mul_(s)  # [N, r] grad of pd = h Ad^T
    wpd = ctx.pd * ws * s  # [N, r]: dBd = dY^T (s w pd)
    dh = q.mul_(ws)  # [N, I] base part of grad h
    grads = {n: torch.empty(w.shape, dtype=dt) for n, w in lc._asdict().items()}
    for e, sl in _expert_slices(counts):
        torch.mm(gys[sl].t(), wpd[sl], out=grads["down_b"][e])
    for e, sl in _expert_slices(counts):
        torch.mm(dpd[sl].t(), h[sl], out=grads["down_a"][e])
    for e, sl in _expert_slices(counts):
        dh[sl] += dpd[sl] @ lc.down_a[e]
    del gys, h

    dgu = torch.empty(n_rows, 2 * inter, dtype=dt)  # base column order, like gu
    dgu[:, gs], dgu[:, us] = gated_act_backward(dh, g, u, base.spec)
    del dh

    dxs = torch.empty(n_rows, hidden, dtype=dt)
    lo = torch.empty(n_rows, hidden, dtype=dt)
    dp = torch.empty(n_rows, 2 * rank, dtype=dt)
    db_gu = torch.empty(num_experts, 2 * inter, 2 * rank, dtype=dt)
    da_gu = torch.empty(num_experts, 2 * rank, hidden, dtype=dt)
    for e, sl in _expert_slices(counts):
        torch.mm(dgu[sl].t(), ctx.p[sl], out=db_gu[e])
    for e, sl in _expert_slices(counts):
        torch.mm(dgu[sl], ctx.b_gu[e], out=dp[sl])
    dp.mul_(s)
    for e, sl in _expert_slices(counts):
        torch.mm(dp[sl].t(), ctx.xs[sl], out=da_gu[e])
    for e, sl in _expert_slices(counts):
        torch.mm(dp[sl], ctx.a_gu[e], out=lo[sl])
    for e, sl in _expert_slices(counts):
        torch.mm(dgu[sl], _w_gate_up(base, e).t(), out=dxs[sl])
    dxs.add_(lo)
    del lo
    _zero_null_rows(dxs, counts)
    _zero_null_rows(grad_ws, counts)

    # experts without tokens got no product: their LoRA grads are zero
    empty = [e for e, n in enumerate(counts) if n == 0]
    if empty:
        for buf in (*grads.values(), db_gu, da_gu):
            buf[empty] = 0
    grads["gate_b"] = db_gu[:, gs, :rank] * s
    grads["up_b"] = db_gu[:, us, rank:] * s
    grads["gate_a"], grads["up_a"] = da_gu[:, :rank], da_gu[:, rank:]

    grad_x = dxs.index_select(0, ctx.inv).view(t, k, hidden).sum(1, dtype=acc)
    grad_w = grad_ws.index_select(0, ctx.inv).view(t, k)
    return grad_x, grad_w, LoraTensors(**{n: grads[n].to(acc) for n in lc._fields})
