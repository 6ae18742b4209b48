"""Rotary position embedding of q and k as one autograd node (transformers' ``apply_rotary_pos_emb``).

Why: the training step is bound by the host's per-operator work (docs/benchmarks.md). transformers
writes ``q * cos + rotate_half(q) * sin`` (rotate_half: two slices, a negation, a concatenation),
7 operators for q and 7 for k a call and ~20 kernels in their backward (a slice's gradient is a
zero tensor and a copy). With s = (-1 on the first half, +1 on the second), rotate_half(q) =
roll(q, D/2) * s, so q' = q cos + roll(q, D/2) (s sin): a product, a roll and an ``addcmul`` for
each of q and k (s sin made once a call), and a backward of the same form, dq = g cos +
roll(g (s sin), -D/2). The result differs from transformers' by one bf16 rounding of the sum.

Which functions: a family module's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` is
replaced only after it agreed with the replacement on random inputs; calls with a rotary part
narrower than the head (partial rotary) or other arguments (position ids) go to the family's own.
``KT_FT_FUSIONS`` without ``rope`` keeps every family's own.
"""

from __future__ import annotations

import inspect
import sys

import torch

from kt_ft.base.log import get_logger
from kt_ft.base.settings import fusions

logger = get_logger(__name__)
_PATCHED: set[str] = set()  # modules whose function is kt-ft's now (a process-wide change)


class RotaryQK(torch.autograd.Function):
    """(q', k') = (q cos + roll(q, D/2) ss, k cos + roll(k, D/2) ss), ss = s * sin.

    q [B, Hq, T, D], k [B, Hk, T, D] (or any layout that ``cos`` / ``sin`` broadcast against), cos /
    sin broadcastable to both with last dim D (even). Returns tensors of q's and k's dtypes.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        half = q.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # s * sin
        q_out = torch.addcmul(q * cos, torch.roll(q, half, dims=-1), signed)
        k_out = torch.addcmul(k * cos, torch.roll(k, half, dims=-1), signed)
        ctx.save_for_backward(cos, signed)
        ctx.half = half
        return q_out, k_out

    @staticmethod
    def backward(ctx, gq, gk):
        cos, signed = ctx.saved_tensors
        half = ctx.half
        dq = dk = None
        if gq is not None and ctx.needs_input_grad[0]:
            dq = torch.roll(gq * signed, -half, dims=-1).addcmul_(gq, cos)
        if gk is not None and ctx.needs_input_grad[1]:
            dk = torch.roll(gk * signed, -half, dims=-1).addcmul_(gk, cos)
        return dq, dk, None, None


def _replacement(original):
    """kt-ft's function for the calls of the plain form, ``f(q, k, cos, sin[, unsqueeze_dim=...])``
    (how the attention modules call it); any other call goes to ``original``."""
    param = inspect.signature(original).parameters.get("unsqueeze_dim")
    default_dim = (
        param.default if param is not None and param.default is not inspect.Parameter.empty else None
    )

    def apply_rotary_pos_emb(*args, **kwargs):
        # no signature binding here: this runs twice a layer and pass in a host-bound step
        if len(args) != 4 or default_dim is None or (kwargs and kwargs.keys() != {"unsqueeze_dim"}):
            return original(*args, **kwargs)
        q, k, cos, sin = args
        if cos.shape[-1] != q.shape[-1] or q.shape[-1] % 2:
            return original(*args, **kwargs)  # partial rotary: the family's own
        dim = kwargs.get("unsqueeze_dim", default_dim)
        return RotaryQK.apply(q, k, cos.unsqueeze(dim), sin.unsqueeze(dim))

    apply_rotary_pos_emb._kt_ft_original = original
    return apply_rotary_pos_emb


def _agrees(fn, replacement) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    angle = torch.randn(2, 5, 4, generator=gen)
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    try:
        want = fn(q, k, cos, sin)
        got = replacement(q, k, cos, sin)
    except Exception:  # another signature or shape convention: keep the family's own
        return False
    return all(torch.allclose(w, g, atol=1e-5, rtol=1e-5) for w, g in zip(want, got))


def install_fused_rotary(model: torch.nn.Module) -> list[str]:
    """Replace ``apply_rotary_pos_emb`` in the modeling modules of ``model``'s classes; returns
    the modules patched (logged). A no-op when ``KT_FT_FUSIONS`` leaves out ``rope``."""
    if "rope" not in fusions():
        return []
    names = sorted(
        {type(m).__module__ for m in model.modules() if type(m).__module__.startswith("transformers.")}
    )
    patched, kept = [], []
    for name in names:
        module = sys.modules.get(name)
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is None or not callable(fn):
            continue
        if hasattr(fn, "_kt_ft_original"):
            patched.append(name)
            continue
        replacement = _replacement(fn)
        if _agrees(fn, replacement):
            module.apply_rotary_pos_emb = replacement
            _PATCHED.add(name)
            patched.append(name)
        else:
            kept.append(name)
    if patched or kept:
        logger.info(
            f"rotary embedding: {_short(patched) or 'none'} through one autograd node (KT_FT_FUSIONS without rope: "
            "transformers' own)" + (f"; transformers' own kept for {_short(kept)}" if kept else "")
        )
    return patched


def _short(modules: list[str]) -> str:
    return ", ".join(name.rsplit(".", 1)[-1] for name in modules)


def uninstall_fused_rotary() -> None:
    """Put every family's own function back (the tests, between runs in one process)."""
    while _PATCHED:
        module = sys.modules[_PATCHED.pop()]
        module.apply_rotary_pos_emb = module.apply_rotary_pos_emb._kt_ft_original
