"""Choose each MoE layer's split (resident / streamed / CPU experts) that minimises the predicted
step time of ``cost.py`` under a GPU memory budget for the routed experts.

Within a layer only the *counts* matter for the time once experts are ranked by popularity:
the least popular belong on the CPU (its cost is per pair), a streamed expert costs the same
link time whatever its popularity, and which of the GPU ones are resident rather than streamed
changes no time. So a layer's split is (r, s): its r most popular experts resident, the next s
streamed, the rest on the CPU.

Search: for every stream-buffer size S (the most experts any layer streams, 0..E; 0 only when
streaming is not available), the memory left after 2·S experts of buffers and one layer's GPU
activations (worst case: every pair of a layer on the GPU) goes to resident experts, taken in one
global order (most routed pairs first, then lower layer, then lower id) until the next does not
fit; then each layer takes the s <= min(S, E - r) that minimises its time (``cost.LayerTimes.seconds``:
the CPU's, then the link and the GPU overlapped per phase; ties: the smaller s). The S with the smallest predicted step wins (ties: the smaller S, less memory).
Deterministic for the same inputs.

Where the resident layers sit. When a split streams, layers that the model cannot tell apart
(same shape, same ranked pairs, same LoRA home: every layer under uniform popularity) exchange
their (resident, streamed) counts so that the most-resident layers are spread evenly through
the depth (``_spread``) instead of filling the first layers: the same predicted time and memory,
but in the backward a resident layer's GPU work then runs while the next streamed layer's
weights cross the link, where with the resident layers first the streamed ones wait for the link
back to back (the forward, ~1/4 of the GPU work under checkpointing, waits for the link either
way).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kt_ft.plan.cost import (
    STREAM_BUFFERS,
    LayerShape,
    LayerSplit,
    Prediction,
    Rates,
    link_passes,
    lora_host_seconds,
    nonexpert_seconds,
    pairs_per_expert,
    predict,
    times_from_pairs,
)

# predicted steps closer than this (relative) count as equal, and the smaller stream buffers win:
# the model is not that precise, and a split that saves 0.1% of a step is not worth the memory
_REL_TIE = 1e-3
# GPU bytes per expert-LoRA parameter of a layer with GPU experts whose LoRA stays on the CPU: the
# fp32 copy of the rows its forward takes there, kept until the layer's backward
LORA_COPY_BYTES = 4


@dataclass
class PlannerInput:
    """One MoE layer: its decoder-layer index, shape and routing counts per expert (None: uniform)."""

    layer: int
    shape: LayerShape
    popularity: Sequence[float] | None = None


@dataclass
class Choice:
    """The planner's answer: one split per input layer (same order), its prediction, and why."""

    layers: list[int]
    splits: list[LayerSplit]
    prediction: Prediction
    budget_bytes: int | None
    notes: list[str]
    # whether the expert LoRA of the layers with GPU experts moves to the GPU (False: it stays on
    # the CPU, the layers paying ``cost.lora_host_seconds``); None: not the planner's to say
    # (no LoRA state counted, or a re-plan, where the LoRA stays where it is)
    lora_on_gpu: bool | None = None


def _ranked(inp: PlannerInput, tokens: int) -> tuple[list[int], list[float]]:
    """Expert ids by popularity (most routed first, ties: lower id) and their pairs in that order."""
    pairs = pairs_per_expert(inp.shape, inp.popularity, tokens)
    order = sorted(range(inp.shape.num_experts), key=lambda e: (-pairs[e], e))
    return order, [pairs[e] for e in order]


def _global_order(ranked_pairs: list[list[float]]) -> list[int]:
    """Layer positions in the order resident experts are taken: most pairs first (then lower
    layer position); each layer's experts in its own ranking order."""
    heap = [(-p[0], i, 0) for i, p in enumerate(ranked_pairs) if p]
    heapq.heapify(heap)
    out = []
    while heap:
        _, i, j = heapq.heappop(heap)
        out.append(i)
        if j + 1 < len(ranked_pairs[i]):
            heapq.heappush(heap, (-ranked_pairs[i][j + 1], i, j + 1))
    return out


