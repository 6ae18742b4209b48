"""GPU-resident experts of one MoE layer: a few experts whose base weights live on the training device.

A rule's ``gpu_experts`` names experts of a layer whose frozen base weights are copied once
to the training device (the device of the first ``hidden_states``), as plain attributes: no
new ``nn.Parameter`` or buffer, so state-dict names, PEFT and DDP see nothing new. Their pairs
are computed there by ``device_experts.py`` (the formula and graph shared with the streamed
experts of ``streamed.py``); the CPU keeps every expert's weights.

Which experts a count selects: ``placement/homes.py`` (``pick_resident_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.grouped_wide import WideExperts, wide_fits


class ResidentExperts:
    """Experts ``ids`` of one layer, base weights kept on the training device.

    ``base``: the layer's full CPU base weights (read once, at the first ``to_device``).
    ``lora_rank``: the layer's expert-LoRA rank; where the layout allows (``grouped_wide.wide_fits``)
    the weights are kept in the wide layout, with room for the LoRA beside them (else plain copies).
    """

    def __init__(self, base: ExpertWeights, ids: Sequence[int], lora_rank: int = 0) -> None:
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
        self.lora_rank = lora_rank

    def to_device(self, device: torch.device) -> None:
        """Copy the resident experts' base weights to ``device`` (once; again only if it changes)."""
        if self.device == device:
            return
        b, idx = self._cpu_base, self._ids_cpu

        every = self.ids == tuple(range(self.num_experts))

        def sel(t):
            if t is None:
                return None
            if getattr(t, "fmt", None) is not None:  # kept quantized: its stored bytes go to the device
                return (t if every else t.select(self.ids)).to(device)
            # the index on the weights' device (the rate measurement makes them on the GPU)
            return (t if every else t.index_select(0, idx.to(t.device))).to(device)

        if self.wide_layout():
            # an expert at a time from the host copy into the buffers: no second copy anywhere
            wide = WideExperts.from_weights(b.gate_up, b.down, self.lora_rank, b.spec, device, self.ids)
            self.weights = ExpertWeights(
                wide.gate_up, wide.down, sel(b.gate_up_bias), sel(b.down_bias), spec=b.spec, wide=wide
            )
        else:
            self.weights = ExpertWeights(
                sel(b.gate_up), sel(b.down), sel(b.gate_up_bias), sel(b.down_bias), spec=b.spec
            )
        self.device = device

    def wide_layout(self) -> bool:
        """Whether the weights go to the device in the wide layout (``kernels/grouped_wide.py``)."""
        b = self._cpu_base
        return wide_fits(b.spec, b.hidden, b.intermediate, self.lora_rank, b.quantized is not None)

    def nbytes(self) -> int:
        """Bytes of base weights held on the device (0 before the first ``to_device``)."""
        w = self.weights
        if w is None:
            return 0
        ts = (w.gate_up, w.down) if w.wide is None else w.wide.tensors()
        ts = (*ts, w.gate_up_bias, w.down_bias)
        return sum(
            t.nbytes() if getattr(t, "fmt", None) is not None else t.numel() * t.element_size()
            for t in ts
            if t is not None
        )
