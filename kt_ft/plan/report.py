"""What a placement plan costs: module groups per device, bytes, LoRA sizes, activations, fit.

Inputs: the (meta) model, its PlacementPlan and a few training sizes; no weight is read.
Formulas (each number is an estimate, stated so it can be checked by hand):

* parameter bytes: numel x the checkpoint dtype's size, per device of the owning module
  (routed experts of a quantized checkpoint: their stored bytes, ``QuantFormat.nbytes``);
  routed experts all on their expert device (the CPU keeps the full fused weights, which the
  checkpoint and merge read), plus a copy of the ``gpu_experts`` (count/E of the layer's
  experts) on the training device, plus the device buffers of the ``stream`` experts: two
  (double-buffered across layers), each the largest layer's streamed experts.
* PEFT LoRA (``lora_target: all``, as LLaMA-Factory finds it): every ``*Linear*`` module
  outside ``lm_head`` and the routed experts gets r x (in + out) parameters.
* expert LoRA: per MoE layer gate + up + down = 2·E·r·(H + I) + E·r·(I + H) = 3·E·r·(H + I).
* training state of a trainable parameter: 16 bytes (fp32 weight, fp32 grad, AdamW's two fp32
  moments; 8 under LLaMA-Factory's ``pure_bf16``, where all four are bf16), on the device of the parameter (expert LoRA on the CPU, except a layer's with
  resident or streamed experts in a single process: on the training GPU, ``moe/patch.py``
  ``lora_home``).
* GPU activations, gradient checkpointing on (LLaMA-Factory's default), B = batch, S = cutoff_len,
  a = bytes per activation value (2 for 16-bit weights, else 4):
  L·B·S·H·a (each decoder layer's checkpointed input) + 17·B·S·H·a (one layer recomputed
  for its backward: Korthikanti et al. 2022's 34·s·b·h bytes at 2 bytes a value, fused
  attention, no s² term) + 14·B·S·V (the loss: 16-bit logits, their fp32 copy, the fp32
  log-softmax and the fp32 gradient, alive together in its backward; 2·B·S·V·4 before, which a
  DeepSeek-V2-Lite run outgrew by ~1.2 GiB).
* the CUDA runtime outside PyTorch's allocator (context, library handles, kernels loaded while
  the run goes): ``CUDA_OVERHEAD_BYTES`` for a plan made before any GPU work; a run measures the
  context it has and keeps ``CUDA_GROWTH_BYTES`` for what loads later
  (``placement/runtime.py``).
  With routed experts on the GPU (resident or streamed): + one recomputed layer's expert
  activations, B·S·k·(3·I + H)·4 (worst case: every pair of the layer on the GPU; the planner's
  reserve, ``kt_ft/plan/cost.py``).
* CPU activations: per MoE layer what the CPU op keeps for its backward (``cpu_op_saved_bytes``:
  the ``torch`` / ``native`` backends' gate and up pre-activations and the rank-sized LoRA
  products of each routed token-expert pair, counted in fp32, and the layer's input and fp32
  output; under gradient checkpointing every CPU layer's, kept from its first pass to its
  backward); none for a layer whose experts are all resident or streamed (the CPU op never runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kt_ft.backends import lm_loss
from kt_ft.backends.grouped_layout import ROW_PAD
from kt_ft.backends.quant_weights import is_quantized
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes
from kt_ft.base.settings import fusions
from kt_ft.plan.cost import STREAM_BUFFERS, LayerShape
from kt_ft.plan.family import layer_index, unwrap_peft
from kt_ft.plan.homes import lora_home
from kt_ft.plan.placement import PlacementPlan

TRAIN_STATE_BYTES = 16  # per trainable parameter: fp32 weight + grad + 2 AdamW moments
# LLaMA-Factory's ``pure_bf16: true``: trainable parameters stay bf16, so their grads and the
# AdamW moments (torch keeps them in the parameter's dtype) are bf16 too
PURE_BF16_STATE_BYTES = 8
LAYER_WORKSET = 17  # values per token x H of one recomputed decoder layer (see module docstring)
LOSS_BYTES_PER_LOGIT = 14  # 16-bit logits + fp32 copy + fp32 log-softmax + fp32 gradient (module doc)
# the CUDA context and library workspaces outside PyTorch's allocator (a plan made before any GPU
# work; a run measures its own), and what kernels loaded later add to it
CUDA_OVERHEAD_BYTES = 768 * 2**20
CUDA_GROWTH_BYTES = 256 * 2**20
GIB = 2**30


@dataclass
class TrainSizes:
    cutoff_len: int = 2048
    batch: int = 1
    lora_rank: int = 8
    state_bytes: int = TRAIN_STATE_BYTES  # a trainable parameter's training state (PURE_BF16_STATE_BYTES)


def train_sizes(config: Any) -> TrainSizes:
    """The sizes a ``KTConfig`` (``kt_ft.plan.recipe``) trains with: its micro-batch, its LoRA rank
    and its trainable parameters' state (bf16 LoRA under ``pure_bf16``: ``lora_dtype``)."""
    return TrainSizes(
        config.cutoff_len, config.batch, config.rank, state_bytes(config.lora_dtype == torch.bfloat16)
    )


