"""Portable fast backend: tokens grouped by expert once per call, hand-written backward.

The (token, slot) pairs are sorted by expert once; each expert then runs dense GEMMs on a
contiguous slice, writing into buffers allocated once per call (no per-expert allocation).
Elementwise work (activation, its derivative, routing-weight products) runs once over all
pairs. The backward reuses the forward's gate/up pre-activations and LoRA projections and
never materialises B @ A; the routing-weight gradient comes from the products the input
gradient needs anyway (dY.d = (dY Wd).h + s (dY Bd).(h Ad^T)), so `d` is not kept.
Compute is in the base weights' dtype (bf16 or fp32; GEMMs accumulate in fp32), the
activation and every sum over the k experts in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ExpertBackend, ExpertWeights, LoraTensors, accum_dtype


@dataclass
class _Ctx:
    base: ExpertWeights
    x: torch.Tensor  # [T, H] compute dtype
    tok: torch.Tensor  # [N] token of each sorted pair, N = T*k
    order: torch.Tensor  # [N] flat (t*k + slot) index of each sorted pair
    counts: list[int]  # pairs per expert
    ws: torch.Tensor  # [N] routing weight of each sorted pair, accumulation dtype
    gu: torch.Tensor  # [N, 2I] gate/up pre-activations
    p: torch.Tensor  # [N, 2r] x @ [Ag; Au]^T
    pd: torch.Tensor  # [N, r] h @ Ad^T
    lora: LoraTensors  # compute-dtype copies
    a_gu: torch.Tensor  # [E, 2r, H] cat(gate_a, up_a)
    k: int
    scaling: float


def _expert_slices(counts: list[int]):
    off = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(off, off + n)
        off += n


class GroupedTorchBackend(ExpertBackend):
    name = "torch"

    def forward(self, x, ids, weights, base: ExpertWeights, lora: LoraTensors, scaling, needs_grad):
        dt = base.gate_up.dtype
        acc = accum_dtype(dt)
        num_experts, two_i, _ = base.gate_up.shape
        inter = two_i // 2
        rank = lora.gate_a.shape[1]
        t, k = ids.shape
        x = x.to(dt).contiguous()
        lc = LoraTensors(*(w.to(dt) for w in lora))
        a_gu = torch.cat([lc.gate_a, lc.up_a], dim=1)  # [E, 2r, H]

        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        tok = torch.div(order, k, rounding_mode="floor")
        ws = weights.reshape(-1).index_select(0, order).to(acc)
        xs = x.index_select(0, tok)  # [N, H]
        n_pairs = xs.shape[0]

        gu = torch.empty(n_pairs, two_i, dtype=dt)
        p = torch.empty(n_pairs, 2 * rank, dtype=dt)
        for e, sl in _expert_slices(counts):
            xe = xs[sl]
            torch.mm(xe, base.gate_up[e].t(), out=gu[sl])
            torch.mm(xe, a_gu[e].t(), out=p[sl])
            gu[sl, :inter].addmm_(p[sl, :rank], lc.gate_b[e].t(), alpha=scaling)
            gu[sl, inter:].addmm_(p[sl, rank:], lc.up_b[e].t(), alpha=scaling)

        h = (F.silu(gu[:, :inter].to(acc)) * gu[:, inter:].to(acc)).to(dt)  # [N, I]
        d = torch.empty(n_pairs, base.hidden, dtype=dt)
        pd = torch.empty(n_pairs, rank, dtype=dt)
        for e, sl in _expert_slices(counts):
            he = h[sl]
            torch.mm(he, base.down[e].t(), out=d[sl])
            torch.mm(he, lc.down_a[e].t(), out=pd[sl])
            d[sl].addmm_(pd[sl], lc.down_b[e].t(), alpha=scaling)

        out = torch.zeros(t, base.hidden, dtype=acc)
        out.index_add_(0, tok, d.to(acc).mul_(ws[:, None]))
        if not needs_grad:
            return out, None
        return out, _Ctx(base, x, tok, order, counts, ws, gu, p, pd, lc, a_gu, k, scaling)

    def backward(self, ctx: _Ctx, grad_out: torch.Tensor):
        x, lc, s = ctx.x, ctx.lora, ctx.scaling
        dt = x.dtype
        acc = accum_dtype(dt)
        t, hidden = x.shape
        rank = lc.gate_a.shape[1]
        inter = ctx.gu.shape[1] // 2
        ws = ctx.ws[:, None]
        gy = grad_out.to(dt).index_select(0, ctx.tok)  # [N, H]
        n_pairs = gy.shape[0]

        g = ctx.gu[:, :inter].to(acc)
        u = ctx.gu[:, inter:].to(acc)
        sg = torch.sigmoid(g)
        silu = g * sg
        h = (silu * u).to(dt)

        # down projection: q = dY Wd, qa = dY Bd (per expert)
        q = torch.empty(n_pairs, inter, dtype=dt)
        qa = torch.empty(n_pairs, rank, dtype=dt)
        base = ctx.base
        for e, sl in _expert_slices(ctx.counts):
            torch.mm(gy[sl], base.down[e], out=q[sl])
            torch.mm(gy[sl], lc.down_b[e], out=qa[sl])
        qf, qaf = q.to(acc), qa.to(acc)
        grad_ws = (h.to(acc) * qf).sum(-1) + s * (ctx.pd.to(acc) * qaf).sum(-1)  # [N]
        dpd = (s * ws * qaf).to(dt)  # [N, r] grad of h Ad^T
        wpd = (s * ws * ctx.pd.to(acc)).to(dt)  # [N, r] so that dBd = dY^T (s w pd)
        dh = (ws * qf).to(dt)  # [N, I]

        num_experts = lc.gate_a.shape[0]
        grads = {n: torch.zeros((num_experts, *w.shape[1:]), dtype=acc) for n, w in lc._asdict().items()}
        for e, sl in _expert_slices(ctx.counts):
            grads["down_b"][e].copy_(gy[sl].t() @ wpd[sl])
            grads["down_a"][e].copy_(dpd[sl].t() @ h[sl])
            dh[sl].addmm_(dpd[sl], lc.down_a[e])

        dhf = dh.to(acc)
        dgu = torch.cat([dhf * u * (sg * (1 + g * (1 - sg))), dhf * silu], dim=1).to(dt)  # [N, 2I]
        del g, u, sg, silu, dhf, q, qa

        xs = x.index_select(0, ctx.tok)
        dxs = torch.empty(n_pairs, hidden, dtype=dt)
        dp = torch.empty(n_pairs, 2 * rank, dtype=dt)
        for e, sl in _expert_slices(ctx.counts):
            dg, du = dgu[sl, :inter], dgu[sl, inter:]
            pg, pu = ctx.p[sl, :rank], ctx.p[sl, rank:]
            grads["gate_b"][e].copy_(dg.t() @ pg).mul_(s)
            grads["up_b"][e].copy_(du.t() @ pu).mul_(s)
            torch.mm(dg, lc.gate_b[e], out=dp[sl, :rank])
            torch.mm(du, lc.up_b[e], out=dp[sl, rank:])
            dp[sl].mul_(s)
            da = dp[sl].t() @ xs[sl]  # [2r, H]
            grads["gate_a"][e].copy_(da[:rank])
            grads["up_a"][e].copy_(da[rank:])
            torch.mm(dgu[sl], base.gate_up[e], out=dxs[sl])
            dxs[sl].addmm_(dp[sl], ctx.a_gu[e])

        grad_x = torch.zeros(t, hidden, dtype=acc)
        grad_x.index_add_(0, ctx.tok, dxs.to(acc))
        grad_w = torch.empty(n_pairs, dtype=acc)
        grad_w[ctx.order] = grad_ws
        return grad_x, grad_w.view(t, ctx.k), LoraTensors(**grads)
