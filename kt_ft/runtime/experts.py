"""KTExperts: the module that replaces a transformers v5 fused experts module.

HF's router stays where it is and still calls ``experts(hidden_states, top_k_index,
top_k_weights)``; this module answers that call on the CPU through ``CPUExpertsFunction``.
It keeps HF's own frozen ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] parameter
objects (gpt_oss: [E, H, 2I] / [E, I, H] and the ``gate_up_proj_bias`` / ``down_proj_bias``
parameters; the ``spec`` says the layout) -- no copy, no reorder, same state-dict names,
counted in LLaMA-Factory's parameter total -- and adds the six expert-LoRA parameters of the
fused layout (per-projection shapes whatever the base layout). Its parameter names carry no
``lora_`` so PEFT never saves, loads or freezes them: kt-ft owns them.

The module is pinned to the CPU: ``.to(cuda)`` / ``.cuda()`` on the whole model (as the HF
Trainer does) leaves it where it is, so the routed experts never reach the GPU -- except the
rule's ``gpu_experts``, whose base weights ``resident.py`` copies once to the training device
(plain attributes, not parameters or buffers), and its ``stream`` experts, whose base weights
``streamed.py`` copies into a reusable device buffer each time the layer runs; both are
computed there by ``device_experts.py``, the rest by the CPU op. The six expert-LoRA parameters
of a layer with such experts live on the training GPU (``lora_device``, ``patch.py``
``lora_home``), put there at construction; whole-model moves leave them too.
"""

from __future__ import annotations

import torch
from torch import nn

from kt_ft.backends.base import (
    DEFAULT_SPEC,
    ExpertBackend,
    ExpertSpec,
    ExpertWeights,
    LoraTensors,
    accum_dtype,
    lora_key,
    watch_optimizer_steps,
)
from kt_ft.backends.quant_weights import is_quantized
from kt_ft.base.errors import KTConfigError
from kt_ft.formats.lora_layout import LORA_NAMES, init_expert_lora
from kt_ft.runtime.beside import SharedBeside
from kt_ft.runtime.device_experts import DeviceExperts, count_ids
from kt_ft.runtime.function import CPUExpertsFunction, ExpertRunner
from kt_ft.runtime.graphed import LayerGraphs
from kt_ft.runtime.resident import ResidentExperts
from kt_ft.runtime.streamed import StreamedExperts, StreamScheduler
from kt_ft.runtime.transfer import STAGING

CPU = torch.device("cpu")