class _StreamSearch:
    """(s, seconds): the stream count in 0..s_max minimising one layer's time with r resident.

    Memoised per (layer class, r) as running minima over s, so layers with the same shape and
    ranked pairs (every layer, with uniform popularity) share the work."""

    def __init__(self, rates: Rates, rank: int, tokens: int, passes: float, nonexpert_s: float = 0.0) -> None:
        self.rates, self.rank, self.tokens, self.passes = rates, rank, tokens, passes
        self.nonexpert_s = nonexpert_s  # each layer's share of the non-expert GPU work
        self._memo: dict[tuple, list[tuple[int, float]]] = {}

    def best(self, key, shape: LayerShape, prefix: list[float], r: int, s_max: int) -> tuple[int, float]:
        run = self._memo.setdefault((key, r), [])
        total = prefix[-1]
        while len(run) <= s_max:
            s = len(run)
            gpu_pairs = prefix[r + s]
            t = times_from_pairs(
                shape, self.rates, self.rank, self.tokens, total - gpu_pairs, gpu_pairs, s, self.passes,
                self.nonexpert_s,
            ).seconds  # fmt: skip
            run.append((s, t) if not run or t < run[-1][1] * (1 - _REL_TIE) else run[-1])
        return run[s_max]


def _split(ranked_ids: list[int], r: int, s: int) -> LayerSplit:
    """A layer's split with its ``r`` most popular experts resident and the next ``s`` streamed."""
    return LayerSplit(tuple(sorted(ranked_ids[:r])), tuple(sorted(ranked_ids[r : r + s])))


def _spread(
    splits: list[LayerSplit], classes: Sequence, ranked: list[tuple[list[int], list[float]]]
) -> list[LayerSplit]:
    """``splits`` with the (resident, streamed) counts of each class of interchangeable layers
    (``classes[i]``: equal for layers the cost model cannot tell apart) redistributed over the
    class's layers: the largest resident counts first, each count's layers evenly spaced among
    the positions still free (q-th of n at free[floor((q + 1/2) m / n)], m free), the rest in
    the remaining positions. Each layer takes its own most popular experts for its counts."""
    out = list(splits)
    members: dict = {}
    for i, c in enumerate(classes):
        members.setdefault(c, []).append(i)
    for group in members.values():
        if len(group) < 2:
            continue
        counts = sorted(
            ((len(splits[i].resident), len(splits[i].streamed)) for i in group), key=lambda c: (-c[0], c[1])
        )
        free = list(group)  # depth order
        for (r, s), same in itertools.groupby(counts):
            n, m = len(list(same)), len(free)
            picks = [free[int((q + 0.5) * m / n)] for q in range(n)]
            for i in picks:
                out[i] = _split(ranked[i][0], r, s)
            taken = set(picks)
            free = [i for i in free if i not in taken]
    return out


