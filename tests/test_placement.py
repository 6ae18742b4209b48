"""The placement cost model and planner (kt_ft/placement) against hand-computed cases.

Shape used throughout: E 4, H 100, I 50, top-2, bf16 weights, LoRA rank 0 (so a pair is
12·H·I = 60,000 FLOPs forward + backward, its forward 30,000), expert bytes 3·H·I·2 = 30,000;
10 tokens -> 20 pairs a layer, 5 per expert when uniform. Rates: the CPU 60,000 FLOP/s (1 s a
pair), the GPU 9e10 FLOP/s (1e-6 s a GPU pair: 90,000 FLOPs with the recompute), the link
60,000 B/s (a streamed expert: 2 passes x 30,000 B = 1 s, fewer passes when few layers stream:
``link_passes``) unless a test says otherwise.
One layer's GPU activations, reserved whenever experts go to the GPU (``gpu_act_bytes``): 20 pairs
x (3·100 + 5·50) x 2 + two fp32 slices of 20 x 100 = 38,000 B.
"""

from __future__ import annotations

import dataclasses

import pytest

from kt_ft.plan.cost import (
    LayerShape,
    LayerSplit,
    LayerTimes,
    Rates,
    layer_times,
    link_passes,
    lora_host_seconds,
    non_expert_flops,
    predict,
)
from kt_ft.plan.splits import PlannerInput, choose_splits

SHAPE = LayerShape(num_experts=4, hidden=100, inter=50, top_k=2, weight_bytes=2, act_bytes=2)
B = 30_000  # bytes per expert
ACT = 38_000  # one layer's GPU expert activations, all 20 pairs (module doc)
T = 10
FAST = Rates(cpu_flops=60_000, link_bytes_s=60_000, gpu_flops=9e10)


def test_shape_counts():
    assert SHAPE.expert_bytes == B
    assert SHAPE.pair_flops(0) == 60_000 and SHAPE.forward_flops(0) == 30_000
    assert SHAPE.pair_flops(2) == 60_000 + 18 * 2 * 150  # LoRA: 18·r·(H + I)
    # the expert work's peak: (3·H + 5·I) values a pair (bf16) + two fp32 [pairs, H] slices
    assert SHAPE.gpu_act_bytes(10) == 10 * (3 * 100 + 5 * 50) * 2 + 2 * 10 * 100 * 4
    assert SHAPE.gpu_act_bytes(0) == 0


def test_layer_times_by_hand():
    # all CPU: 20 pairs x 1 s; the link carries x in, out back, grad in, grad x back: 10·100·(3·2 + 2) B
    t = layer_times(SHAPE, LayerSplit(), FAST, 0, T)
    assert t.cpu_s == pytest.approx(20) and t.gpu_s == 0
    assert t.link_s == pytest.approx(10 * 100 * 8 / 60_000)
    # the CPU op does not overlap the link or the GPU (cost.py): its time adds to theirs
    assert t.seconds == pytest.approx(20 + t.link_s) and t.bottleneck == "cpu"
    # expert 0 resident, 1 streamed: CPU 10 pairs; link 2·30,000 B + activations with an fp32 output
    t = layer_times(SHAPE, LayerSplit((0,), (1,)), FAST, 0, T)
    assert t.cpu_s == pytest.approx(10)
    assert t.link_s == pytest.approx((2 * B + 10 * 100 * (3 * 2 + 4)) / 60_000)
    assert t.gpu_s == pytest.approx(10 * 90_000 / 9e10)
    assert t.seconds == pytest.approx(t.cpu_s + t.link_s)  # the link > the GPU; the CPU adds
    # no CPU expert: the link and the GPU overlap
    t = layer_times(SHAPE, LayerSplit((0, 1), (2, 3)), FAST, 0, T)
    assert t.cpu_s == 0 and t.seconds == pytest.approx(max(t.link_s, t.gpu_s)) == 2 * 2 * B / 60_000
    # popularity: expert 1 takes half the pairs
    t = layer_times(SHAPE, LayerSplit((1,), ()), FAST, 0, T, popularity=[1, 4, 2, 1])
    assert t.cpu_s == pytest.approx(10) and t.gpu_s == pytest.approx(10 * 1e-6)


