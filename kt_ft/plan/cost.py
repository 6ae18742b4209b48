"""The placement cost model: predicted time per resource and GPU memory of an expert split.

Pure functions (no torch, no device work), so the planner, ``kt-ft rules plan`` and the tests
use the same numbers. Each routed expert of an MoE layer is *resident* (weights kept on the
GPU), *streamed* (weights copied host -> GPU just in time) or on the *CPU* (the CPU op).
Per MoE layer, with T tokens per micro-batch, top-k slots, popularity p_e (routing counts, any
scale; uniform when unknown) and pairs_e = T·k·p_e / Σp:

* CPU:  cpu_s  = Σ_{e on CPU} pairs_e · pair_flops / cpu_flops
  (pair_flops = 12·H·I + 18·r·(H + I): the six frozen GEMMs forward + input-gradient, and the
  LoRA forward, input- and weight-gradients; the CPU op runs its forward once per step even
  under gradient checkpointing, see ``moe/function.py``)
* link: link_s = passes · n_streamed · expert_bytes / link_bytes_s + act_bytes / link_bytes_s
  (passes: the forward and the checkpointed recompute each fetch the layer, except where the
  buffers still hold it: at the turn the last two layers of the forward, at the next step's
  start the first two of the backward (``moe/streamed.py``), so L streaming layers cross
  2·L - 2·STREAM_BUFFERS times a step: ``link_passes``; act_bytes: the CPU part's input, output
  and their gradients, T·H each, when the CPU computes any pair)
* GPU:  gpu_s  = Σ_{e on GPU} pairs_e · (pair_flops + fwd_flops) / gpu_expert_flops
  (fwd_flops = 6·H·I + 6·r·(H + I): the GPU part's forward is recomputed under checkpointing)

Phases. Under gradient checkpointing a step is a forward, then per layer (last first) a
recompute and a backward. A streamed layer crosses the link once in each phase (``link_passes``)
while the GPU computes the layer before it: within a phase the link and the GPU overlap (the next
layer's experts stream in while this one computes), so a layer takes, per phase,
max(link / 2, GPU work of that phase). The GPU work of a phase is the experts' (forward:
pairs·fwd_flops; recompute + backward: pairs·pair_flops) plus the layer's share of the non-expert
work (attention, dense/shared MLPs, router, head: ``nonexpert_s`` spread evenly over the MoE
layers, 1/4 of it in the forward -- forward once, recompute once, backward about twice the
forward). The CPU op does not overlap them: a layer takes

    cpu_s + max(link_s / 2, gpu_fwd_s + n / 4) + max(link_s / 2, gpu_bwd_s + 3 n / 4)

and a step the sum over its MoE layers. Why the CPU time adds: a layer with CPU experts reads its
routing on the host (one sync: the CPU op needs its pairs), so the host waits for every kernel
queued before, the layer's own streamed weights included, and stops running ahead of the GPU;
the CPU op then runs while the GPU computes only this layer's share. Measured through
``llamafactory-cli train`` (DeepSeek-V2-Lite, 27 layers, 2048 tokens, kt_gpu_memory 12): 5 of 64
experts on the CPU in 25 streamed layers, planned as hidden under the link (899 ms a micro-batch),
ran at 2,614 ms; the sum predicts ~2,200 ms. Why the phases: with the link and all the GPU work
simply added, streamed runs were predicted 1.29-1.36x slower than they ran (DeepSeek-V2-Lite and
Qwen3-30B-A3B at 12 / 24 GiB); with one max over the whole step, the backward's GPU work (3/4 of
it) was taken as hidden under a link that only carries half the step's bytes then.

The non-expert work is its FLOPs at the dense GPU rate (``non_expert_flops``) before a run
starts, and as the run measured it once it has (``Rates.nonexpert_s``,
``placement/non_expert.py``): at the dense rate the FLOPs said 17 ms for DeepSeek-V2-Lite's 2048
tokens where the run measured 244-385 ms -- the non-expert work is bound by the host's per-kernel
time, LoRA's small products and attention, not by the matmul rate.

Layers with every expert resident replay their expert work from CUDA graphs (``moe/graphed.py``),
which costs the host almost nothing: the GPU runs it in the gaps the host-bound non-expert work
leaves, so such a layer's phase takes max(its non-expert share, that share's GPU busy time + the
experts' GPU work of the phase) (``LayerTimes.graphed``; the busy time measured in the run by the
profiler, ``placement/non_expert.py``, else the FLOPs at the dense rate). Summed instead, the
all-resident micro-batch was over-predicted by 26-42% (H100 host: DeepSeek-V2-Lite 431 ms
predicted, 303 measured; Qwen3-30B-A3B 24 layers 314 / 249), where the eager runs it fitted
within 12%.

Where a layer's expert LoRA lives. With experts on the GPU its LoRA, gradient and AdamW moments
live there too (16 bytes a parameter, counted against the budget: ``placement/homes.py``
``lora_home``), unless the planner finds the step faster with them left on the CPU (a tight cap:
Qwen3-30B-A3B's 24 layers hold 3.3 GiB of such state, which at 12 GiB would otherwise push most
experts back onto the CPU). Then each such layer pays ``lora_host_seconds``: its device experts'
fp32 LoRA rows are copied to the GPU at the forward (pageable memory), their gradients copied back
by the backward, and a CPU AdamW steps the LoRA: ``LORA_HOST_BYTES`` a parameter at
``LORA_HOST_BYTES_S``, calibrated on the GPU machine (H200, 16-core Xeon): a 4-layer
Qwen3-30B-A3B step with every expert resident took 261 ms with the LoRA on the CPU against 72.4 ms
with it on the GPU, 47 ms a layer of 8.65 M parameters. Charged every micro-batch (the AdamW runs
once a step: an upper bound under gradient accumulation).

GPU memory of the experts: resident weights + 2 layers of stream buffers (double buffering,
sized for the layer with the most streamed experts) + one layer's expert activations at the
peak of its recompute and backward (``LayerShape.gpu_act_bytes``: (3·H + 5·I) values a GPU pair
and two fp32 slices, plus for experts kept quantized the chunk one product dequantizes at once:
``LayerShape.dequant_bytes``); the rest
of the GPU (non-expert weights, LoRA, optimizer, activations) is ``kt_ft/plan/report.py``'s
estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kt_ft.backends.base import DEFAULT_SPEC
from kt_ft.backends.grouped_device import BACKWARD_SLICE_ROWS
from kt_ft.backends.grouped_wide import wide_extra_bytes, wide_fits
from kt_ft.base.settings import positive_number

PASSES = 2  # times a streamed layer's weights cross the link per step (forward + recompute)
STREAM_BUFFERS = 2  # layers of stream buffers on the GPU (one computing, one filling)
# a CPU-homed expert LoRA beside GPU experts (module doc): bytes moved a parameter and micro-batch
# (fp32 rows to the GPU, gradients back: 8; a CPU AdamW reading param, grad and two moments and
# writing three: 28; rounded up for the gradient's scatter into the [E, ...] tensor) and the rate
# that makes them the 47 ms a Qwen3-30B-A3B layer measured
LORA_HOST_BYTES = 40
LORA_HOST_BYTES_S = 7.4e9


def link_passes(stream_layers: int) -> float:
    """Average crossings a step of one streamed layer's weights when ``stream_layers`` layers
    stream: 2 (forward, recompute) less the reuses at the turn and at the step's start
    (``STREAM_BUFFERS`` layers each), spread over the layers. 48 layers: 1.92; 4: 1; 2: 0."""
    if stream_layers <= 0:
        return float(PASSES)
    return max(0.0, PASSES - PASSES * STREAM_BUFFERS / stream_layers)


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's routed experts. ``weight_bytes``: bytes per base weight value (2 for bf16);
    ``act_bytes``: bytes per activation value crossing the link (the model's dtype);
    ``stored_bytes``: one expert's bytes as stored when kept quantized (``kt_ft.backends.quant``: codes and
    scales, what RAM holds and the link carries), None: ``weight_bytes`` a value."""

    num_experts: int
    hidden: int
    inter: int
    top_k: int
    weight_bytes: int = 2
    act_bytes: int = 2
    stored_bytes: int | None = None

    @property
    def expert_bytes(self) -> int:
        """Base weights of one expert: gate, up [I, H] and down [H, I]."""
        if self.stored_bytes is not None:
            return self.stored_bytes
        return 3 * self.hidden * self.inter * self.weight_bytes

    def resident_bytes(self, rank: int) -> int:
        """GPU bytes of one resident expert: its base weights, and the blocks of its expert LoRA
        (rank ``rank``) where dense weights are kept in the wide layout (``kernels/grouped_wide.py``;
        counted for every dense layout whose sizes allow it: the transposed one, kept plain, is
        over-counted by ~1%)."""
        h, i = self.hidden, self.inter
        if wide_fits(DEFAULT_SPEC, h, i, rank, quantized=self.stored_bytes is not None):
            return self.expert_bytes + wide_extra_bytes(h, i, rank, self.weight_bytes)
        return self.expert_bytes

    def pair_flops(self, rank: int) -> float:
        """FLOPs of one (token, slot) pair, forward + backward (frozen base, trained LoRA)."""
        h, i = self.hidden, self.inter
        return 12 * h * i + 18 * rank * (h + i)

    def forward_flops(self, rank: int) -> float:
        """FLOPs of one pair's forward alone (what a checkpointed recompute adds on the GPU)."""
        h, i = self.hidden, self.inter
        return 6 * h * i + 6 * rank * (h + i)

    def gpu_act_bytes(self, pairs: float) -> int:
        """Peak GPU bytes of one layer's expert work with ``pairs`` (token, expert) pairs on the
        GPU (``backends/grouped_device.py``): what its forward saves (the gathered input, gate|up,
        the activation and the down output: (2·H + 3·I) values a pair, the weights' dtype) and, at
        the backward's widest point, the down output's gradient or the input's (H) beside gate|up's
        (2·I), plus the fp32 slices both passes gather (``BACKWARD_SLICE_ROWS`` pairs x H, two at
        once) or, where every pair of a layer is on the GPU and its output gradient comes in the
        weights' dtype, one whole [pairs, H] gather of it. The forward's gate|up product and its
        LoRA term (2·I each) fit under that."""
        if pairs <= 0:
            return 0
        h, i = self.hidden, self.inter
        gathered = max(2 * min(pairs, BACKWARD_SLICE_ROWS) * h * 4, pairs * h * self.act_bytes)
        act = int(pairs * (3 * h + 5 * i) * self.act_bytes + gathered)
        return act + self.dequant_bytes()

    def dequant_bytes(self) -> int:
        """GPU bytes of the experts kept quantized that one grouped product dequantizes at once
        (``backends/grouped_products.base_mm``: a chunk of ``KT_FT_DEQUANT_CHUNK_MIB``, at least one
        expert's gate|up weight, at most the layer's); 0 for dense experts."""
        if self.stored_bytes is None:
            return 0
        per = 2 * self.inter * self.hidden * self.act_bytes  # one expert's gate|up: the larger weight
        budget = int(positive_number("KT_FT_DEQUANT_CHUNK_MIB") * 2**20)
        return per * min(self.num_experts, max(1, budget // per))


@dataclass(frozen=True)
class Rates:
    """What the machine does per second. None: unknown (no CUDA: no link and no GPU rate).

    cpu_flops: the CPU expert op's effective rate, counted with ``LayerShape.pair_flops``;
    link_bytes_s: pinned host -> GPU copy; gpu_flops: dense bf16 matmul (the non-expert work);
    gpu_expert_flops: the GPU's rate on expert-shaped products (T·k/E rows per expert, with the
    per-expert launch overhead), None: gpu_flops.
    """

    cpu_flops: float | None
    link_bytes_s: float | None = None
    gpu_flops: float | None = None
    gpu_expert_flops: float | None = None
    source: dict[str, str] = field(default_factory=dict, compare=False)  # figure -> where it came from
    # seconds of one micro-batch's non-expert work as a run measured it (``placement/non_expert.py``:
    # the model's forward + backward with the routed experts skipped); None: its FLOPs at gpu_flops
    nonexpert_s: float | None = None
    # the GPU's busy time within it (its kernels' summed durations, ``placement/non_expert.py``);
    # None: its FLOPs at gpu_flops (a lower bound)
    nonexpert_gpu_s: float | None = None

    @property
    def has_gpu(self) -> bool:
        return self.link_bytes_s is not None and self.gpu_flops is not None

    @property
    def expert_flops(self) -> float | None:
        return self.gpu_expert_flops if self.gpu_expert_flops is not None else self.gpu_flops


@dataclass(frozen=True)
class LayerSplit:
    """Expert ids of one layer by placement; every id not listed is on the CPU."""

    resident: tuple[int, ...] = ()
    streamed: tuple[int, ...] = ()

    def counts(self, num_experts: int) -> tuple[int, int, int]:
        """(resident, streamed, CPU) expert counts."""
        return len(self.resident), len(self.streamed), num_experts - len(self.resident) - len(self.streamed)


NONEXPERT_FORWARD_SHARE = 0.25  # of a layer's non-expert work, in the forward (module doc: phases)


@dataclass(frozen=True)
class LayerTimes:
    """One MoE layer's seconds per step on each resource. ``gpu_s``: its experts' GPU work, of
    which ``gpu_fwd_s`` in the forward; ``nonexpert_s``: its share of the non-expert GPU work."""

    cpu_s: float
    link_s: float
    gpu_s: float
    gpu_fwd_s: float = 0.0
    nonexpert_s: float = 0.0
    lora_s: float = 0.0  # a CPU-homed LoRA of a layer with GPU experts (``lora_host_seconds``)
    # every expert resident and replayed from CUDA graphs (``moe/graphed.py``): the experts' GPU
    # work overlaps the host-bound non-expert work, of which ``nonexpert_gpu_s`` is GPU time
    graphed: bool = False
    nonexpert_gpu_s: float = 0.0

    @property
    def seconds(self) -> float:
        """The layer's time: the CPU op's, then per phase (forward; recompute + backward) the
        link's half and the GPU's work of that phase overlapped (module doc). A graphed layer's
        phase: the longer of its non-expert share (bound by the host) and the GPU's work in it
        (the non-expert share's GPU time plus the experts')."""
        n_fwd = self.nonexpert_s * NONEXPERT_FORWARD_SHARE
        if self.graphed:
            g_fwd = self.nonexpert_gpu_s * NONEXPERT_FORWARD_SHARE
            fwd = max(n_fwd, g_fwd + self.gpu_fwd_s)
            bwd = max(self.nonexpert_s - n_fwd, self.nonexpert_gpu_s - g_fwd + self.gpu_s - self.gpu_fwd_s)
            return self.lora_s + fwd + bwd
        fwd = max(self.link_s / 2, self.gpu_fwd_s + n_fwd)
        bwd = max(self.link_s / 2, self.gpu_s - self.gpu_fwd_s + self.nonexpert_s - n_fwd)
        return self.cpu_s + self.lora_s + fwd + bwd

    @property
    def bottleneck(self) -> str:
        gpu = self.gpu_s + self.nonexpert_s
        return max((self.cpu_s + self.lora_s, "cpu"), (self.link_s, "link"), (gpu, "gpu"))[1]


def lora_host_seconds(shape: LayerShape, rank: int, rates: Rates) -> float:
    """Seconds a micro-batch that a layer with GPU experts pays for keeping its expert LoRA
    (3·E·r·(H + I) fp32 parameters) on the CPU: the row copies both ways and a CPU AdamW step,
    ``LORA_HOST_BYTES`` a parameter at ``LORA_HOST_BYTES_S`` (module doc). 0 without a GPU."""
    if not rates.has_gpu:
        return 0.0
    params = 3 * shape.num_experts * rank * (shape.hidden + shape.inter)
    return LORA_HOST_BYTES * params / LORA_HOST_BYTES_S


def pairs_per_expert(shape: LayerShape, popularity: Sequence[float] | None, tokens: int) -> list[float]:
    """Expected (token, slot) pairs per expert in a micro-batch of ``tokens``: T·k·p_e / Σp."""
    total_pairs = tokens * shape.top_k
    if popularity is None or sum(popularity) <= 0:
        return [total_pairs / shape.num_experts] * shape.num_experts
    if len(popularity) != shape.num_experts:
        raise ValueError(f"popularity has {len(popularity)} entries for {shape.num_experts} experts")
    if any(p < 0 for p in popularity):
        raise ValueError("popularity counts must be non-negative")
    s = float(sum(popularity))
    return [total_pairs * p / s for p in popularity]


def times_from_pairs(
    shape: LayerShape,
    rates: Rates,
    rank: int,
    tokens: int,
    cpu_pairs: float,
    gpu_pairs: float,
    n_streamed: int,
    passes: float = PASSES,
    nonexpert_s: float = 0.0,
) -> LayerTimes:
    """The per-resource times of one layer from its pair counts and its number of streamed experts
    (``passes``: crossings a step of its streamed weights, ``link_passes``; ``nonexpert_s``: the
    layer's share of the non-expert GPU work)."""
    cpu_s = 0.0
    if cpu_pairs > 0:
        if rates.cpu_flops is None:
            raise ValueError("the CPU computes experts but the CPU rate is unknown")
        cpu_s = cpu_pairs * shape.pair_flops(rank) / rates.cpu_flops
    link_bytes = passes * n_streamed * shape.expert_bytes
    if cpu_pairs > 0 and rates.link_bytes_s is not None:
        # forward: input to the CPU, output back (fp32 when the GPU adds its share); backward: the
        # incoming gradient to the CPU, the input gradient back
        out_bytes = 4 if gpu_pairs > 0 else shape.act_bytes
        link_bytes += tokens * shape.hidden * (3 * shape.act_bytes + out_bytes)
    link_s = 0.0
    if link_bytes:
        if n_streamed and rates.link_bytes_s is None:
            raise ValueError("experts are streamed but the link rate is unknown")
        link_s = link_bytes / rates.link_bytes_s
    gpu_s = gpu_fwd_s = 0.0
    if gpu_pairs > 0:
        if rates.expert_flops is None:
            raise ValueError("the GPU computes experts but the GPU rate is unknown")
        gpu_s = gpu_pairs * (shape.pair_flops(rank) + shape.forward_flops(rank)) / rates.expert_flops
        gpu_fwd_s = gpu_pairs * shape.forward_flops(rank) / rates.expert_flops
    return LayerTimes(cpu_s, link_s, gpu_s, gpu_fwd_s, nonexpert_s)


def layer_times(
    shape: LayerShape,
    split: LayerSplit,
    rates: Rates,
    rank: int,
    tokens: int,
    popularity: Sequence[float] | None = None,
    passes: float = PASSES,
    nonexpert_s: float = 0.0,
) -> LayerTimes:
    """Predicted seconds per step on each resource for one MoE layer under ``split``."""
    pairs = pairs_per_expert(shape, popularity, tokens)
    on_gpu = set(split.resident) | set(split.streamed)
    gpu_pairs = sum(pairs[e] for e in on_gpu)
    cpu_pairs = sum(p for e, p in enumerate(pairs) if e not in on_gpu)
    n = len(split.streamed)
    return times_from_pairs(shape, rates, rank, tokens, cpu_pairs, gpu_pairs, n, passes, nonexpert_s)


def non_expert_flops(
    linear_params: int,
    head_params: int,
    attn_layers: int,
    heads: int,
    head_dim: int,
    seq_len: int,
    batch: int,
    recompute: bool = True,
) -> float:
    """FLOPs of one training step of everything but the routed experts, on the GPU.

    Linear layers in the decoder layers (``linear_params`` weights; frozen, LoRA'd): forward
    2·N·T, input gradient 2·N·T, and the checkpointed recompute another 2·N·T. The head (not
    checkpointed): 4·N·T. Causal attention per layer and sequence: 2·S²·heads·head_dim forward
    (QK^T and AV on half the square), twice that backward, once more recomputed. T = S·batch.
    """
    tokens = seq_len * batch
    lin = (6 if recompute else 4) * linear_params * tokens
    head = 4 * head_params * tokens
    attn = (4 if recompute else 3) * 2 * seq_len * seq_len * heads * head_dim * batch * attn_layers
    return float(lin + head + attn)


@dataclass
class Prediction:
    """What a set of layer splits is predicted to cost."""

    layers: list[LayerTimes]
    nonexpert_s: float
    resident_bytes: int
    stream_buffer_bytes: int
    expert_activation_bytes: int

    @property
    def step_s(self) -> float:
        """The layers' time (each with its share of the non-expert work) and whatever of the
        non-expert work no layer took (a model without MoE layers)."""
        spread = sum(t.nonexpert_s for t in self.layers)
        return sum(t.seconds for t in self.layers) + max(0.0, self.nonexpert_s - spread)

    @property
    def expert_gpu_bytes(self) -> int:
        return self.resident_bytes + self.stream_buffer_bytes + self.expert_activation_bytes

    def totals(self) -> dict[str, float]:
        """Seconds per step each resource is busy (summed over layers; the GPU adds the non-expert work)."""
        return {
            "cpu": sum(t.cpu_s for t in self.layers),
            "link": sum(t.link_s for t in self.layers),
            "gpu": sum(t.gpu_s for t in self.layers) + self.nonexpert_s,
        }

    @property
    def bottleneck(self) -> str:
        """The resource that bounds the most layers' time (their summed seconds)."""
        spread = sum(t.nonexpert_s for t in self.layers)
        by: dict[str, float] = {"cpu": 0.0, "link": 0.0, "gpu": max(0.0, self.nonexpert_s - spread)}
        for t in self.layers:
            by[t.bottleneck] += t.seconds
        return max(by.items(), key=lambda kv: kv[1])[0]


def nonexpert_seconds(rates: Rates, nonexpert_flops: float) -> float:
    """A micro-batch's non-expert GPU work: as the run measured it, else its FLOPs at the dense
    rate (0 without a GPU rate)."""
    if rates.nonexpert_s is not None:
        return rates.nonexpert_s
    return nonexpert_flops / rates.gpu_flops if rates.gpu_flops else 0.0


def nonexpert_gpu_seconds(rates: Rates, nonexpert_flops: float) -> float:
    """The GPU's busy time within a micro-batch's non-expert work: as the run measured it, else its
    FLOPs at the dense rate (0 without a GPU rate)."""
    if rates.nonexpert_gpu_s is not None:
        return rates.nonexpert_gpu_s
    return nonexpert_flops / rates.gpu_flops if rates.gpu_flops else 0.0


def expert_gpu_bytes(
    shapes: Sequence[LayerShape],
    splits: Sequence[LayerSplit],
    tokens: int,
    popularity: Sequence[Sequence[float] | None] | None = None,
    rank: int = 0,
) -> tuple[int, int, int]:
    """(resident weights, stream buffers, one layer's GPU expert activations) in bytes; ``rank``:
    the expert LoRA's (resident weights kept in the wide layout hold its blocks)."""
    resident = sum(len(s.resident) * sh.resident_bytes(rank) for sh, s in zip(shapes, splits, strict=True))
    buffers = STREAM_BUFFERS * max(
        (len(s.streamed) * sh.expert_bytes for sh, s in zip(shapes, splits)), default=0
    )
    act = 0
    for i, (sh, s) in enumerate(zip(shapes, splits)):
        on_gpu = set(s.resident) | set(s.streamed)
        if on_gpu:
            pairs = pairs_per_expert(sh, popularity[i] if popularity else None, tokens)
            act = max(act, sh.gpu_act_bytes(sum(pairs[e] for e in on_gpu)))
    return resident, buffers, act


def predict(
    shapes: Sequence[LayerShape],
    splits: Sequence[LayerSplit],
    rates: Rates,
    rank: int,
    tokens: int,
    nonexpert_flops: float = 0.0,
    popularity: Sequence[Sequence[float] | None] | None = None,
    stream_layers: int | None = None,
    lora_on_cpu: Sequence[bool] | None = None,
    graphs: bool = False,
) -> Prediction:
    """Per-layer times, step time and expert GPU memory of ``splits`` (one per MoE layer).
    ``stream_layers``: layers streaming in the run (``link_passes``; None: those of ``splits``).
    ``lora_on_cpu``: per layer, whether its expert LoRA stays on the CPU although some of its
    experts are on the GPU (``lora_host_seconds``); None: no layer's does. ``graphs``: layers with
    every expert resident and their LoRA on the GPU replay CUDA graphs (``LayerTimes.graphed``)."""
    if len(shapes) != len(splits):
        raise ValueError(f"{len(shapes)} layer shapes but {len(splits)} splits")
    pops = popularity or [None] * len(shapes)
    if stream_layers is None:
        stream_layers = sum(1 for s in splits if s.streamed)
    passes = link_passes(stream_layers)
    nonexpert_s = nonexpert_seconds(rates, nonexpert_flops)
    share = nonexpert_s / len(shapes) if shapes else 0.0
    times = [
        layer_times(sh, s, rates, rank, tokens, p, passes, share) for sh, s, p in zip(shapes, splits, pops)
    ]
    if lora_on_cpu is not None:
        times = [
            replace(t, lora_s=lora_host_seconds(sh, rank, rates)) if off and (s.resident or s.streamed) else t
            for t, sh, s, off in zip(times, shapes, splits, lora_on_cpu, strict=True)
        ]
    if graphs:
        gpu_share = nonexpert_gpu_seconds(rates, nonexpert_flops) / len(shapes) if shapes else 0.0
        off = lora_on_cpu or [False] * len(shapes)
        times = [
            replace(t, graphed=True, nonexpert_gpu_s=min(gpu_share, t.nonexpert_s))
            if len(s.resident) == sh.num_experts and not s.streamed and not cpu_lora
            else t
            for t, sh, s, cpu_lora in zip(times, shapes, splits, off, strict=True)
        ]
    res, buf, act = expert_gpu_bytes(shapes, splits, tokens, popularity, rank)
    return Prediction(times, nonexpert_s, res, buf, act)