def cpu_op_saved_bytes(tokens: int, k: int, hidden: int, inter: int, rank: int, num_experts: int) -> int:
    """Host bytes the CPU op keeps for one MoE layer's backward at ``tokens`` tokens of top-``k``
    routing over ``num_experts``: per row gate/up pre-activations [2I] and the LoRA products
    [2r] + [r] (``kernels/grouped.py``'s saved set; rows: the routed pairs plus at most
    ``ROW_PAD`` - 1 padding rows an expert; 4 bytes a value, the fp32 compute of ``native`` and of
    CPUs without native bf16, an upper bound for bf16's 2), and per token the layer's input [H]
    (bf16) and output [H] (fp32), which the runner keeps until the backward."""
    rows = tokens * k + min(num_experts, tokens * k) * (ROW_PAD - 1)
    return rows * (2 * inter + 3 * rank) * 4 + tokens * hidden * (2 + 4)


def state_bytes(pure_bf16: bool) -> int:
    """A trainable parameter's training-state bytes: ``PURE_BF16_STATE_BYTES`` under LLaMA-Factory's
    ``pure_bf16``, else ``TRAIN_STATE_BYTES``."""
    return PURE_BF16_STATE_BYTES if pure_bf16 else TRAIN_STATE_BYTES


def _device(d: str) -> str:
    return "cuda:0" if d == "cuda" else d  # "cuda" is the training device, GPU 0 of a run


def _ranges(layers: list[int]) -> str:
    out, start, prev = [], None, None
    for i in sorted(set(layers)):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def _layer(name: str) -> int | None:
    try:
        return layer_index(name)
    except ValueError:
        return None


def _spec_text(spec) -> str | None:
    if spec is None:
        return None
    if spec.is_all:
        return "all"
    if spec.ids is None:
        return f"{spec.count}"
    ids = list(spec.ids)
    return f"ids {ids}" if len(ids) <= 8 else f"{len(ids)} ids [{ids[0]}, {ids[1]}, ..., {ids[-1]}]"


def _resident_count(e) -> int:
    gpu = e.gpu_experts
    if gpu is None:
        return 0
    return len(gpu.ids) if gpu.ids is not None else gpu.count


def _stream_count(e, num_experts: int) -> int:
    """Experts of a layer its ``stream`` entry streams (``all``: every one not resident)."""
    st = e.stream_experts
    if st is None:
        return 0
    if st.is_all:
        return num_experts - _resident_count(e)
    return len(st.ids) if st.ids is not None else st.count


def _expert_groups(plan: PlacementPlan) -> list[dict]:
    groups: list[dict] = []
    for e in plan.experts:
        auto = e.placement == "auto"
        key = (e.device, e.backend, e.threads, _spec_text(e.gpu_experts), _spec_text(e.stream_experts), auto)
        if groups and groups[-1]["key"] == key:
            groups[-1]["layers"].append(e.layer)
        else:
            groups.append({"key": key, "layers": [e.layer]})
    out = []
    for g in groups:
        device, backend, threads, gpu_text, stream_text, auto = g["key"]
        what = f"layers {_ranges(g['layers'])} routed experts"
        how = (
            f"{device} {backend} {threads} threads"
            + (", placement auto" if auto else "")
            + (f", gpu_experts {gpu_text}" if gpu_text else "")
            + (f", stream {stream_text}" if stream_text else "")
        )
        out.append({"what": what, "device": _device(device), "how": how, "layers": g["layers"]})
    return out


