"""GPU-resident experts of one MoE layer: a few experts whose base weights live on the training device.

A rule's ``gpu_experts`` names experts of a layer whose frozen base weights are copied once
to the training device (the device of the first ``hidden_states``), as plain attributes: no
new ``nn.Parameter`` or buffer, so state-dict names, PEFT and DDP see nothing new. Their pairs
are computed there by ``device_experts.py`` (the formula and graph shared with the streamed
experts of ``streamed.py``); the CPU keeps every expert's weights.

``pick_resident_ids`` / ``pick_stream_ids``: which experts a count selects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels.base import ExpertWeights


class ResidentExperts:
    """Experts ``ids`` of one layer, base weights kept on the training device.

    ``base``: the layer's full CPU base weights (read once, at the first ``to_device``).
    """

    def __init__(self, base: ExpertWeights, ids: Sequence[int]) -> None:
        num = base.num_experts
        bad = [i for i in ids if not 0 <= i < num]
        if bad or len(set(ids)) != len(ids) or not ids:
            raise ValueError(
                f"resident expert ids {list(ids)}: need distinct ids in 0-{num - 1}, at least one"
            )
        self.ids = tuple(sorted(ids))
        self.num_experts = num
        self._cpu_base = base
        self._ids_cpu = torch.tensor(self.ids, dtype=torch.long)
        self.device: torch.device | None = None
        self.weights: ExpertWeights | None = None  # the resident experts only, on self.device

    def to_device(self, device: torch.device) -> None:
        """Copy the resident experts' base weights to ``device`` (once; again only if it changes)."""
        if self.device == device:
            return
        b, idx = self._cpu_base, self._ids_cpu

        every = self.ids == tuple(range(self.num_experts))

        def sel(t):
            if t is None:
                return None
            # the index on the weights' device (the rate measurement makes them on the GPU)
            return (t if every else t.index_select(0, idx.to(t.device))).to(device)

        self.weights = ExpertWeights(
            sel(b.gate_up), sel(b.down), sel(b.gate_up_bias), sel(b.down_bias), spec=b.spec
        )
        self.device = device

    def nbytes(self) -> int:
        """Bytes of base weights held on the device (0 before the first ``to_device``)."""
        w = self.weights
        if w is None:
            return 0
        ts = (w.gate_up, w.down, w.gate_up_bias, w.down_bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def pick_resident_ids(
    num_experts: int, ids: Sequence[int] | None, count: int | None, popularity: torch.Tensor | None = None
) -> tuple[int, ...]:
    """The experts a ``gpu_experts`` entry makes resident: ``ids`` as given, or for a ``count`` the
    ``count`` most popular experts when ``popularity`` [E] (routing counts) is known, else the first
    ``count`` ids (0 .. count-1). Ties keep the lower id. Empty: none."""
    if ids is not None:
        return tuple(sorted(ids))
    if not count:
        return ()
    if popularity is None:
        return tuple(range(count))
    order = sorted(range(num_experts), key=lambda e: (-float(popularity[e]), e))
    return tuple(sorted(order[:count]))


def pick_stream_ids(
    num_experts: int,
    resident: Sequence[int],
    ids: Sequence[int] | None,
    count: int | None,
    popularity: torch.Tensor | None = None,
) -> tuple[int, ...]:
    """The experts a ``stream`` entry streams, given the layer's ``resident`` ids: ``ids`` as given;
    for a ``count`` the ``count`` most popular non-resident experts when ``popularity`` [E] is
    known, else the first ``count`` non-resident ids; ``ids`` and ``count`` both None (``stream:
    all``): every non-resident expert. Ties keep the lower id. Raises ValueError when the ids
    overlap the resident ones or there are not ``count`` non-resident experts."""
    rest = [e for e in range(num_experts) if e not in set(resident)]
    if ids is not None:
        both = sorted(set(ids) & set(resident))
        if both:
            raise ValueError(f"expert ids {both} are both resident (gpu_experts) and streamed")
        return tuple(sorted(ids))
    if count is None:
        return tuple(rest)
    if count > len(rest):
        raise ValueError(
            f"stream count {count} > the {len(rest)} experts not resident ({len(resident)} of {num_experts} are)"
        )
    if popularity is not None:
        rest = sorted(rest, key=lambda e: (-float(popularity[e]), e))
    return tuple(sorted(rest[:count]))