class KTExperts(nn.Module):
    """Routed experts of one MoE layer, computed on the CPU, with trainable expert LoRA.

    forward(hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]
    in hidden_states' dtype and device.
    """

    def __init__(
        self,
        hf_experts: nn.Module,
        *,  # the rest by name: rank / scaling / chunk_size / threads are all numbers
        layer_idx: int,
        rank: int,
        scaling: float,
        backend: ExpertBackend,
        chunk_size: int,
        threads: int | None,
        lora_dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
        spec: ExpertSpec = DEFAULT_SPEC,
        resident_ids: tuple[int, ...] = (),
        resident_device: torch.device | None = None,
        stream_ids: tuple[int, ...] = (),
        scheduler: StreamScheduler | None = None,
        lora_device: torch.device | None = None,
    ) -> None:
        """``resident_ids``: experts computed on the training device (``resident.py``), copied there
        at the first forward (to hidden_states' device), or at once to ``resident_device`` if given.
        ``stream_ids``: experts streamed to that device each time the layer runs (``streamed.py``)
        through ``scheduler``, the model's one (a scheduler of its own when None).
        ``lora_device``: where the six expert-LoRA parameters live (None: the CPU); the training GPU
        for a layer with resident or streamed experts (``placement/homes.py`` ``lora_home`` says why),
        the CPU op then reading a host mirror (``host_lora``)."""
        super().__init__()
        watch_optimizer_steps()  # the LoRA caches' keys (``kernels/base.py`` ``lora_key``)
        names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
        for name in names:  # HF's frozen parameters, kept under their names (biases: gpt_oss only)
            p = getattr(hf_experts, name, None)
            if p is None:
                continue
            if is_quantized(p):  # kept quantized in RAM (``kt_ft.backends.quant``): a plain attribute, frozen
                setattr(self, name, p)
                continue
            p.requires_grad_(False)
            if p.device != CPU:  # only when a model was loaded onto a GPU first
                p.data = p.data.to(CPU)
            setattr(self, name, p)
        base = ExpertWeights(*(_base_tensor(getattr(self, n, None)) for n in names), spec=spec)
        _check_quantized_layout(base, layer_idx)
        self.layer_idx = layer_idx
        self.num_experts, self.hidden_dim, self.intermediate_dim = (
            base.num_experts,
            base.hidden,
            base.intermediate,
        )
        self.spec = spec
        self.rank = rank
        self.scaling = scaling
        for name, t in init_expert_lora(
            self.num_experts, self.hidden_dim, self.intermediate_dim, rank, lora_dtype, generator
        ).items():
            setattr(self, name, nn.Parameter(t if lora_device is None else t.to(lora_device)))
        self.lora_on_device = lora_device is not None
        self._host_lora: list[torch.Tensor] | None = None  # the CPU op's mirror (``_LoraToHost``)
        self._host_key: tuple | None = None
        self.host_lora_copies = 0  # refreshes of that mirror (a test counts them)
        on_device = len(set(resident_ids) | set(stream_ids))
        self.runner = ExpertRunner(
            backend, base, scaling, chunk_size, threads, prepare=on_device < base.num_experts
        )
        self.scheduler = scheduler  # the model's stream scheduler (made on first use when None)
        self.resident: ResidentExperts | None = None
        self.streamed: StreamedExperts | None = None
        self.device_experts: DeviceExperts | None = None
        # the block's shared experts, started beside the CPU op (``beside.py``; set by the patch)
        self.beside: SharedBeside | None = None
        # routing counts per expert [E] int64 on the router's device, accumulated while training
        # when ``count_routing`` is set (placement: auto's re-planning reads and resets them)
        self.count_routing = False
        # True while ``placement/non_expert.py`` times the model without its routed experts: the
        # call returns zeros and touches no state (no CPU op, no stream, no routing counts)
        self.skip_routed = False
        self.routing_counts: torch.Tensor | None = None
        self.set_placement(resident_ids, stream_ids, resident_device)

    def set_placement(self, resident_ids=(), stream_ids=(), device: torch.device | None = None) -> None:
        """Experts ``resident_ids`` GPU-resident, ``stream_ids`` streamed, the rest on the CPU.

        Resident weights are copied to ``device`` now, else to the input's device at the next
        forward (the previous resident ones' device if there were). Call between steps (the
        re-planner does): a layer's first pass, recompute and backward must see one split."""
        res_ids, st_ids = tuple(sorted(resident_ids)), tuple(sorted(stream_ids))
        if (res_ids or st_ids) and self.runner.base_freed:
            raise RuntimeError(
                f"layer {self.layer_idx}: experts {list(res_ids + st_ids)} cannot move to the GPU: the host copy "
                f"of this layer's experts was freed once {self.runner.backend.name} held its own "
                "(ExpertRunner.free_base_when_held, set only for layers whose experts all stay on the CPU)"
            )
        old_res, old_st = self.resident, self.streamed
        base = self.runner.base
        if old_res is None or old_res.ids != res_ids:
            if device is None and old_res is not None:
                device = old_res.device
            # the old resident weights go before the new ones are copied: under kt_gpu_memory the
            # allocator has no room for two copies of a layer (``placement/runtime.py``)
            self.device_experts = self.resident = old_res = None
            rank = self.lora_tensors().gate_a.shape[1]
            self.resident = ResidentExperts(base, res_ids, lora_rank=rank) if res_ids else None
        if (old_st.ids if old_st is not None else ()) != st_ids:
            if old_st is not None:
                self.scheduler.unregister(old_st)
            if st_ids and self.scheduler is None:
                self.scheduler = StreamScheduler()
            self.streamed = StreamedExperts(self.layer_idx, base, st_ids, self.scheduler) if st_ids else None
        if self.resident is not None and device is not None:
            self.resident.to_device(device)
        dev = None
        if self.resident is not None or self.streamed is not None:
            dev = DeviceExperts(base, self.resident, self.streamed)
            if not dev.cpu_follows and dev.streamed is None:  # every expert resident: graphs may pay
                dev.graphs = LayerGraphs(dev, self.scaling)
        self.device_experts = dev
        # the CPU op's output is summed with the device part in float32 when there is one
        self.runner.out_dtype = accum_dtype(base.gate_up.dtype) if dev is not None else None
        if dev is None or dev.cpu_follows:
            self.runner.ensure_prepared()

    def set_resident(self, ids, device: torch.device | None = None) -> None:
        """Make experts ``ids`` the resident ones (streamed ones among them stop streaming)."""
        streamed = self.streamed.ids if self.streamed is not None else ()
        resident = set(ids)
        self.set_placement(ids, [e for e in streamed if e not in resident], device)

    def base_nbytes(self) -> int:
        """Bytes of the frozen routed-expert weights held in RAM (as stored when kept quantized)."""
        quant = [
            getattr(self, n) for n in ("gate_up_proj", "down_proj") if is_quantized(getattr(self, n, None))
        ]
        return sum(q.nbytes() for q in quant) + sum(
            p.numel() * p.element_size() for p in self.base_parameters()
        )

    def lora_tensors(self) -> LoraTensors:
        return LoraTensors(*(getattr(self, n) for n in LORA_NAMES))

    def base_parameters(self) -> list[nn.Parameter]:
        """HF's frozen routed-expert tensors held here (weights, and biases where the family has them)."""
        return [p for n, p in self.named_parameters(recurse=False) if n.endswith(("_proj", "_proj_bias"))]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if torch.is_inference_mode_enabled():
            # Never in inference mode: the op's scratch buffers, saved-tensor sets, pinned staging
            # and LoRA caches outlive the call, and a tensor created in inference mode can be
            # neither written nor saved for backward outside it. LLaMA-Factory's chat engine
            # answers `chat` under inference_mode but `stream_chat` (the CLI, the api's streams)
            # in a thread under plain no_grad: one after the other in one process would fail.
            # The inference tensors coming in are only read, which plain mode allows.
            with torch.inference_mode(False), torch.no_grad():
                return self._forward(hidden_states, top_k_index, top_k_weights)
        return self._forward(hidden_states, top_k_index, top_k_weights)

    def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.skip_routed:
            if self.beside is not None:  # the block computes its shared branch itself, as usual
                self.beside.skip()
            return torch.zeros_like(hidden_states)
        lora = self.lora_tensors()
        if self.count_routing and self.training:
            # on the router's device, no host sync; both passes of a checkpointed layer count,
            # which scales every expert alike (the re-planner compares distributions)
            c = count_ids(top_k_index, self.num_experts)
            self.routing_counts = c if self.routing_counts is None else self.routing_counts + c
        # first pass of a reentrant-checkpointed layer: keep the CPU result for its recompute
        first_pass = not torch.is_grad_enabled() and self.training and any(p.requires_grad for p in lora)
        dev, beside = self.device_experts, self.beside
        if dev is not None:
            # streamed experts: this layer's copy (and the next layer's prefetch) queued first
            dev.begin(hidden_states.device)
            weights = top_k_weights
            if not dev.cpu_follows:  # every expert on the device: no CPU op call at all
                if beside is not None:  # nothing to overlap: the block computes its shared branch itself
                    beside.skip()
                local = dev.local_ids(top_k_index)
                out = dev.start(hidden_states, local, weights, lora, self.scaling, self.lora_on_device)()
                return out.to(hidden_states.dtype)
            local, top_k_index, top_k_weights = dev.split(top_k_index, weights)
        # the CPU op reads CPU LoRA: a host mirror when the parameters live on the device
        cpu_lora = LoraTensors(*_LoraToHost.apply(self, *lora)) if self.lora_on_device else lora
        if dev is not None or beside is not None:
            # order matters on a GPU: start the CPU op's input copies, then queue the GPU work
            # (shared experts, device experts), then block in the CPU op -- the GPU computes
            # meanwhile; that work joins the graph after the CPU op so the backward keeps the order
            needs_grad = torch.is_grad_enabled() and any(
                t.requires_grad for t in (hidden_states, top_k_weights, *lora)
            )  # what CPUExpertsFunction will see (ctx.needs_input_grad)
            self.runner.prefetch(hidden_states, top_k_index, top_k_weights, first_pass, needs_grad)
        if beside is not None:
            beside.start(hidden_states)
        if dev is not None:
            finish = dev.start(hidden_states, local, weights, lora, self.scaling, self.lora_on_device)
        if first_pass:
            out = self.runner.forward_and_stash(hidden_states, top_k_index, top_k_weights, cpu_lora)
        else:
            out = CPUExpertsFunction.apply(hidden_states, top_k_index, top_k_weights, self.runner, *cpu_lora)
        if dev is None:
            return out
        return (out + finish()).to(hidden_states.dtype)  # both float32: one rounding

    def host_lora(self, params: LoraTensors) -> list[torch.Tensor]:
        """The six device-resident LoRA ``params`` on the CPU for the CPU op: one persistent mirror,
        refreshed in place (so backends that key caches on storage and version see the change) when
        the parameters changed, reused by a checkpointed recompute."""
        key = lora_key(params)
        if self._host_lora is None:  # pinned: the copy from the GPU runs at the link's full rate
            pin = params[0].device.type == "cuda"
            self._host_lora = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params]
        if self._host_key != key:
            for h, p in zip(self._host_lora, params):
                h.copy_(p.detach())
            self._host_key = key
            self.host_lora_copies += 1
        return self._host_lora

    def _apply(self, fn, recurse=True):
        # Pinned to the CPU: device and dtype moves of the whole model skip the routed experts.
        return self

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, rank={self.rank}, scaling={self.scaling:g}, "
            f"{'' if self.spec.is_default else f'experts={self.spec.describe()}, '}"
            f"backend={self.runner.backend.name}, threads={self.runner.threads}, device=cpu"
            + (f", lora_device={self.gate_a.device}" if self.lora_on_device else "")
            + (f", resident={list(self.resident.ids)}" if self.resident is not None else "")
            + (f", streamed={list(self.streamed.ids)}" if self.streamed is not None else "")
        )

    def stream_stats(self) -> dict | None:
        """This layer's streaming counters (copies, bytes_streamed, hits, prefetch_hits, copies_by),
        None when it streams nothing."""
        return self.streamed.stats() if self.streamed is not None else None