def non_expert_activation_bytes(model: torch.nn.Module, sizes: TrainSizes, elt: int) -> int:
    """The training device's activation bytes of a micro-batch apart from the routed experts' (an
    estimate, module doc): the checkpointed layers' inputs, one recomputed layer's work set and the
    loss (transformers' logits of every token, or kt-ft's chunked loss: ``models/lm_loss.py``).
    ``elt``: bytes per value of the model's dtype."""
    text = _text_config(model)
    H, L, V = text.hidden_size, text.num_hidden_layers, text.vocab_size
    tokens = sizes.batch * sizes.cutoff_len
    a = 2 if elt == 2 else 4
    chunked = "loss" in fusions() and lm_loss.supported(model.config)
    loss_bytes = lm_loss.loss_bytes(tokens, V, H) if chunked else LOSS_BYTES_PER_LOGIT * tokens * V
    return L * tokens * H * a + LAYER_WORKSET * tokens * H * a + loss_bytes


def estimate(
    model: torch.nn.Module,
    plan: PlacementPlan,
    dtype: torch.dtype,
    sizes: TrainSizes,
    cuda_overhead_bytes: int | None = None,
    expert_format=None,
    stored_weights: dict[str, int] | None = None,
) -> dict:
    """Every number of ``kt-ft rules plan`` as a JSON-ready dict (bytes, counts, groups, devices).

    ``cuda_overhead_bytes``: the training GPU's memory outside PyTorch's allocator (a run passes
    what it measured plus ``CUDA_GROWTH_BYTES``); None: ``CUDA_OVERHEAD_BYTES + CUDA_GROWTH_BYTES``.
    ``expert_format``: the routed experts' quantized format (``kt_ft.backends.quant``), kept as stored in RAM:
    their bytes are the format's (weights and scales of gate, up [I, H] and down [H, I] per expert);
    the rest counts in ``dtype`` (dequantized at load), but ``stored_weights`` (parameter name ->
    stored bytes: other linear weights a quantized checkpoint keeps as stored, ``kt_ft.runtime.quant_linear``)
    and the weights of ``QuantizedLinear`` layers already in the model, which count as stored."""
    elt = torch.empty((), dtype=dtype).element_size()
    experts = {e.name: e for e in plan.experts}
    train_dev = _device(plan.module_devices.get("", "cuda"))
    devices: dict[str, dict] = {}

    def dev(d: str) -> dict:
        return devices.setdefault(
            d,
            {
                "param_bytes": 0,
                "lora_params": 0,
                "train_state_bytes": 0,
                "activation_bytes": 0,
                "runtime_bytes": 0,
            },
        )

    # parameters, by owning module
    non_expert: dict[tuple[str, bool], list] = {}  # (device, in a decoder layer) -> [layers, numel]
    expert_numel: dict[str, int] = {}
    for pname, p in model.named_parameters():
        owner = pname.rpartition(".")[0]
        # the experts module itself, or (PEFT >= 0.21 wraps it in ParamWrapper layers) a module inside
        e = experts.get(owner) or next((experts[n] for n in experts if owner.startswith(f"{n}.")), None)
        if e is not None:
            if "lora_" not in pname:  # PEFT's own expert LoRA is dropped: kt-ft trains its own
                expert_numel[e.name] = expert_numel.get(e.name, 0) + p.numel()
            continue
        d = _device(plan.module_devices.get(owner, plan.module_devices.get("", "cuda")))
        layer = _layer(owner)
        g = non_expert.setdefault((d, layer is not None), [[], 0])
        if layer is not None:
            g[0].append(layer)
        g[1] += p.numel()
        nbytes = (stored_weights or {}).get(pname)
        if nbytes is None and not p.is_floating_point() and pname.endswith(".weight"):
            # a QuantizedLinear's codes: the layer's stored tensors (codes and scales)
            nbytes = getattr(model.get_submodule(owner), "stored_nbytes", lambda: None)()
        dev(d)["param_bytes"] += p.numel() * elt if nbytes is None else nbytes

    lora = {"peft_params": 0, "expert_params": 0}
    expert_bytes = 0  # every routed expert's weights as held in RAM (a resident one's host copy too)
    stream = {"layers": 0, "experts": 0, "largest_layer_bytes": 0, "buffer_bytes": 0, "bytes_per_pass": 0}
    gpu_expert_act = 0  # one recomputed layer's GPU expert activations (worst case)
    k = getattr(_text_config(model), "num_experts_per_tok", 1)
    tokens = sizes.batch * sizes.cutoff_len
    for e in plan.experts:
        num, hidden, inter = _expert_dims(model, e)
        on_gpu = _resident_count(e)
        mod = model.get_submodule(e.name)
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if is_quantized(gu) and is_quantized(dn):
            # experts kt-ft loaded quantized (a run's placement: auto): their stored tensors, and the
            # module's parameters as held (gpt_oss's biases; in a run also the expert LoRA, which
            # the dense branch counts here the same way)
            per_expert = (gu.nbytes() + dn.nbytes() + expert_numel.get(e.name, 0) * elt) // num
        elif expert_format is not None:
            # the three weights as stored, the rest of the module (gpt_oss's biases) in the load dtype
            rest = expert_numel[e.name] // num - 3 * inter * hidden
            per_expert = (
                2 * expert_format.nbytes(inter, hidden) + expert_format.nbytes(hidden, inter) + rest * elt
            )
        else:
            per_expert = expert_numel[e.name] * elt // num
        dev(_device(e.device))["param_bytes"] += per_expert * num  # resident ones too: a copy goes to the GPU
        expert_bytes += per_expert * num
        if on_gpu:
            # dense resident experts are kept with the expert LoRA's blocks beside them (grouped_wide.py)
            wide = 0
            if not is_quantized(gu) and expert_format is None:
                shape = LayerShape(num, hidden, inter, k, weight_bytes=elt)
                wide = shape.resident_bytes(sizes.lora_rank) - shape.expert_bytes
            dev(train_dev)["param_bytes"] += (per_expert + wide) * on_gpu
        streamed = _stream_count(e, num)
        if streamed:
            stream["layers"] += 1
            stream["experts"] += streamed
            stream["bytes_per_pass"] += per_expert * streamed
            stream["largest_layer_bytes"] = max(stream["largest_layer_bytes"], per_expert * streamed)
        if on_gpu or streamed:
            shape = LayerShape(num, hidden, inter, k, act_bytes=2 if elt == 2 else 4)
            gpu_expert_act = max(gpu_expert_act, shape.gpu_act_bytes(tokens * k))
        n = 3 * num * sizes.lora_rank * (hidden + inter)
        lora["expert_params"] += n
        # experts of the layer on the GPU: its LoRA (and optimizer state) lives there too
        home = None
        if train_dev != "cpu":
            home = lora_home(
                torch.device(train_dev), on_gpu + streamed > 0, keep_on_cpu=e.lora_on_gpu is False
            )
        dev(train_dev if home is not None else "cpu")["lora_params"] += n
        if home is None and on_gpu + streamed and train_dev != "cpu":
            # LoRA kept on the CPU beside GPU experts: the forward's fp32 copy of those experts'
            # rows stays on the GPU until the layer's backward (``device_experts.py`` ``lora_on``)
            dev(train_dev)["param_bytes"] += n * min(on_gpu + streamed, num) // num * 4
    for name, m in model.named_modules():
        if "Linear" not in type(m).__name__ or "Embedding" in type(m).__name__ or "lm_head" in name:
            continue
        if any(name == e or name.startswith(f"{e}.") for e in experts):
            continue
        # a PEFT-wrapped model (placement: auto plans during a run): count each wrapped layer once,
        # not its base_layer and lora_A / lora_B again
        if ".lora_" in name or name.endswith(".base_layer"):
            continue
        n = sizes.lora_rank * (m.in_features + m.out_features)
        lora["peft_params"] += n
        dev(_device(plan.module_devices.get(name, "cuda")))["lora_params"] += n
    if stream["layers"]:  # the streamed experts' device buffers count with the weights
        stream["buffer_bytes"] = STREAM_BUFFERS * stream["largest_layer_bytes"]
        dev(train_dev)["param_bytes"] += stream["buffer_bytes"]
    for d in devices.values():
        d["train_state_bytes"] = d["lora_params"] * sizes.state_bytes

    # activations
    H = _text_config(model).hidden_size
    gpu_act = non_expert_activation_bytes(model, sizes, elt) + gpu_expert_act
    cpu_act = 0
    for e in plan.experts:
        num, _, inter = _expert_dims(model, e)
        if _resident_count(e) + _stream_count(e, num) >= num:
            continue  # every expert on the device: the CPU op never runs
        cpu_act += cpu_op_saved_bytes(tokens, k, H, inter, sizes.lora_rank, num)
    dev(train_dev)["activation_bytes"] += gpu_act
    dev("cpu")["activation_bytes"] += cpu_act
    if train_dev.startswith("cuda"):
        dev(train_dev)["runtime_bytes"] = (
            CUDA_OVERHEAD_BYTES + CUDA_GROWTH_BYTES if cuda_overhead_bytes is None else cuda_overhead_bytes
        )
    for d in devices.values():
        d["total_bytes"] = (
            d["param_bytes"] + d["train_state_bytes"] + d["activation_bytes"] + d["runtime_bytes"]
        )

    groups = _expert_groups(plan)
    for (d, in_layer), (layers, numel) in sorted(non_expert.items(), key=lambda kv: (not kv[0][1], kv[0][0])):
        what = (
            f"layers {_ranges(layers)} attention, router, norms, dense/shared MLPs"
            if in_layer
            else "outside the layers: embeddings, final norm, lm_head"
        )
        groups.append({"what": what, "device": d, "how": d, "params": numel})
    for g in groups:
        g.pop("layers", None)
    return {
        "rule": plan.source,
        "dtype": str(dtype).removeprefix("torch."),
        "expert_format": None if expert_format is None else expert_format.name,
        "sizes": vars(sizes),
        "groups": groups,
        "lora": lora,
        "devices": devices,
        "expert_bytes": expert_bytes,
        "stream": stream,
        "notes": plan.notes,
        "refusals": plan.refusals,
    }