def choose_splits(
    inputs: Sequence[PlannerInput],
    rates: Rates,
    *,  # the rest by name: rank, tokens and the byte counts are all numbers
    rank: int,
    tokens: int,
    budget_bytes: int | None,
    allow_stream: bool = True,
    nonexpert_flops: float = 0.0,
    layer_scale: float = 1.0,
    lora_state_bytes: int = 0,
    lora_fixed: Sequence[bool] | None = None,
    lora_may_stay: bool = True,
) -> Choice:
    """The split per layer minimising the predicted step time.

    ``budget_bytes``: GPU memory the routed experts may take (resident weights, stream buffers,
    their activations); None or <= 0: nothing on the GPU. ``allow_stream``: False where streamed
    experts cannot run. Without the link and GPU rates (no CUDA) every expert is on the CPU.
    ``layer_scale``: real layers each of ``inputs`` stands for (the bench plans a few layers of a
    model under the full model's budget): resident weights count that many times, the stream
    buffers and the activation reserve (one or two layers whatever the depth) once.
    ``lora_state_bytes``: GPU bytes per expert-LoRA parameter of a layer with experts on the GPU
    (its LoRA and optimizer state move there: ``placement/homes.py`` ``lora_home``; 0: they stay on the
    CPU); such layers' LoRA counts against the budget (scaled like resident weights), taking
    resident experts back until it fits. ``lora_fixed`` (a re-plan: the LoRA does not move once
    the run started): per input, whether its LoRA is on the GPU, counted whatever the split.
    ``lora_may_stay``: with ``lora_state_bytes`` and no ``lora_fixed``, also search the splits with
    that LoRA left on the CPU (each such layer paying ``cost.lora_host_seconds``) and keep the
    faster (``Choice.lora_on_gpu``; ties: on the GPU).
    """
    notes: list[str] = []
    pops = [i.popularity for i in inputs]
    shapes = [i.shape for i in inputs]
    all_cpu = [LayerSplit() for _ in inputs]

    def done(splits, lora_on_gpu=None):
        off = None
        if lora_fixed is not None:
            off = [not f for f in lora_fixed] if lora_state_bytes else None
        elif lora_on_gpu is False:
            off = [True] * len(inputs)
        return Choice(
            [i.layer for i in inputs],
            splits,
            predict(shapes, splits, rates, rank, tokens, nonexpert_flops, pops, lora_on_cpu=off),
            budget_bytes,
            notes,
            lora_on_gpu,
        )

    if not inputs:
        return done([])
    if not rates.has_gpu:
        notes.append("no link / GPU rate (no CUDA device measured): every routed expert on the CPU")
        return done(all_cpu)
    if rates.cpu_flops is None:
        raise ValueError("the CPU op's rate is unknown: measure it or give it (cpu_token_us=...)")
    if budget_bytes is None or budget_bytes <= 0:
        notes.append("no GPU memory left for routed experts: every routed expert on the CPU")
        return done(all_cpu)

    ranked = [_ranked(i, tokens) for i in inputs]
    prefixes = []
    for _, pairs in ranked:
        pre = [0.0]
        for p in pairs:
            pre.append(pre[-1] + p)
        prefixes.append(pre)
    order = _global_order([pairs for _, pairs in ranked])
    # cumulative resident bytes along the global order, and each layer's positions in it
    cum = [0]
    positions: list[list[int]] = [[] for _ in inputs]
    for pos, i in enumerate(order):
        cum.append(cum[-1] + round(shapes[i].resident_bytes(rank) * layer_scale))
        positions[i].append(pos)
    act = max(sh.gpu_act_bytes(tokens * sh.top_k) for sh in shapes)  # a whole layer on the GPU
    max_e = max(sh.num_experts for sh in shapes)
    max_b = max(sh.expert_bytes for sh in shapes)

    # the link crossings of a streamed layer as in the real model (every layer may stream: under a
    # cap that streams at all, nearly every layer does), its depth len(inputs) x layer_scale
    share = nonexpert_seconds(rates, nonexpert_flops) / len(inputs)  # as ``predict`` spreads it
    search = _StreamSearch(rates, rank, tokens, link_passes(round(len(inputs) * layer_scale)), share)
    classes: dict[tuple, int] = {}
    keys = [classes.setdefault((sh, tuple(pre)), len(classes)) for sh, pre in zip(shapes, prefixes)]

    def search_splits(state_bytes: int, host_s: list[float]) -> tuple[float, int, list[LayerSplit]] | None:
        """The best (seconds, stream buffer size, splits) with ``state_bytes`` of GPU memory per
        expert-LoRA parameter of a layer with GPU experts, each such layer taking ``host_s[i]``
        more seconds; None: nothing fits."""
        lora_bytes = [
            round(3 * sh.num_experts * rank * (sh.hidden + sh.inter) * state_bytes * layer_scale)
            for sh in shapes
        ]

        def evaluate(n_res: int, cap_s: int) -> tuple[float, list[LayerSplit], int]:
            """(predicted seconds, splits, GPU bytes of moved LoRA) with the first ``n_res`` experts of
            the global order resident and at most ``cap_s`` streamed per layer."""
            step, splits, moved = 0.0, [], 0
            for i, inp in enumerate(inputs):
                r = bisect.bisect_left(positions[i], n_res)
                s_max = min(cap_s, inp.shape.num_experts - r)
                s, t = search.best(keys[i], inp.shape, prefixes[i], r, s_max)
                splits.append(_split(ranked[i][0], r, s))
                step += t + (host_s[i] if r + s else 0.0)
                if r + s if lora_fixed is None else lora_fixed[i]:
                    moved += lora_bytes[i]
            return step, splits, moved

        best: tuple[float, int, list[LayerSplit]] | None = None
        for cap_s in range(max_e + 1) if allow_stream else [0]:
            left = budget_bytes - act - STREAM_BUFFERS * cap_s * max_b
            if left < 0:
                break  # larger buffers fit even less
            n_res = bisect.bisect_right(cum, left) - 1  # resident experts that fit, in the global order
            step, splits, moved = evaluate(n_res, cap_s)
            if cum[n_res] + moved > left:
                # the LoRA of the layers with GPU experts does not fit beside them: the most resident
                # experts that fit with it (binary search; moved LoRA grows with the resident count)
                lo, hi = 0, n_res - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if cum[mid] + evaluate(mid, cap_s)[2] <= left:
                        lo = mid
                    else:
                        hi = mid - 1
                step, splits, moved = evaluate(lo, cap_s)
                if cum[lo] + moved > left:
                    continue  # even with no resident expert: this stream size leaves no room
            if best is None or step < best[0] * (1 - _REL_TIE):
                best = (step, cap_s, splits)
        return best

    zero = [0.0] * len(inputs)
    if lora_fixed is not None:  # a re-plan: CPU-homed LoRA stays so, and pays for it
        host = zero
        if lora_state_bytes:  # (several processes keep every layer's on the CPU: not modelled)
            host = [0.0 if f else lora_host_seconds(sh, rank, rates) for f, sh in zip(lora_fixed, shapes)]
        best, lora_on_gpu = search_splits(lora_state_bytes, host), None
    else:
        best, lora_on_gpu = search_splits(lora_state_bytes, zero), (True if lora_state_bytes else None)
        if lora_state_bytes and lora_may_stay:
            host = [lora_host_seconds(sh, rank, rates) for sh in shapes]
            # what stays on the GPU: the forward's fp32 copy of the LoRA rows, until the backward
            stay = search_splits(LORA_COPY_BYTES, host)
            if stay is not None and (best is None or stay[0] < best[0] * (1 - _REL_TIE)):
                moved = sum(3 * sh.num_experts * rank * (sh.hidden + sh.inter) for sh in shapes)
                notes.append(
                    f"the expert LoRA of the layers with GPU experts stays on the CPU: predicted "
                    f"{stay[0] * 1e3:.0f} ms a micro-batch against "
                    + (f"{best[0] * 1e3:.0f} ms" if best is not None else "no split that fits")
                    + f" with its {moved * lora_state_bytes * layer_scale / 2**30:.2f} GiB of LoRA and AdamW "
                    "state on the GPU"
                )
                best, lora_on_gpu = stay, False
    if best is None:
        notes.append(
            f"the routed experts' GPU budget ({budget_bytes / 2**30:.2f} GiB) is below one layer's expert "
            f"activations ({act / 2**30:.2f} GiB): every routed expert on the CPU"
        )
        return done(all_cpu)
    if not allow_stream:
        notes.append("streamed experts are not available in this version: resident or CPU only")
    splits = best[2]
    if any(s.streamed for s in splits):
        fixed = lora_fixed if lora_fixed is not None else [None] * len(inputs)
        splits = _spread(splits, list(zip(keys, fixed)), ranked)
    return done(splits, lora_on_gpu)
