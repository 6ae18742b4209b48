"""Shared by the tests that compare a kt-ft replacement with the original on random inputs."""

from __future__ import annotations

import os

import torch


def fresh_seed() -> int:
    """A new seed each run, printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"seed {seed}")
    return seed


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """max |got - want| <= tol x max |want| (a relative tolerance on the tensor's scale)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-12
    assert err <= tol * scale, (
        f"{what}: max error {err:.3g} against max {scale:.3g} (tolerance {tol} relative)"
    )


def assert_trains_alike(
    ref, twin, ids: torch.Tensor, *, loss_tol: float = 1e-5, grad_tol: float = 1e-4, before_twin=None
) -> None:
    """One forward + backward of each causal LM on ``ids`` (its own labels): losses within
    ``loss_tol`` and every parameter gradient within ``grad_tol`` (relative), the same set of them.
    ``before_twin``: called between the two (a change that is process-wide, not the twin's own)."""
    results = []
    for model in (ref, twin):
        if model is twin and before_twin is not None:
            before_twin()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append(
            (out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        )
    (loss_ref, grads_ref), (loss_twin, grads_twin) = results
    assert_close(loss_twin, loss_ref, loss_tol, "loss")
    assert grads_ref and grads_ref.keys() == grads_twin.keys()
    for name, grad in grads_ref.items():
        assert_close(grads_twin[name], grad, grad_tol, name)
