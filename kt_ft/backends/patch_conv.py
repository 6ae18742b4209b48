"""Vision patch embeddings as a matmul instead of ``nn.Conv3d`` (Qwen3-VL, Qwen3.5 vision towers).

LLaMA-Factory 0.9.5 refuses to load any model holding an ``nn.Conv3d`` under torch 2.9.x (a
cuDNN performance regression of Conv3d in that release, pytorch#166122), which rules out every
Qwen-VL vision tower on the pinned stack (its loader hook calls ``replace_patch_conv3d`` then:
``kt_ft.integrations.llamafactory.patches``). Their patch embedding is a Conv3d whose kernel equals
its stride and the input it gets is exactly one kernel per patch ([N, C, t, p, p]), so it is a
linear map of the flattened patch: ``out[n] = W.view(D, C*t*p*p) @ x[n].flatten() + b``. The
swap keeps the same ``weight`` / ``bias`` Parameter objects under the same names (state dicts,
checkpoints and ``kt-ft merge`` are unchanged) and any other input shape still goes through
``F.conv3d``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kt_ft.base.log import get_logger

logger = get_logger(__name__)


class PatchConv3dAsMatmul(nn.Module):
    """A stride == kernel ``nn.Conv3d`` computed as one matmul on patch-sized inputs.

    ``weight`` [D, C, t, p, p], ``bias`` [D] or None (the conv's own Parameters). Input
    [N, C, t, p, p] (any float dtype the weight has) -> output [N, D, 1, 1, 1], as the conv returns.
    Deliberately not an ``nn.Conv3d`` subclass: LLaMA-Factory's check is ``isinstance``.
    """

    def __init__(self, conv: nn.Conv3d) -> None:
        super().__init__()
        if tuple(conv.kernel_size) != tuple(conv.stride) or conv.groups != 1 or conv.padding_mode != "zeros":
            raise ValueError(
                f"Conv3d kernel_size={conv.kernel_size} stride={conv.stride} groups={conv.groups}: "
                "only a non-grouped conv with stride == kernel_size is a per-patch matmul"
            )
        if any(p != 0 for p in conv.padding) or any(d != 1 for d in conv.dilation):
            raise ValueError(f"Conv3d padding={conv.padding} dilation={conv.dilation}: expected 0 and 1")
        self.weight = conv.weight
        self.bias = conv.bias
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride = tuple(conv.stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or tuple(x.shape[1:]) != (self.in_channels, *self.kernel_size):
            # not one kernel per sample: the general convolution (same numbers, conv kernel)
            return F.conv3d(x, self.weight, self.bias, stride=self.stride)
        out = F.linear(x.reshape(x.shape[0], -1), self.weight.reshape(self.out_channels, -1), self.bias)
        return out.view(x.shape[0], self.out_channels, 1, 1, 1)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size} (as a matmul)"


def replace_patch_conv3d(model: nn.Module) -> list[str]:
    """Swap every stride == kernel ``nn.Conv3d`` of ``model`` for ``PatchConv3dAsMatmul`` in place;
    returns the dotted names swapped. A Conv3d of another kind raises ValueError naming it (it
    would still trip LLaMA-Factory's check, and is not a patch embedding)."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Conv3d):
            continue
        try:
            replacement = PatchConv3dAsMatmul(module)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, replacement)
        swapped.append(name)
    return swapped
