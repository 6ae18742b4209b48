"""Token-count buckets of the graphed expert work (``graphed.py``) and the padding rows that fill
a call up to its bucket.

A graph replays fixed shapes, so a call of T tokens runs the graph of T's bucket: T rounded up to
one of 4 steps per power of two (at most 25% more rows; powers of two stay as they are), at least
``MIN_BUCKET``. The rows past the call's own are padding: zero inputs, routing weight 0 and a zero
incoming gradient, so they add exactly nothing to the output or to any gradient, only GPU time; their
expert ids are spread round-robin over the experts, so no expert's group grows by more than its
share.
"""

from __future__ import annotations

import torch

MIN_BUCKET = 64  # the smallest bucket: shorter calls (generation's one token) pad to it


def bucket_tokens(tokens: int) -> int:
    """The token count a call of ``tokens`` tokens replays at: rounded up to a multiple of an
    eighth of the next power of two (so 4 buckets per power of two, at most 25% padding rows;
    powers of two and 5, 6, 7 eighths of one stay as they are), at least ``MIN_BUCKET``."""
    if tokens <= MIN_BUCKET:
        return MIN_BUCKET
    step = 1 << ((tokens - 1).bit_length() - 3)
    return -(-tokens // step) * step


_fillers: dict[tuple, torch.Tensor] = {}


def pad_ids(tokens: int, k: int, experts: int, device) -> torch.Tensor:
    """[tokens, k] int64 on ``device``: the expert ids of padding rows, spread round-robin over the
    ``experts`` (so no expert's group grows by more than ~tokens k / experts rows). Cached."""
    key = (tokens, k, experts, torch.device(device))
    t = _fillers.get(key)
    if t is None:
        t = _fillers[key] = (torch.arange(tokens * k, device=device) % experts).view(tokens, k)
    return t


def zero_rows_to(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` [n, ...] with zero rows appended up to ``rows`` (``t`` itself when n == rows)."""
    n = t.shape[0]
    return t if n == rows else torch.cat([t, t.new_zeros(rows - n, *t.shape[1:])])


def pad_rows(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, tokens: int, experts: int):
    """(x [tokens, H], local [tokens, k], weights [tokens, k]): the call's rows, then padding rows
    (zero inputs, ``pad_ids``, routing weight 0) up to ``tokens``; the inputs as they are when
    already that long. A padding row's pairs add w d = 0 to the output, and with a zero incoming
    gradient (``zero_rows_to``) nothing to any gradient."""
    t = x.shape[0]
    if t == tokens:
        return x, local, weights
    lp = torch.cat([local, pad_ids(tokens, local.shape[1], experts, local.device)[t:]])
    return zero_rows_to(x, tokens), lp, zero_rows_to(weights, tokens)


def unpad_grads(grads: tuple, tokens: int) -> tuple:
    """``fused_backward``'s (grad_x, grad_w, six LoRA grads) of a padded call -> those of its first
    ``tokens`` rows (the LoRA gradients are sums over rows: padding rows added zero to them)."""
    gx, gw, *lo = grads
    return (None if gx is None else gx[:tokens], None if gw is None else gw[:tokens], *lo)