def _check_quantized_layout(base: ExpertWeights, layer_idx: int) -> None:
    """Weights kept quantized must stand in the layout the spec reads (gpt_oss's [E, H, 2I] and
    [E, I, H]: ``QuantizedExperts.transposed``), else the products would read them the wrong way."""
    for name, t in (("gate_up_proj", base.gate_up), ("down_proj", base.down)):
        if is_quantized(t) and t.transposed != base.spec.transposed:
            raise KTConfigError(
                f"layer {layer_idx}: {name} kept {t.fmt.name} stands for {list(t.shape)} "
                f"({'transposed' if t.transposed else 'row-major'}), but the experts compute "
                f"{base.spec.describe()}; `kt-ft dequantize` the checkpoint to bf16"
            )


def _base_tensor(p):
    """A base weight for ``ExpertWeights``: a parameter's tensor, or a ``QuantizedExperts`` as is."""
    if p is None or is_quantized(p):
        return p
    return p.data


class _LoraToHost(torch.autograd.Function):
    """apply(kt_experts, *six device LoRA params) -> their CPU mirror (``KTExperts.host_lora``);
    backward: the CPU op's LoRA gradients back to the parameters' device.

    Only the CPU experts' rows go back: the CPU op's gradient is zero on every other row (their
    pairs are masked), so a layer with c of E experts on the CPU sends c/E of the bytes, through
    the pinned staging buffers (``transfer.py``: non-blocking; a pageable copy of the full
    [E, ...] fp32 gradients took ~14 ms a layer on the GPU machine); the rest is zeros there."""

    @staticmethod
    def forward(ctx, kt, *params):
        ctx.device = params[0].device
        dev = kt.device_experts
        ctx.dev = dev if dev is not None and dev.cpu_follows else None  # None: every row goes back
        return tuple(t.detach() for t in kt.host_lora(LoraTensors(*params)))

    @staticmethod
    def backward(ctx, *grads):
        dev, out = ctx.dev, []
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
            elif dev is None:
                out.append(STAGING.to_device(g, ctx.device, g.dtype, f"lora_grad_{i}"))
            else:
                rows = STAGING.to_device(
                    g.index_select(0, dev.cpu_ids()), ctx.device, g.dtype, f"lora_grad_{i}"
                )
                full = torch.zeros(g.shape, dtype=g.dtype, device=ctx.device)
                out.append(full.index_copy_(0, dev.cpu_ids(ctx.device), rows))
        return None, *out