def test_layer_time_overlaps_the_link_and_the_gpu_per_phase():
    """cpu + max(link/2, forward GPU work) + max(link/2, recompute + backward GPU work), each phase's
    GPU work being the experts' and its share of the layer's non-expert work (1/4 forward)."""
    t = LayerTimes(cpu_s=1.0, link_s=4.0, gpu_s=2.0, gpu_fwd_s=0.5, nonexpert_s=2.0)
    # forward: max(2, 0.5 + 0.5) = 2; backward: max(2, 1.5 + 1.5) = 3
    assert t.seconds == pytest.approx(1 + 2 + 3) and t.bottleneck == "link"
    # all hidden under the link in both phases: the link's time
    assert LayerTimes(0.0, 8.0, 2.0, 0.5, 2.0).seconds == pytest.approx(8)
    # no link: the GPU work, all of it
    assert (
        LayerTimes(0.0, 0.0, 2.0, 0.5, 2.0).seconds
        == pytest.approx(4)
        == LayerTimes(0, 0, 2, 0.5, 2).gpu_s + 2
    )
    # one max over the step would hide the backward's 3 s under the 4 s link; per phase it does not
    assert LayerTimes(0.0, 4.0, 2.0, 0.5, 2.0).seconds > max(4.0, 2.0 + 2.0)
    # times_from_pairs splits the experts' GPU work: forward fwd_flops, recompute + backward pair_flops
    u = layer_times(SHAPE, LayerSplit((0, 1, 2, 3), ()), FAST, 0, T, nonexpert_s=0.25)
    assert u.gpu_fwd_s == pytest.approx(u.gpu_s * 30_000 / 90_000) and u.nonexpert_s == 0.25


def test_a_graphed_layer_overlaps_its_experts_with_the_host_bound_non_expert_work():
    """With CUDA graphs an all-resident layer's phase is max(its non-expert share (host-bound),
    that share's GPU time + the experts' GPU work of the phase), not their sum."""
    t = LayerTimes(cpu_s=0.0, link_s=0.0, gpu_s=2.0, gpu_fwd_s=0.5, nonexpert_s=4.0)
    assert t.seconds == pytest.approx(6.0)  # eager: 0.5 + 1 forward, 1.5 + 3 backward
    g = dataclasses.replace(t, graphed=True, nonexpert_gpu_s=1.2)
    # forward: max(1, 0.3 + 0.5); backward: max(3, 0.9 + 1.5): the host's 4 s
    assert g.seconds == pytest.approx(4.0)
    # a GPU-bound layer: forward max(1, 2 + 0.5), backward max(3, 6 + 1.5)
    assert dataclasses.replace(g, nonexpert_gpu_s=8.0).seconds == pytest.approx(2.5 + 7.5)
    # predict marks the all-resident layers only (and not one whose LoRA stays on the CPU); the
    # non-expert GPU time: the run's, else its FLOPs at the dense rate
    splits = [LayerSplit((0, 1, 2, 3), ()), LayerSplit((0, 1), (2, 3)), LayerSplit((0, 1, 2, 3), ())]
    rates = dataclasses.replace(FAST, nonexpert_s=3.0)
    p = predict([SHAPE] * 3, splits, rates, 0, T, 9e10, lora_on_cpu=[False, False, True], graphs=True)
    assert [x.graphed for x in p.layers] == [True, False, False]
    assert p.layers[0].nonexpert_gpu_s == pytest.approx(1.0 / 3)  # 9e10 FLOPs at 9e10/s over 3 layers
    measured = dataclasses.replace(rates, nonexpert_gpu_s=0.6)
    q = predict([SHAPE] * 3, splits, measured, 0, T, 9e10, graphs=True)
    assert q.layers[0].nonexpert_gpu_s == pytest.approx(0.2) and q.layers[2].graphed
    # without graphs nothing changes
    e = predict([SHAPE] * 3, splits, measured, 0, T, 9e10)
    assert not any(x.graphed for x in e.layers) and e.step_s >= q.step_s