def check_budgets(report: dict, gpu_gib: float | None, cpu_gib: float | None) -> None:
    """Add budget_bytes / fits per device (GPU budget per GPU); a missing budget is not checked."""
    for name, d in report["devices"].items():
        budget = cpu_gib if name == "cpu" else gpu_gib
        if budget is not None:
            d["budget_bytes"] = int(budget * GIB)
            d["fits"] = d["total_bytes"] <= d["budget_bytes"]


def format_report(report: dict, model_dir: str) -> str:
    """The human table of ``kt-ft rules plan``."""
    s = report["sizes"]
    lines = [
        f"{report['rule']} on {model_dir} ({report['dtype']} weights"
        + (f", routed experts kept {report['expert_format']}" if report.get("expert_format") else "")
        + f"; cutoff_len {s['cutoff_len']}, "
        f"batch {s['batch']}, lora_rank {s['lora_rank']})",
        "",
    ]
    width = max(len(g["what"]) for g in report["groups"])
    lines += [f"  {g['what']:<{width}}  {g['how']}" for g in report["groups"]]
    lora = report["lora"]
    lines += [
        "",
        f"  LoRA parameters: PEFT (lora_target all) {lora['peft_params']:,}, expert LoRA {lora['expert_params']:,}",
        "",
        f"  {'device':<8}{'weights':>12}{'LoRA+optim':>12}{'activations':>12}{'total':>12}{'budget':>12}  fits",
    ]
    for name, d in sorted(report["devices"].items(), key=lambda kv: kv[0] != "cpu"):
        budget = fmt_bytes(d["budget_bytes"]) if "budget_bytes" in d else "-"
        fits = {True: "yes", False: "NO"}.get(d.get("fits"), "-")
        sizes = (d["param_bytes"], d["train_state_bytes"], d["activation_bytes"], d["total_bytes"])
        lines.append(f"  {name:<8}" + "".join(f"{fmt_bytes(n):>12}" for n in sizes) + f"{budget:>12}  {fits}")
    lines.append(
        f"  (LoRA+optim: {s['state_bytes']} bytes per trainable parameter"
        + (", pure_bf16" if s["state_bytes"] == PURE_BF16_STATE_BYTES else "")
        + "; activations: estimate, kt_ft/plan/report.py;"
        " a GPU's total includes the CUDA runtime outside PyTorch's allocator)"
    )
    st = report.get("stream") or {}
    if st.get("layers"):
        lines.append(
            f"  streamed experts: {st['experts']:,} in {st['layers']} layers, {fmt_bytes(st['bytes_per_pass'])} "
            "copied per pass over the layers (a step makes two, forward and backward, less what the two "
            f"buffers still hold at each turn); device buffers {fmt_bytes(st['buffer_bytes'])} ({STREAM_BUFFERS} x the "
            f"largest layer's {fmt_bytes(st['largest_layer_bytes'])}, in the weights column); their RAM "
            "is page-locked"
        )
    lines += [f"note: {n}" for n in report["notes"]]
    lines += [f"refused at load in this version: {r}" for r in report["refusals"]]
    return "\n".join(lines)


