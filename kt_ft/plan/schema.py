"""Value types of the rule language: layer sets and GPU-expert selections, parsed from plain YAML values.

Kept apart from the YAML reader so the parsing rules are easy to read and test: each parser
takes a Python value (what PyYAML built) and returns the parsed value or raises ``ValueError``
with a message that says what is valid; the reader adds file:line and the key path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEYS_RULE = ("match", "replace", "place", "recursive")
KEYS_MATCH = ("name", "class", "layers")
KEYS_ACTION = ("device", "backend", "threads", "gpu_experts", "stream", "placement")
PLACEMENTS = ("manual", "auto")  # manual: gpu_experts / stream as written; auto: kt_ft/placement decides
KEYS_DEFAULT = ("device",)
KEYS_GPU_SPEC = ("layers", "ids", "count")

DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+)$")
DEVICE_CHOICES = "cpu, cuda, cuda:N"
LAYERS_CHOICES = 'an index (3), a range "0-11", or a list of them ([0, 1, "4-7"])'
GPU_EXPERTS_CHOICES = (
    "a count (4), a list of expert ids ([0, 5]), {layers: RANGE, ids: [...]} (or count: N), "
    "a list of those, or a mapping layer-or-range -> ids ({0: [1, 2], '3-5': [4]})"
)
STREAM_ALL = "all"
STREAM_CHOICES = f"{GPU_EXPERTS_CHOICES}, or {STREAM_ALL!r} (every expert of the layer not resident)"
_RANGE_RE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")

# the `kt_backend` values of a recipe and of a rule's experts (kt_ft.backends.registry BACKENDS, plus auto)
KT_BACKENDS = ("auto", "torch", "torch-ep", "native", "reference", "kt-kernel")


@dataclass(frozen=True)
class LayerSet:
    """Decoder-layer indices as sorted, merged closed ranges (``"0-11"``, ``[0, 1, "4-7"]``)."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, layer: int) -> bool:
        return any(lo <= layer <= hi for lo, hi in self.ranges)

    def issubset(self, other: LayerSet) -> bool:
        return all(any(olo <= lo and hi <= ohi for olo, ohi in other.ranges) for lo, hi in self.ranges)

    def __str__(self) -> str:
        return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)


def _one_range(item) -> tuple[int, int]:
    if isinstance(item, bool):
        raise ValueError(f"{item!r} is not a layer; expected {LAYERS_CHOICES}")
    if isinstance(item, int):
        if item < 0:
            raise ValueError(f"{item!r} is negative; expected {LAYERS_CHOICES}")
        return item, item
    if isinstance(item, str):
        if item.strip().isdigit():
            return int(item), int(item)
        m = _RANGE_RE.match(item)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"{item!r} is an empty range (start > end); expected {LAYERS_CHOICES}")
            return lo, hi
    raise ValueError(f"{item!r} is not a layer index or range; expected {LAYERS_CHOICES}")


def parse_layers(value) -> LayerSet:
    """``3``, ``"0-11"``, ``[0, 1, "4-7"]`` -> LayerSet; raises ValueError naming the valid forms."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError(f"empty list; expected {LAYERS_CHOICES}")
    merged: list[list[int]] = []
    for lo, hi in sorted(_one_range(i) for i in items):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return LayerSet(tuple((lo, hi) for lo, hi in merged))


@dataclass(frozen=True)
class GpuExpertSpec:
    """Experts of the layers ``layers`` (None: every layer the rule matches) kept on the GPU
    (``gpu_experts``) or streamed to it (``stream``). ``ids`` and ``count`` both None: every
    expert not resident (``stream: all``)."""

    layers: LayerSet | None
    ids: tuple[int, ...] | None  # explicit expert ids, or
    count: int | None  # how many (which ones: decided when GPU experts are computed)

    @property
    def is_all(self) -> bool:
        return self.ids is None and self.count is None


@dataclass(frozen=True)
class GpuExperts:
    specs: tuple[GpuExpertSpec, ...]

    def for_layer(self, layer: int) -> GpuExpertSpec | None:
        """The first spec that covers ``layer`` (None: no GPU experts on that layer)."""
        return next((s for s in self.specs if s.layers is None or layer in s.layers), None)

    def is_empty(self) -> bool:
        return all((s.count == 0) if s.ids is None else not s.ids for s in self.specs)


def _ids(value) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise ValueError(f"{value!r} is not a list of expert ids (non-negative integers)")
    if len(set(value)) != len(value):
        raise ValueError(f"{value!r} repeats an expert id")
    return tuple(value)


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count (a non-negative integer)")
    return value


def _spec(value: dict) -> GpuExpertSpec:
    unknown = [k for k in value if k not in KEYS_GPU_SPEC]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; valid keys: {', '.join(KEYS_GPU_SPEC)}")
    if ("ids" in value) == ("count" in value):
        raise ValueError(f"{value!r}: give exactly one of ids, count")
    layers = parse_layers(value["layers"]) if "layers" in value else None
    if "ids" in value:
        return GpuExpertSpec(layers, _ids(value["ids"]), None)
    return GpuExpertSpec(layers, None, _count(value["count"]))


def parse_gpu_experts(value) -> GpuExperts:
    """Every form of ``gpu_experts`` (see GPU_EXPERTS_CHOICES) -> GpuExperts; ValueError otherwise."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            return GpuExperts((GpuExpertSpec(None, None, _count(value)),))
        if isinstance(value, list) and all(isinstance(v, dict) for v in value) and value:
            return GpuExperts(tuple(_spec(v) for v in value))
        if isinstance(value, list):
            return GpuExperts((GpuExpertSpec(None, _ids(value), None),))
        if isinstance(value, dict) and value and set(value) <= set(KEYS_GPU_SPEC):
            return GpuExperts((_spec(value),))
        if isinstance(value, dict) and value:
            return GpuExperts(tuple(GpuExpertSpec(parse_layers(k), _ids(v), None) for k, v in value.items()))
    except ValueError as e:
        raise ValueError(f"{e}; expected {GPU_EXPERTS_CHOICES}") from None
    raise ValueError(f"{value!r} is not a GPU-expert selection; expected {GPU_EXPERTS_CHOICES}")


def parse_stream(value) -> GpuExperts:
    """``stream``: every form of ``gpu_experts``, or ``all`` (one spec with neither ids nor count:
    every expert of each matched layer that is not resident); ValueError naming STREAM_CHOICES."""
    if value == STREAM_ALL:
        return GpuExperts((GpuExpertSpec(None, None, None),))
    try:
        return parse_gpu_experts(value)
    except ValueError as e:
        msg = str(e).replace(f"expected {GPU_EXPERTS_CHOICES}", f"expected {STREAM_CHOICES}")
        raise ValueError(
            msg.replace("is not a GPU-expert selection", "is not a streamed-expert selection")
        ) from None