def test_rates_must_exist_for_what_is_used():
    with pytest.raises(ValueError, match="link rate is unknown"):
        layer_times(SHAPE, LayerSplit((), (0,)), Rates(cpu_flops=1.0), 0, T)
    with pytest.raises(ValueError, match="GPU rate is unknown"):
        layer_times(SHAPE, LayerSplit((0,), ()), Rates(cpu_flops=1.0), 0, T)


def test_predict_memory_and_step():
    splits = [LayerSplit((0, 1), (2,)), LayerSplit((), (0, 1, 3))]
    p = predict([SHAPE, SHAPE], splits, FAST, 0, T, nonexpert_flops=9e10)
    assert p.resident_bytes == 2 * B
    assert p.stream_buffer_bytes == 2 * 3 * B  # two buffers of the layer streaming the most (3)
    assert p.expert_activation_bytes == SHAPE.gpu_act_bytes(15)  # layer 1: 15 GPU pairs
    assert p.nonexpert_s == pytest.approx(1.0)
    # the non-expert second spread over the two MoE layers, inside their times
    assert [t.nonexpert_s for t in p.layers] == pytest.approx([0.5, 0.5])
    assert p.step_s == pytest.approx(sum(t.seconds for t in p.layers))
    # layer 0: CPU 5 s; layer 1: CPU 5 s, link 3 s + activations
    assert [t.cpu_s for t in p.layers] == pytest.approx([5, 5])


def test_link_passes():
    """A streamed layer crosses twice a step (forward, recompute) but for the 2 + 2 layer visits the
    two buffers still hold (the turn, the next step's start), spread over the streaming layers."""
    assert [link_passes(n) for n in (1, 2, 4, 8, 48)] == pytest.approx([0, 0, 1, 1.5, 2 - 4 / 48])
    assert link_passes(0) == 2


def test_non_expert_flops_by_hand():
    # 1000 linear weights, 200 head weights, 2 attention layers of 4 heads x 8, seq 16, batch 2
    f = non_expert_flops(1000, 200, 2, 4, 8, 16, 2)
    assert f == 6 * 1000 * 32 + 4 * 200 * 32 + 4 * 2 * 16 * 16 * 4 * 8 * 2 * 2
    assert non_expert_flops(1000, 0, 0, 1, 1, 16, 1, recompute=False) == 4 * 1000 * 16


def layers(n, popularity=None):
    return [PlannerInput(i, SHAPE, popularity) for i in range(n)]


def test_big_cap_puts_everything_resident():
    c = choose_splits(layers(8), FAST, rank=0, tokens=T, budget_bytes=ACT + 32 * B)
    assert all(s == LayerSplit((0, 1, 2, 3), ()) for s in c.splits)
    assert c.prediction.step_s == pytest.approx(8 * 20 * 1e-6)
    assert c.prediction.bottleneck == "gpu"


def test_cpu_bound_machine_streams():
    # 8 streaming layers cross the link 2 - 4/8 = 1.5 times a step (the buffers' reuses at the turn
    # and the step's start): a streamed expert 0.75 s. Budget for 8 experts: S=4 buffers (all
    # streamed, 8 x 3 s = 24 s) beats S=3, S=2, S=1 and S=0 (8 resident, 6 CPU layers x 20 = 120 s)
    c = choose_splits(layers(8), FAST, rank=0, tokens=T, budget_bytes=ACT + 8 * B)
    assert all(s == LayerSplit((), (0, 1, 2, 3)) for s in c.splits)
    assert c.prediction.step_s == pytest.approx(24)
    assert c.prediction.bottleneck == "link"
    assert c.prediction.stream_buffer_bytes == 8 * B and c.prediction.resident_bytes == 0


def test_slow_link_streams_nothing():
    # link 1,000 B/s: a streamed expert costs 60 s; S=0 (layers 0 and 1 resident, 6 CPU layers)
    # beats S=1 and every larger S
    slow = Rates(cpu_flops=60_000, link_bytes_s=1_000, gpu_flops=9e10)
    c = choose_splits(layers(8), slow, rank=0, tokens=T, budget_bytes=ACT + 8 * B)
    assert [s.streamed for s in c.splits] == [()] * 8
    assert [s.resident for s in c.splits] == [(0, 1, 2, 3)] * 2 + [()] * 6
    # 6 CPU layers: 20 s of CPU op, then its activations over the slow link, 8,000 B (not overlapped)
    assert c.prediction.step_s == pytest.approx(6 * (20 + 8) + 2 * 20e-6)


