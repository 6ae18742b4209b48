"""The differentiable CPU expert operator.

Under reentrant gradient checkpointing (LLaMA-Factory's default) a layer runs twice: once
without grad, once again right before its backward. ``ExpertRunner.forward_and_stash`` keeps
the first pass's output and backward state, and the recompute takes them back when its
inputs are bit-identical, so the CPU expert forward runs once per layer per step.

``CPUExpertsFunction`` moves the layer input to the CPU, runs the backend chunk by chunk
(at most ``chunk_size`` tokens per call), and returns the output on the input's device.
From and to a GPU the copies go through pinned, reused host buffers (``transfer.STAGING``);
results go back without blocking the host.
With GPU-resident experts (``resident.py``) the caller first starts the input copies
(``ExpertRunner.prefetch``), then queues the resident experts' GPU work, then calls this op:
its wait for the inputs waits for those copies only, so the GPU computes the resident experts
while the CPU computes the rest (in the backward too: ``resident.py``). The output is then
float32 (``ExpertRunner.out_dtype``) so the two parts are summed before the one rounding to the
model's dtype.
Its backward returns the gradients of hidden_states and of the routing weights (so a
trainable router learns) and of the six expert-LoRA tensors, which autograd accumulates
into their ``.grad``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import torch

from kt_ft.backends.base import ExpertBackend, ExpertWeights, LoraTensors
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.runtime.transfer import STAGING

logger = get_logger(__name__)
_RUNNER_IDS = itertools.count()
_FREED = {"freed": 0, "kept": 0}  # layers whose host copy was freed / could not be (logged at the first)
GRAD_OUT_KEY = "grad_out"  # pinned buffer of the backward's incoming gradient (read before it returns)


def prefetch_grad_out(grad: torch.Tensor) -> None:
    """Start the device -> host copy of the gradient a CPU op's backward is about to get (the
    resident experts' backward does this before queuing its own kernels)."""
    STAGING.start_to_host(grad, GRAD_OUT_KEY)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (no-op when n is None or already set)."""
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def inputs_to_cpu(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: str
) -> tuple[torch.Tensor, ...]:
    """The op's inputs as detached CPU tensors: no copy when already there, else through the
    pinned buffers ``key``/x, /ids, /w (valid until that key's next use)."""
    return tuple(STAGING.to_host(t, f"{key}/{n}") for t, n in ((x, "x"), (ids, "ids"), (weights, "w")))


def _log_base_freed(backend: str, nbytes: int) -> None:
    _FREED["freed"] += 1
    if _FREED["freed"] == 1:
        logger.info(
            f"{backend} holds its own copy of the routed experts: kt-ft's host copy of each layer whose "
            f"experts all stay on the CPU is freed once {backend} has loaded it ({fmt_bytes(nbytes)} a layer)"
        )


def _log_base_kept(backend: str, err: Exception) -> None:
    if _FREED["kept"] == 0:
        logger.info(
            f"{backend} holds its own copy of the routed experts, but kt-ft's cannot be freed ({err}): both stay"
        )
    _FREED["kept"] += 1


class ExpertRunner:
    """One MoE layer's CPU expert state: backend, frozen weights, LoRA scaling, chunking, threads."""

    def __init__(
        self,
        backend: ExpertBackend,
        base: ExpertWeights,
        scaling: float,
        chunk_size: int,
        threads: int | None,
        prepare: bool = True,
    ) -> None:
        """``prepare``: False when the op will never run (every expert of the layer on the device),
        so a backend's checks and set-up (kt-kernel: bf16 weights only) do not apply."""
        self.backend = backend
        self.base = base
        self.scaling = scaling
        self.chunk_size = chunk_size
        self.threads = threads
        self.forward_calls = 0  # backend forwards run (a test checks checkpointing adds none)
        self.stash_hits = 0
        self.busy_s = 0.0  # wall time inside the backend (forward + backward), for benchmarks
        self.pairs_done = 0  # (token, slot) pairs the forwards computed (masked ones not counted)
        # this layer's pinned input buffers: a stash (and kt-kernel's context) keeps the inputs
        # until this layer's backward, so they cannot share buffers with other layers
        self.key = f"layer{next(_RUNNER_IDS)}"
        self._stash: tuple | None = None
        # dtype of the op's output on the caller's device; None: the input's (set to the
        # accumulation dtype when GPU-resident experts add their part to it)
        self.out_dtype: torch.dtype | None = None
        self.prepared = False
        # free ``base``'s storage once the backend holds its own copy (``holds_base_copy``): set by
        # ``moe/patch.py`` for layers whose experts all stay on the CPU under a fixed placement
        # (resident, streamed or re-planned experts read the host copy later)
        self.free_base_when_held = False
        self.base_freed = False
        if prepare:
            self.ensure_prepared()

    def ensure_prepared(self) -> None:
        """Set the backend up for this layer (once): before the op's first run."""
        if not self.prepared:
            self.backend.prepare(self.base, self.threads, self.chunk_size)
            self.prepared = True

    def input_key(self, first_pass: bool, needs_grad: bool) -> str:
        """Name of the pinned buffers the op's inputs go through: a reentrant recompute (a call
        that needs grad while a stash waits) uses shared "recompute" buffers, every other call
        (the stashing first pass included) the layer's own."""
        return "recompute" if not first_pass and needs_grad and self.has_stash() else self.key

    def prefetch(self, x, ids, weights, first_pass: bool, needs_grad: bool) -> None:
        """Start the device -> host copies of the op's inputs now (see the module doc) into the
        buffers the op will use (``input_key``: ``needs_grad`` as the op will see it); its
        ``inputs_to_cpu`` then only waits for them. No-op on the CPU."""
        key = self.input_key(first_pass, needs_grad)
        for t, n in ((x, "x"), (ids, "ids"), (weights, "w")):
            STAGING.start_to_host(t, f"{key}/{n}")

    def _out(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return STAGING.to_device(out, x.device, self.out_dtype or x.dtype, "out")

    def forward_and_stash(self, x, ids, weights, lora: LoraTensors) -> torch.Tensor:
        """First pass of a reentrant-checkpointed layer (grad disabled, training).

        Computes the output with its backward state and keeps both, so that the recompute
        pass before the backward reuses them instead of running the CPU experts again.
        One entry per layer: a layer is recomputed before the next forward of the same layer.
        """
        x_c, ids_c, w_c = inputs_to_cpu(x, ids, weights, self.key)
        out, saved = self.forward(x_c, ids_c, w_c, lora, needs_grad=True)
        self._stash = (x_c, ids_c, w_c, out, saved)
        return self._out(out, x)

    def has_stash(self) -> bool:
        return self._stash is not None

    def take_stash(self, x, ids, weights):
        """(out, saved) kept by forward_and_stash for exactly these (CPU) inputs, else None."""
        stash, self._stash = self._stash, None
        if stash is None:
            return None
        sx, sids, sw, out, saved = stash
        if sx.shape == x.shape and torch.equal(sx, x) and torch.equal(sids, ids) and torch.equal(sw, weights):
            self.stash_hits += 1
            return out, saved
        return None

    def forward(self, x, ids, weights, lora: LoraTensors, needs_grad: bool):
        """x [T, H], ids [T, k], weights [T, k], all on the CPU -> (out [T, H] float32, ctxs)."""
        self.forward_calls += 1
        self.pairs_done += int((ids >= 0).sum())  # the CPU ids: no device sync
        t0 = time.perf_counter()
        outs, ctxs = [], []
        with torch_threads(self.threads):
            for start in range(0, x.shape[0], self.chunk_size):
                end = start + self.chunk_size
                out, ctx = self.backend.forward(
                    x[start:end],
                    ids[start:end],
                    weights[start:end],
                    self.base,
                    lora,
                    self.scaling,
                    needs_grad,
                )
                outs.append(out)
                ctxs.append(ctx)
        self.busy_s += time.perf_counter() - t0
        if self.free_base_when_held and not self.base_freed and self.backend.holds_base_copy():
            self._free_base()
        return (outs[0] if len(outs) == 1 else torch.cat(outs)), ctxs

    def _free_base(self) -> None:
        """Release the host storage of the layer's base weights (HF's parameters share it): their
        shapes stay, so parameter counts and state-dict names do not change, but any read fails."""
        b = self.base
        tensors = [t for t in (b.gate_up, b.down, b.gate_up_bias, b.down_bias) if t is not None]
        nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
        try:
            for t in tensors:
                t.untyped_storage().resize_(0)
        except RuntimeError as e:  # storage not owned by torch's allocator (shared memory, a mapping)
            self.free_base_when_held = False
            _log_base_kept(self.backend.name, e)
            return
        self.base_freed = True
        _log_base_freed(self.backend.name, nbytes)

    def backward(self, ctxs, grad_out: torch.Tensor):
        t0 = time.perf_counter()
        gxs, gws, lora_grads = [], [], None
        with torch_threads(self.threads):
            for i, ctx in enumerate(ctxs):
                start = i * self.chunk_size
                gx, gw, gl = self.backend.backward(ctx, grad_out[start : start + self.chunk_size])
                gxs.append(gx)
                gws.append(gw)
                lora_grads = (
                    gl if lora_grads is None else LoraTensors(*(a.add_(b) for a, b in zip(lora_grads, gl)))
                )
            self.backend.layer_backward_done()
        cat = (lambda ts: ts[0]) if len(gxs) == 1 else torch.cat
        self.busy_s += time.perf_counter() - t0
        return cat(gxs), cat(gws), lora_grads


class CPUExpertsFunction(torch.autograd.Function):
    """apply(x [T, H], ids [T, k], weights [T, k], runner, *six LoRA tensors) -> [T, H] like x."""

    @staticmethod
    def forward(ctx, x, ids, weights, runner: ExpertRunner, *lora):
        needs_grad = any(ctx.needs_input_grad)
        hit = None
        if needs_grad and runner.has_stash():
            # the recompute's inputs go to a shared buffer: the stash still holds this layer's own
            hit = runner.take_stash(*inputs_to_cpu(x, ids, weights, runner.input_key(False, True)))
        if hit is None:
            x_c, ids_c, w_c = inputs_to_cpu(x, ids, weights, runner.key)
            hit = runner.forward(x_c, ids_c, w_c, LoraTensors(*lora), needs_grad)
        out, saved = hit
        ctx.runner = runner
        ctx.saved = saved
        ctx.x_meta = (x.device, x.dtype)
        ctx.w_meta = (weights.device, weights.dtype)
        ctx.lora_dtypes = [t.dtype for t in lora]
        return runner._out(out, x)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.saved is None or any(c is None for c in ctx.saved):
            raise RuntimeError("kt-ft: CPU expert backward called without saved forward state")
        # grad_out's buffer is shared: the backends read it before they return
        grad_x, grad_w, lora_grads = ctx.runner.backward(ctx.saved, STAGING.to_host(grad_out, GRAD_OUT_KEY))
        dev, dt = ctx.x_meta
        wdev, wdt = ctx.w_meta
        lg = [g.to(d) for g, d in zip(lora_grads, ctx.lora_dtypes)]
        gx = STAGING.to_device(grad_x, dev, dt, "grad_x")
        return gx, None, STAGING.to_device(grad_w, wdev, wdt, "grad_w"), None, *lg
