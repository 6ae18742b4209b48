"""kt-kernel backend: kt-kernel's AMX/AVX512-BF16 SFT MoE kernel (``AMXBF16_SFT``).

The kernel is stateful: one ``KTMoEWrapper`` per layer holds its own repacked copy of the
layer's weights and the activations of the last forward with ``save_for_backward``. So:

* the wrapper is built on the first call (it needs top-k and the LoRA rank), from the
  fused HF weights split into gate/up/down;
* the six LoRA tensors are mirrored into bf16 buffers the kernel points at; they are
  refreshed whenever the fp32 master parameters change (tracked by their version counter);
* a context remembers which saved forward it belongs to; if another saved forward of the
  layer ran since (more than one chunk, or a forward without its backward), the backward
  first re-runs that chunk's forward. The runner walks chunks backwards, so in the common
  case (one chunk) nothing is recomputed.

Host memory. The kernel copies the weights into its forward layout at load and, by default, keeps
a second, transposed copy per layer for the backward: with kt-ft's own copy, three copies of the
routed experts in RAM (91-93 GiB for 27 GiB of experts on the GPU machine). So:

* ``share_backward_bb`` is set: the backward's transposed weights come from one pool shared by
  every layer, repacked from the forward copy when a layer's backward needs them (kt-kernel's own
  SFT path's default). To keep the repack off the critical path, a layer's backward done starts
  the repack of the layer whose backward comes next (``chain_backward_order``; kt-kernel runs it
  on a thread of its own while the GPU works), and any other wrapper call waits for it first (the
  repack uses the kernel's thread pool). A wrong guess costs time, not correctness: a backward
  that finds the pool holding another layer repacks its own first.
* once the kernel has loaded a layer, ``holds_base_copy`` says so and the runner frees kt-ft's
  copy where nothing else reads it (``ExpertRunner.free_base_when_held``).
* the activations a forward saves for its backward (~0.2 GiB a DeepSeek-V2-Lite layer at 2,048
  tokens) stay per layer: a layer's backward comes after every layer's first-pass forward (its
  checkpointed recompute reuses that forward, ``ExpertRunner.forward_and_stash``), and kt-kernel's
  one pool for every layer (``share_cache_pool``) would hold only the last one's: measured, every
  layer but the last got wrong gradients. ``KT_FT_KT_KERNEL_SHARED_CACHE=1`` takes the pool anyway
  and makes it right the way kt-kernel's own SFT path does: the saved-forward tokens are counted
  across layers, so a backward whose forward is no longer the pool's runs it again first (one more
  CPU forward a layer and micro-batch, for ~0.16 GiB a layer less host memory).

Measured on a 2-core AVX512-BF16 CPU (kt-kernel 0.7.2's avx512_bf16 build), 3 layers of 16
DeepSeek-V2-Lite-shaped experts (795 MiB): over kt-ft's copy, the wrappers held 1,614 MiB loaded,
820 with the shared pool, 29 once kt-ft's copy was freed; the pool added 336 MiB at the first
backward; outputs and gradients equal to those without the pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kt_ft.backends.base import ExpertBackend, ExpertWeights, LoraTensors, lora_key
from kt_ft.base.errors import KTConfigError
from kt_ft.base.settings import enabled

BF16 = torch.bfloat16
_LAYER_IDS = itertools.count()
# saved forwards of every layer, counted when they share kt-kernel's one pool of saved activations
_SHARED_LIVE = [0]
# the backend whose backward repack runs on kt-kernel's repack thread now (None: none)
_REPACKING: KTKernelBackend | None = None


def _wait_for_repack(caller: KTKernelBackend) -> None:
    """Wait for another layer's backward repack in flight: it uses the kernel's thread pool (a
    wrapper waits for its own repack itself)."""
    global _REPACKING
    if _REPACKING is not None and _REPACKING is not caller:
        if _REPACKING._wrapper is not None:
            _REPACKING._wrapper.wait_backward_repack()
        _REPACKING = None


def chain_backward_order(backends: list[ExpertBackend]) -> int:
    """Link the kt-kernel backends of a model's CPU layers, given in forward order: each one's
    backward done starts the backward repack of the one before it (the next in backward order).
    Returns how many links were made."""
    kt = [b for b in backends if isinstance(b, KTKernelBackend)]
    for prev, cur in zip(kt, kt[1:]):
        cur._next_backward = prev
    return max(len(kt) - 1, 0)


def kt_kernel_unavailable_reason() -> str | None:
    try:
        import kt_kernel
    except ImportError as e:
        return f"the kt-kernel package is not importable ({e}); pip install 'kt-ft[kt-kernel]'"
    variant = getattr(kt_kernel, "__cpu_variant__", "unknown")
    if variant not in ("amx", "avx512_bf16"):
        return (
            f"kt-kernel loaded its '{variant}' build, which has no BF16 training kernel "
            "(AMXBF16_SFT needs a CPU with AMX or AVX512-BF16)"
        )
    return None


@dataclass
class _Ctx:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    token: int


class KTKernelBackend(ExpertBackend):
    name = "kt-kernel"

    def __init__(self) -> None:
        self._wrapper = None
        self._key = None
        self._lora_bf16: LoraTensors | None = None
        self._grads: LoraTensors | None = None
        self._lora_seen: tuple | None = None
        # the saved forward the kernel holds: this layer's own counter, or with one pool of saved
        # activations for every layer (KT_FT_KT_KERNEL_SHARED_CACHE) the process-wide one
        self._shared_cache = enabled("KT_FT_KT_KERNEL_SHARED_CACHE")
        self._live = _SHARED_LIVE if self._shared_cache else [0]
        self._threads = 1
        self._max_tokens = 4096
        self._base: ExpertWeights | None = None
        self._next_backward: KTKernelBackend | None = None  # chain_backward_order

    @classmethod
    def unavailable_reason(cls, dtype: torch.dtype | None = None, spec=None) -> str | None:
        if spec is not None and not spec.is_default:
            return (
                f"kt-kernel's AMXBF16_SFT kernel computes silu(gate) * up on [E, 2I, H] weights only, "
                f"these experts are {spec.describe()}: use kt_backend torch"
            )
        if dtype is not None and dtype != BF16:
            return f"it needs bf16 expert weights, the model's are {dtype} (bf16: true in the recipe)"
        return kt_kernel_unavailable_reason()

    def prepare(self, base: ExpertWeights, threads: int | None = None, max_tokens: int = 4096) -> None:
        if not base.is_plain:
            raise KTConfigError(f"kt_backend='kt-kernel': {self.unavailable_reason(None, base.spec)}")
        if base.gate_up.dtype != BF16:
            raise KTConfigError(
                f"kt_backend='kt-kernel' needs bf16 expert weights, the model's are {base.gate_up.dtype} "
                "(set bf16: true in the recipe, or use kt_backend: torch)"
            )
        self._base = base
        self._threads = threads or torch.get_num_threads()
        self._max_tokens = max_tokens

    def _ensure_wrapper(self, k: int, lora: LoraTensors, scaling: float) -> None:
        rank = lora.gate_a.shape[1]
        key = (k, rank, scaling)
        if self._wrapper is not None:
            if key != self._key:
                raise RuntimeError(
                    f"kt-kernel wrapper built for (top_k, rank, scaling)={self._key}, called with {key}"
                )
            return
        from kt_kernel import KTMoEWrapper

        base = self._base
        e, inter, hidden = base.num_experts, base.intermediate, base.hidden
        wrapper = KTMoEWrapper(
            layer_idx=next(_LAYER_IDS),
            num_experts=e,
            num_experts_per_tok=k,
            hidden_size=hidden,
            moe_intermediate_size=inter,
            gpu_experts_mask=None,  # inference-only; SFT mode takes num_gpu_experts
            num_gpu_experts=0,
            cpuinfer_threads=self._threads,
            threadpool_count=1,
            weight_path="",
            chunked_prefill_size=self._max_tokens,
            mode="sft",
            method="AMXBF16_SFT",
            lora_rank=rank,
            lora_alpha=scaling * rank,  # the kernel scales by lora_alpha / lora_rank
        )
        # the backward's transposed weights from one pool for every layer, not a copy per layer
        # (module doc); read by load_weights
        wrapper.share_backward_bb = True
        # one pool of saved activations for every layer only with the tokens counted across layers
        # (module doc: ``_live``)
        wrapper.share_cache_pool = self._shared_cache
        wrapper.load_weights_from_tensors(
            base.gate_up[:, :inter], base.gate_up[:, inter:], base.down, torch.arange(e, dtype=torch.int64)
        )
        self._lora_bf16 = LoraTensors(*(torch.empty(t.shape, dtype=BF16) for t in lora))
        self._grads = LoraTensors(*(torch.zeros(t.shape, dtype=BF16) for t in lora))
        with torch.no_grad():
            for dst, src in zip(self._lora_bf16, lora):
                dst.copy_(src)
        wrapper.init_lora_weights(*self._lora_bf16, *self._grads)
        self._lora_seen = self._lora_state(lora)
        self._wrapper, self._key = wrapper, key
        self._base = None  # the kernel holds its own copy now: kt-ft's may be freed (holds_base_copy)

    def holds_base_copy(self) -> bool:
        return self._wrapper is not None

    def layer_backward_done(self) -> None:
        global _REPACKING
        nxt = self._next_backward
        if nxt is not None and nxt._wrapper is not None:
            _wait_for_repack(nxt)
            nxt._wrapper.submit_backward_repack()
            _REPACKING = nxt

    @staticmethod
    def _lora_state(lora: LoraTensors) -> tuple:
        return lora_key(lora)

    def _sync_lora(self, lora: LoraTensors) -> None:
        state = self._lora_state(lora)
        if state != self._lora_seen:
            with torch.no_grad():
                for dst, src in zip(self._lora_bf16, lora):
                    dst.copy_(src)
            self._wrapper.update_lora_weights()
            self._lora_seen = state

    def _forward(self, x, ids, weights, save: bool) -> torch.Tensor:
        _wait_for_repack(self)
        y = self._wrapper.forward(
            x.to(BF16).contiguous(),
            ids.to(torch.int64).contiguous(),
            weights.float().contiguous(),
            save_for_backward=save,
        )
        if save:
            self._live[0] += 1
        return y

    def forward(self, x, ids, weights, base, lora, scaling, needs_grad):
        self._ensure_wrapper(ids.shape[1], lora, scaling)
        self._sync_lora(lora)
        y = self._forward(x, ids, weights, needs_grad)
        if not needs_grad:
            return y.float(), None
        return y.float(), _Ctx(x, ids, weights, self._live[0])

    def backward(self, ctx: _Ctx, grad_out: torch.Tensor):
        if ctx.token != self._live[0]:  # another saved forward ran since: redo this chunk's
            self._forward(ctx.x, ctx.ids, ctx.weights, True)
        for g in self._grads:
            g.zero_()
        _wait_for_repack(self)
        grad_x, grad_w = self._wrapper.backward(grad_out.to(BF16).contiguous())
        grad_w = grad_w.float().view(ctx.weights.shape)
        if bool((ctx.ids < 0).any()):
            # masked pairs (experts on the GPU, id -1, weight 0): the SFT kernel skips them as its
            # inference path does (test_kt_kernel.py::test_kt_kernel_skips_masked_pairs, on the GPU
            # machine: the AMX build cannot run on the CPU-only CI); their weight gradients are zeroed
            # here all the same.
            grad_w = grad_w.masked_fill(ctx.ids < 0, 0)
        return (
            grad_x.float(),
            grad_w,
            LoraTensors(*(g.float() for g in self._grads)),
        )