def test_no_room_or_no_gpu_means_all_cpu():
    for budget in (None, 0, ACT + B - 1):
        c = choose_splits(layers(3), FAST, rank=0, tokens=T, budget_bytes=budget)
        assert c.splits == [LayerSplit()] * 3
    c = choose_splits(layers(3), Rates(cpu_flops=60_000), rank=0, tokens=T, budget_bytes=10**12)
    assert c.splits == [LayerSplit()] * 3 and "no link / GPU rate" in c.notes[0]
    assert c.prediction.step_s == pytest.approx(3 * 20)


def test_most_popular_expert_goes_resident():
    # pairs [2, 10, 6, 2]: room for one resident (no stream buffers: 2 x B > what is left)
    c = choose_splits(layers(1, [1, 5, 3, 1]), FAST, rank=0, tokens=T, budget_bytes=ACT + B)
    assert c.splits == [LayerSplit((1,), ())]
    assert c.prediction.layers[0].cpu_s == pytest.approx(10)
    # across layers: the layer whose next expert has more pairs goes first
    ins = [PlannerInput(0, SHAPE, [1, 1, 1, 1]), PlannerInput(1, SHAPE, [1, 5, 3, 1])]
    c = choose_splits(ins, FAST, rank=0, tokens=T, budget_bytes=ACT + 2 * B, allow_stream=False)
    assert c.splits == [LayerSplit(), LayerSplit((1, 2), ())]


def test_without_streaming_resident_only():
    c = choose_splits(layers(8), FAST, rank=0, tokens=T, budget_bytes=ACT + 8 * B, allow_stream=False)
    assert [s.resident for s in c.splits] == [(0, 1, 2, 3)] * 2 + [()] * 6
    assert all(not s.streamed for s in c.splits)


def test_deterministic():
    a = choose_splits(layers(5, [3, 1, 4, 1]), FAST, rank=0, tokens=T, budget_bytes=ACT + 6 * B)
    b = choose_splits(layers(5, [3, 1, 4, 1]), FAST, rank=0, tokens=T, budget_bytes=ACT + 6 * B)
    assert a.splits == b.splits


def test_layer_scale_counts_resident_weights_per_real_layer():
    # 2 benchmarked layers standing for 8 (scale 4), budget of test_slow_link_streams_nothing: the
    # 8 resident experts that fit are 2 real layers' worth, half of one benchmarked layer (2 experts
    # x 4); the stream buffers would not scale (test_cpu_bound_machine_streams, scale 1 vs 4: same)
    slow = Rates(cpu_flops=60_000, link_bytes_s=1_000, gpu_flops=9e10)
    c = choose_splits(layers(2), slow, rank=0, tokens=T, budget_bytes=ACT + 8 * B, layer_scale=4)
    assert [s.resident for s in c.splits] == [(0, 1), ()] and not any(s.streamed for s in c.splits)
    # a fast link: unscaled, both layers fit resident; scaled, streaming both (buffers 8 B, once)
    # beats 2 resident experts (layer 0: 2 CPU experts, 10 s; layer 1: 20 s): planned for the 8
    # real layers' 1.5 passes, 2 x 3 s = 6 s. The prediction is the 2 benchmarked layers' own: the
    # two buffers hold both, nothing crosses after the first step, the GPU's 40 pairs are left
    one, four = (
        choose_splits(layers(2), FAST, rank=0, tokens=T, budget_bytes=ACT + 8 * B, layer_scale=s)
        for s in (1, 4)
    )
    assert one.splits == [LayerSplit((0, 1, 2, 3), ())] * 2
    assert four.splits == [LayerSplit((), (0, 1, 2, 3))] * 2
    assert four.prediction.step_s == pytest.approx(40 * 1e-6)