def _expert_dims(model, placement) -> tuple[int, int, int]:
    """(E, H, I) of a placed routed-experts module, in the family's layout (gpt_oss: [E, H, 2I])."""
    gate_up = unwrap_peft(model.get_submodule(placement.name)).gate_up_proj
    if placement.spec is not None and placement.spec.transposed:
        num, hidden, two_i = gate_up.shape
    else:
        num, two_i, hidden = gate_up.shape
    return num, hidden, two_i // 2


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def check_gpu_cap(
    model: torch.nn.Module,
    plan: PlacementPlan,
    dtype: torch.dtype,
    sizes: TrainSizes,
    cap_gib: float,
    where: str,
) -> None:
    """Before any weight is read: the least the training GPU needs with ``plan`` (every
    ``placement: auto`` expert on the CPU, the other rules as written) must fit ``cap_gib``, else a
    KTConfigError that says what it takes and what would fit (``where``: the recipe, for the message)."""
    report = estimate(model, plan, dtype, sizes)
    train = next((d for name, d in report["devices"].items() if name.startswith("cuda")), None)
    if train is None or train["total_bytes"] <= cap_gib * GIB:
        return
    need = train["total_bytes"] / GIB
    raise KTConfigError(
        f"{where}: kt_gpu_memory={cap_gib:g} cannot hold this run: with every placement: auto expert on the CPU "
        f"the training GPU still needs {need:.1f} GiB (weights {fmt_bytes(train['param_bytes'])}, LoRA and optimizer "
        f"{fmt_bytes(train['train_state_bytes'])}, activations at cutoff_len {sizes.cutoff_len} x batch "
        f"{sizes.batch} {fmt_bytes(train['activation_bytes'])}, CUDA runtime {fmt_bytes(train['runtime_bytes'])}); "
        f"valid: kt_gpu_memory >= {need:.1f}, or a smaller cutoff_len / per_device_train_batch_size "
        "(`kt-ft rules plan --gpu-mem` shows the numbers)"
    )