def test_layers_with_gpu_experts_count_their_expert_lora_state():
    # rank 1: a layer's expert LoRA is 3·4·1·(100 + 50) = 1,800 values, 28,800 bytes with its grad
    # and AdamW moments (16 B each), on the GPU once the layer has an expert there. The budget
    # that holds all 32 experts without it holds 25 with it: 6 whole layers and 1 expert of layer
    # 6, 7 layers' LoRA (25·B + 7·28,800 <= 32·B; 26 experts would not fit), layer 7 all on the CPU
    kw = dict(budget_bytes=ACT + 32 * B, allow_stream=False)
    assert choose_splits(layers(8), FAST, rank=1, tokens=T, **kw).splits == [LayerSplit((0, 1, 2, 3), ())] * 8
    c = choose_splits(layers(8), FAST, rank=1, tokens=T, lora_state_bytes=16, lora_may_stay=False, **kw)
    assert [s.resident for s in c.splits] == [(0, 1, 2, 3)] * 6 + [(0,), ()]
    assert c.lora_on_gpu is True
    # streaming: streamed experts move the LoRA too; with no room for it beside the buffers the
    # planner keeps the experts on the CPU instead of overrunning the budget
    tight = choose_splits(
        layers(2),
        FAST,
        rank=1,
        tokens=T,
        budget_bytes=ACT + 8 * B,
        lora_state_bytes=10**6,
        lora_may_stay=False,
    )
    assert tight.splits == [LayerSplit()] * 2
    # a re-plan: the LoRA stays where the run put it, counted whatever the split. All 8 layers'
    # LoRA on the GPU leaves 32·B - 8·28,800 for 24 resident experts; none there: all 32 fit
    c = choose_splits(layers(8), FAST, rank=1, tokens=T, lora_state_bytes=16, lora_fixed=[True] * 8, **kw)
    assert sum(len(s.resident) for s in c.splits) == 24
    c = choose_splits(layers(8), FAST, rank=1, tokens=T, lora_state_bytes=16, lora_fixed=[False] * 8, **kw)
    assert c.splits == [LayerSplit((0, 1, 2, 3), ())] * 8
    # ... and a CPU-homed LoRA keeps paying for its crossings (next test) in the prediction
    assert c.lora_on_gpu is None
    assert [t.lora_s for t in c.prediction.layers] == pytest.approx(
        [lora_host_seconds(SHAPE, 1, FAST)] * 8
    )  # + GPU ~0.2 ms


def test_expert_lora_stays_on_the_cpu_when_that_is_faster():
    # Room for the 32 experts and 8 x 7,200 B: each layer's fp32 LoRA copy (1,800 values x 4 B), the
    # GPU bytes of a LoRA left on the CPU. With its 28,800 B of GPU state (weights, grad, moments)
    # instead, 27 experts fit (27·B + 7 layers' state <= 32·B + 57,600; 28 would not): 5 on the CPU,
    # 25 s. Left on the CPU each layer pays 40 B a parameter at 7.4 GB/s (row copies both ways, a
    # CPU AdamW: cost.py): ~10 us. Faster, so chosen, and said.
    host = 40 * 1800 / 7.4e9
    assert lora_host_seconds(SHAPE, 1, FAST) == pytest.approx(host)
    kw = dict(budget_bytes=ACT + 32 * B + 8 * 7200, allow_stream=False, lora_state_bytes=16)
    c = choose_splits(layers(8), FAST, rank=1, tokens=T, **kw)
    assert c.lora_on_gpu is False
    assert c.splits == [LayerSplit((0, 1, 2, 3), ())] * 8
    assert [t.lora_s for t in c.prediction.layers] == pytest.approx([host] * 8)
    assert c.prediction.step_s == pytest.approx(sum(t.seconds for t in c.prediction.layers))
    assert any("stays on the CPU" in n for n in c.notes)
    # one copy's bytes less: 31 experts fit with the LoRA left on the CPU, still the faster
    c = choose_splits(layers(8), FAST, rank=1, tokens=T, **{**kw, "budget_bytes": ACT + 32 * B + 7 * 7200})
    assert c.lora_on_gpu is False and sum(len(s.resident) for s in c.splits) == 31
    # a CPU 500,000x faster (2 us a pair) and a link 1e6x (the CPU part's activations cross it): the 5
    # CPU experts' 25 pairs cost 50 us, less than the 8 x 10 us of keeping the LoRA on the CPU: it
    # goes to the GPU, 27 experts with it
    quick = Rates(cpu_flops=(12 * 100 * 50 + 18 * 150) / 2e-6, link_bytes_s=6e10, gpu_flops=9e10)
    c = choose_splits(layers(8), quick, rank=1, tokens=T, **kw)
    assert c.lora_on_gpu is True
    assert sum(len(s.resident) for s in c.splits) == 27
    assert all(t.lora_s == 0 for t in c.prediction.layers)
    # room for both: the LoRA goes with the experts (ties: the GPU)
    big = choose_splits(
        layers(8), FAST, rank=1, tokens=T, **{**kw, "budget_bytes": ACT + 32 * B + 8 * 28_800}
    )
    assert big.lora_on_gpu is True and big.splits == [LayerSplit((0, 1, 2, 3), ())] * 8


def test_resident_layers_are_spread_through_the_depth(monkeypatch):
    """When the split streams, interchangeable layers (same shape and popularity) exchange their
    counts so the resident ones are evenly spaced (``planner._spread``): the same prediction and
    GPU memory as the first-layers order (the planner's split with ``_spread`` left out), resident
    layers 1, 4, 7, 10 of 12 for 4 whole layers' worth, the partly resident layer amid the free
    positions."""
    from kt_ft.plan import splits as splits_mod

    def plan(extra, spread, ins=None):
        with monkeypatch.context() as m:
            if not spread:  # the first-layers order: the split as the search gave it
                m.setattr(splits_mod, "_spread", lambda splits, keys, ranked: splits)
            return choose_splits(ins or layers(12), FAST, rank=0, tokens=T, budget_bytes=ACT + extra * B)

    full, part, streamed = (
        LayerSplit((0, 1, 2, 3), ()),
        LayerSplit((0, 1), (2, 3)),
        LayerSplit((), (0, 1, 2, 3)),
    )
    for extra in (24, 26):
        a, b = plan(extra, True), plan(extra, False)
        assert a.prediction.step_s == pytest.approx(b.prediction.step_s)
        assert a.prediction.expert_gpu_bytes == b.prediction.expert_gpu_bytes
        assert sorted(a.splits, key=repr) == sorted(b.splits, key=repr)  # the same counts, moved
        assert b.splits[:4] == [full] * 4  # first-layers order
    assert [i for i, s in enumerate(plan(24, True).splits) if s == full] == [1, 4, 7, 10]
    c = plan(26, True).splits
    assert [i for i, s in enumerate(c) if s == full] == [1, 4, 7, 10] and c[6] == part
    assert all(s == streamed for i, s in enumerate(c) if i not in (1, 4, 6, 7, 10))
    # layers with other popularity are not interchangeable: they keep what the planner gave them
    ins = layers(12)
    ins[0] = PlannerInput(0, SHAPE, [5, 1, 1, 1])
    a, b = plan(24, True, ins), plan(24, False, ins)
    assert a.splits[0] == b.splits[0] and a.prediction.step_s == pytest.approx(b.prediction.step_s)
    # no streaming (resident + CPU): nothing to overlap, the first-layers order stays
    c = choose_splits(layers(8), FAST, rank=0, tokens=T, budget_bytes=ACT + 8 * B, allow_stream=False)
    assert [s.resident for s in c.splits] == [(0, 1, 2, 3)] * 2 + [()] * 6


def test_lora_home_keeps_a_lora_the_planner_left_on_the_cpu():
    import torch

    from kt_ft.plan.homes import lora_home

    gpu = torch.device("cuda:0")  # a device object only: no CUDA needed
    assert lora_home(gpu, True) == gpu
    assert lora_home(gpu, True, keep_on_cpu=True) is None
    assert lora_home(gpu, False) is None and lora_home(torch.device("cpu"), True) is None