HOST_HEADROOM = 0.9  # a run needing more than this share of the RAM available now gets a warning


def check_host_fit(
    report: dict, *, total: int, available: int, free: int, where: str, expert_bytes: int, quantized: bool
) -> str | None:
    """Before any weight is read: the run's host RAM need (``estimate``'s ``cpu`` device: the
    weights kept there, routed experts as stored, LoRA and optimizer state, the op's buffers)
    against this machine's (``total``, and ``available`` / ``free`` now, bytes as /proc/meminfo
    says). More than is available: a KTConfigError saying need, have and what would fit
    (``where``: the recipe, for the message; ``expert_bytes``: the routed experts' share of the
    need; ``quantized``: they are already kept quantized). Fits only by evicting page cache, or
    with little headroom: the warning line to log. Else None."""
    cpu = report["devices"].get("cpu")
    if cpu is None:
        return None
    need = cpu["total_bytes"]
    parts = (
        f"routed experts {fmt_bytes(expert_bytes)}, other weights {fmt_bytes(cpu['param_bytes'] - expert_bytes)}, "
        f"LoRA and optimizer {fmt_bytes(cpu['train_state_bytes'])}, activations and buffers "
        f"{fmt_bytes(cpu['activation_bytes'] + cpu['runtime_bytes'])}"
    )
    if need > available:
        ways = []
        if not quantized and expert_bytes:
            # INT8 keeps one byte a weight and a scale per row: about half the bf16 experts
            ways.append(
                f"the experts quantized (`kt-ft quantize --format int8 MODEL OUT`, about {fmt_bytes(need - expert_bytes // 2)}"
                " in all; int4: less)"
            )
        ways.append("a smaller cutoff_len, per_device_train_batch_size or chunk_size (the activations)")
        raise KTConfigError(
            f"{where}: this run needs {fmt_bytes(need)} of host RAM ({parts}); this machine has "
            f"{fmt_bytes(total)}, {fmt_bytes(available)} available now: it would be killed while loading. "
            f"What would fit: {'; '.join(ways)} (`kt-ft rules plan` shows the numbers)"
        )
    if need > free or need > HOST_HEADROOM * available:
        why = "only by evicting page cache" if need > free else "with little headroom"
        return (
            f"host RAM: this run needs {fmt_bytes(need)} ({parts}) of {fmt_bytes(available)} available now "
            f"({fmt_bytes(free)} free, {fmt_bytes(total)} in all): it fits {why}"
        )
    return None
