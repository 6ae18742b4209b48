"""CUDA graphs of a resident layer's expert work: one replay instead of ~60 kernel launches a pass.

With every routed expert of a layer resident on the GPU, a LLaMA-Factory step is bound by host
time, not the GPU's: each of the ~20 kernels of ``FusedGroupedExperts``'s forward and ~35 of its
backward costs its launch and the Python around it (a profiled DeepSeek-V2-Lite step: 128 ms of a
micro-batch in the experts' host time, 3x transformers' own experts, which have no expert LoRA).
The work itself has no host sync and fixed shapes for a fixed token count (the routing stays on
the device: ``torch._grouped_mm``'s offsets), so it is captured once per token-count bucket and
replayed. A bucket (``bucket_tokens``) is the token count rounded up to one of 4 steps per power of
two (at most 25% more rows; 2,048 stays 2,048): a call of fewer tokens fills the rest with padding
rows -- zero inputs, routing weight 0, zero incoming gradient, so they add exactly nothing to the
output or any gradient, only GPU time. So micro-batches of varied lengths (SFT data without packing)
replay a handful of graphs.

- forward without grad (the first pass of a reentrant-checkpointed layer, evaluation): copy the
  inputs into static buffers, replay, clone the output;
- forward with grad (the checkpointed recompute): the same, and the tensors the backward reads stay
  in the shared buffers, owned by this call until its backward runs;
- backward: copy the incoming gradient in, replay, clone the gradients out.

Memory: the layers of one shape (``Workspace``) share the static buffers and one graph memory pool
(the graphs' scratch), about one layer's expert activations. A forward with grad whose buffers are
still owned by another call's pending backward (no checkpointing: every forward before any
backward) first copies that call's tensors out for it ("evicts"; its backward then runs eagerly),
and from then on the workspace runs forwards with grad eagerly, as a run without checkpointing
holds every layer's tensors anyway. Under saved-tensor hooks (non-reentrant checkpointing, which
re-creates saved tensors through them) forwards with grad run eagerly: nothing here bypasses them.

Only where it is safe and pays: CUDA, every expert of the layer resident, dense weights, the
expert LoRA on the GPU, no ``kt_gpu_memory`` cap (the graphs' pool is memory the plan does not
count), room on the GPU, at most ``MAX_BUCKETS`` buckets a layer (micro-batches in others run
eagerly), unless ``KT_FT_CUDA_GRAPHS=0``. Every refusal or failure
falls back to the eager path (``device_experts.py``), with one log line; the numbers are the same
kernels' in the same order.

Here: when a layer replays (``LayerGraphs``), its captures and replays, and the autograd node of a
replayed forward with grad. The buckets and padding rows are ``graph_buckets.py``'s; the shared
buffers and pool (``Workspace``) and the capture itself ``graph_capture.py``'s.
"""

from __future__ import annotations

import torch

from kt_ft.backends.base import lora_key
from kt_ft.backends.grouped_device import FusedMeta, fused_backward, fused_forward, stack_lora, weight_tensors
from kt_ft.backends.grouped_products import Groups, _refused, sort_by_id
from kt_ft.base.log import get_logger
from kt_ft.base.settings import enabled
from kt_ft.runtime.graph_buckets import bucket_tokens, pad_ids, pad_rows, unpad_grads, zero_rows_to
from kt_ft.runtime.graph_capture import (
    Captured,
    Pending,
    Workspace,
    capture_into,
    copy_unless_same,
    failure,
    warm_up_stream,
)

logger = get_logger(__name__)

MAX_BUCKETS = 6  # token-count buckets a layer captures graphs for; calls in others run eagerly
# eager calls of a bucket before its capture: the first warms its kernels up; waiting for two more
# leaves buckets a run meets once or twice uncaptured. Why: a bucket's capture (3 graphs a layer,
# with a warm-up run each) costs more than a few replays save -- on varied-length data (DeepSeek-V2-
# Lite, 16 micro-batches in 9 buckets, capture at the second use) the run was 1.23x slower than
# without graphs; data of one length loses 2 micro-batches' worth of replays
SEEN_BEFORE_CAPTURE = 3
_GRAD_NAMES = ("grad_x", "grad_w", *(f"grad_lora{i}" for i in range(6)))  # fused_backward's, in order
_forbidden: str | None = None  # why graphs are off for this process (a GPU memory cap)
_logged: set[str] = set()


def forbid(reason: str) -> None:
    """Turn graphs off for this process (``reason`` is logged once, at the first layer it stops)."""
    global _forbidden
    _forbidden = reason


def _device_refusal(dtype: torch.dtype, device: torch.device | None = None) -> str | None:
    """Why dense experts of ``dtype`` on the CUDA ``device`` (None: the current one) cannot replay
    graphs, or None. A product that loops over experts reads its row counts on the host: no capture.
    bf16 on sm90+ is where every product here is one torch._grouped_mm (older GPUs' fallback syncs)."""
    cap = torch.cuda.get_device_capability(device)
    if dtype != torch.bfloat16 or cap < (9, 0):
        return (
            f"{dtype} experts on sm{''.join(map(str, cap))}: "
            "torch._grouped_mm runs without a host sync for bfloat16 on sm90 and newer only"
        )
    return None


def expected(dtype: torch.dtype) -> bool:
    """Whether layers with every expert resident will replay graphs in this process, for experts of
    ``dtype`` on the current CUDA device (what the cost model assumes, ``cost.LayerTimes.graphed``;
    each layer still checks its own conditions at its first call)."""
    return (
        _forbidden is None
        and enabled("KT_FT_CUDA_GRAPHS")
        and torch.cuda.is_available()
        and _device_refusal(dtype) is None
    )


def _log_once(key: str, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are set (non-reentrant checkpointing, offloading): a forward with
    grad must then save through them, which the workspace's buffers would bypass."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: the safe answer
    return top(False) is not None


_workspaces: dict[tuple, Workspace] = {}


class LayerGraphs:
    """The graphs of one layer's resident experts (``DeviceExperts`` with every expert resident)."""

    def __init__(self, dev, scaling: float) -> None:  # dev: device_experts.DeviceExperts (its importer)
        self.dev, self.scaling = dev, scaling
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, Captured] = {}
        self.off: str | None = None  # why this layer stopped using graphs
        self.captures = self.replays = 0  # (tests count them)
        self._ptrs: tuple | None = None
        self._lora_loaded: tuple | None = None  # the LoRA values the wide buffers hold (``_load_lora``)
        self._checked = False  # the layer's fixed conditions (``_layer_fits``) hold

    # -- when ---------------------------------------------------------------------------------

    def _usable(self, x: torch.Tensor, lora) -> bool:
        if self.off is not None:
            return False
        if _forbidden is not None:
            self._stop(_forbidden)
            return False
        if not enabled("KT_FT_CUDA_GRAPHS"):
            return False
        base = self.dev.resident.weights
        if (
            x.device.type != "cuda"
            or any(t.device != x.device for t in lora)
            or base.gate_up.device != x.device
        ):
            return False
        if not self._checked:
            self._checked = self._layer_fits(x, base)
            if not self._checked:
                return False
        if _refused and any("cuda" in k for k in _refused):
            self._stop(
                "torch._grouped_mm refused a product of this run's shapes, which then loops over experts"
            )
            return False
        # the graphs read these addresses: a moved or replaced tensor drops them
        ptrs = tuple(t.data_ptr() for t in (*lora, base.gate_up, base.down))
        if ptrs != self._ptrs:
            self.graphs.clear()
            self._ptrs = ptrs
        return True

    def _layer_fits(self, x, base) -> bool:
        """What holds for the layer's whole life (its resident weights): checked once."""
        if getattr(base.gate_up, "fmt", None) is not None:
            self._stop("the experts are kept quantized")
            return False
        reason = _device_refusal(base.gate_up.dtype, x.device)
        if reason is not None:
            self._stop(reason)
            return False
        return True

    def _stop(self, reason: str) -> None:
        self.off = reason
        self.graphs.clear()
        _log_once(reason, f"CUDA graphs of resident experts: off ({reason}); the layers run eagerly")

    def run(self, x, local, weights, lora, k: int) -> torch.Tensor | None:
        """The layer's device share [T, H] in x's dtype from a graph of T's bucket
        (``bucket_tokens``), or None (run eagerly)."""
        if not self._usable(x, lora):
            return None
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, *lora))
        tb = bucket_tokens(x.shape[0])
        key = (grad, tb, k, x.dtype, weights.dtype, local.dtype)
        if grad:
            cap = self.graphs.get(key)
            ws = cap.ws if cap is not None else self._workspace(tb, x, local, weights, lora)
            if not ws.keep_saved or saved_tensor_hooks_active():
                return None
        self._load_lora(lora)
        if key not in self.graphs:
            buckets = {kk[1] for kk in self.graphs if kk[0] != "backward"}
            if tb not in buckets and len(buckets) >= MAX_BUCKETS:
                _log_once(
                    "buckets",
                    f"CUDA graphs: micro-batch lengths fall in more than {MAX_BUCKETS} token-count buckets "
                    f"({x.shape[0]} tokens: bucket {tb}); those outside the captured ones run eagerly "
                    "(packing: true gives every micro-batch cutoff_len tokens)",
                )
                return None
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] <= SEEN_BEFORE_CAPTURE or not self._capture_forward(
                key, *pad_rows(x, local, weights, tb, len(self.dev.ids)), lora, grad
            ):
                return None
        if grad:
            return _GraphedExperts.apply(x, local, weights, *lora, (self, key))
        return self._replay_forward(key, x, local, weights, None)

    def _load_lora(self, lora) -> None:
        """Write the LoRA into the wide layout's buffers when its values changed since the last
        write (``lora_key``: once an optimizer step), outside the graphs: written inside, it cost
        every forward replay ~9 strided copies (graph nodes: the launch's host time grows with them)."""
        wide = self.dev.resident.weights.wide
        if wide is None:
            return
        key = (wide.gu_buf.data_ptr(), *lora_key(lora))  # new buffers start with zero LoRA blocks
        if key != self._lora_loaded:
            wide.load_lora(*lora, self.scaling)
            self._lora_loaded = key

    def forward_pending(self, key, tokens: int) -> Pending:
        cap = self.graphs[key]
        return Pending(cap.ws, key, cap.meta, tokens)

    # -- forward ------------------------------------------------------------------------------

    def _workspace(self, tokens: int, x, local, weights, lora) -> Workspace:
        """The workspace of calls like these (x [T, H], local [T, k]) in the bucket of ``tokens``."""
        base = self.dev.resident.weights
        sig = (
            x.device,
            (tokens, *x.shape[1:]),
            x.dtype,
            (tokens, *local.shape[1:]),
            weights.dtype,
            tuple(base.gate_up.shape),
            tuple(base.down.shape),
            base.gate_up.dtype,
            tuple((tuple(t.shape), t.dtype) for t in lora),
            base.wide is not None,  # the layouts save different tensors
        )
        ws = _workspaces.get(sig)
        if ws is None:
            ws = _workspaces[sig] = Workspace()
        return ws

    def _forward_body(self, x, local, weights, lora, k, into=None):
        """-> (out [T, H] x's dtype, counts [E], fused_forward's saved tensors, its meta); ``into``:
        ``fused_forward``'s (the static buffers a capture writes in place)."""
        dev = self.dev
        flat = local.reshape(-1)
        order = sort_by_id(flat, len(dev.ids))
        counts = torch.zeros(len(dev.ids), dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        groups = Groups(counts, flat.numel())

        def cast(*t):
            return stack_lora(*t, dev.dtype, dev.spec)

        out, saved, meta = fused_forward(
            x, weights, lora, dev.resident.weights, self.scaling, groups, order, k, cast, x.dtype,
            load_lora=False,  # ``_load_lora`` wrote it before
            into=into,
        )  # fmt: skip
        return out.to(x.dtype), counts, saved[: meta.n_saved], meta

    def _room(self, x, nbytes: int) -> bool:
        """Room for a graph's buffers and scratch (about twice the forward's tensors) and 1 GiB more."""
        free, _ = torch.cuda.mem_get_info(x.device)
        cached = torch.cuda.memory_reserved(x.device) - torch.cuda.memory_allocated(x.device)
        return free + cached >= 3 * nbytes + 2**30

    def _capture_forward(self, key, x, local, weights, lora, grad: bool) -> bool:
        """Capture the forward of ``key`` from one call's inputs, already padded to its bucket."""
        ws = self._workspace(key[1], x, local, weights, lora)
        k = key[2]
        try:
            # warm-up on a side stream (lazy initialisations stay out of the capture); its tensors
            # size the static buffers
            with warm_up_stream(x.device), torch.no_grad():
                out, counts, saved, _ = self._forward_body(x, local, weights, lora, k)
            nbytes = sum(t.numel() * t.element_size() for t in (out, *saved) if t is not None)
            if not self._room(x, nbytes):
                _log_once("room", "CUDA graphs of resident experts: not captured, too little free GPU memory")
                return False
            sx, sl, sw = ws.buffer("x", x), ws.buffer("local", local), ws.buffer("weights", weights)
            so = ws.buffer("out", out)
            s_saved = (
                [None if t is None else ws.buffer(f"saved{i}", t) for i, t in enumerate(saved)]
                if grad
                else []
            )
            ws.n_saved = max(ws.n_saved, len(s_saved))
            s_counts = ws.buffer("counts", counts) if grad else None
            del out, counts, saved
            sx.copy_(x), sl.copy_(local), sw.copy_(weights)
            # the wide layout writes its output and its two big saved row blocks (xw, hw) straight
            # into the static buffers: copies of ~90 MB a replay at Qwen3-30B-A3B's 2,048 tokens
            into = {"out": so}
            if grad and self.dev.resident.weights.wide is not None:
                into.update(xw=s_saved[0], hw=s_saved[2])
            g = torch.cuda.CUDAGraph()
            with torch.no_grad(), capture_into(g, ws, x.device):
                out, counts, saved, meta = self._forward_body(sx, sl, sw, lora, k, into)
                copy_unless_same(so, out)
                if grad:
                    s_counts.copy_(counts)
                    for dst, src in zip(s_saved, saved):
                        if dst is not None:
                            copy_unless_same(dst, src)
                del out, counts, saved
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self._stop(f"capture failed {failure(e)}")
            return False
        # the backward rebuilds the groups from the workspace's counts: none of the capture's tensors kept
        self.graphs[key] = Captured(g, ws, meta._replace(groups=None))
        self.captures += 1
        _log_once(
            "captured",
            f"CUDA graphs: the expert work of resident layers is captured per token-count bucket ({x.shape[0]} "
            "tokens first) and replayed (KT_FT_CUDA_GRAPHS=0: launched eagerly)",
        )
        return True

    def _replay_forward(self, key, x, local, weights, pending: Pending | None) -> torch.Tensor:
        cap = self.graphs[key]
        ws = cap.ws
        if pending is not None and ws.claim(pending):  # a forward with grad writes the saved buffers
            _log_once(
                "evict",
                "CUDA graphs: a forward ran before the backward of the one before it (no gradient "
                "checkpointing): forwards with grad of resident layers run without graphs from here on",
            )
        t, tb = x.shape[0], key[1]
        bx, bl, bw = ws.bufs["x"], ws.bufs["local"], ws.bufs["weights"]
        bx[:t].copy_(x)
        bl[:t].copy_(local)
        bw[:t].copy_(weights)
        if t < tb:  # padding rows (``pad_rows``): a longer call of this bucket may have written them
            bx[t:].zero_()
            bl[t:].copy_(pad_ids(tb, key[2], len(self.dev.ids), bl.device)[t:])
            bw[t:].zero_()
        cap.graph.replay()
        self.replays += 1
        return ws.bufs["out"][:t].clone()

    # -- backward -----------------------------------------------------------------------------

    def backward(self, pending: Pending, grad_out, needs_x: bool, needs_w: bool):
        """-> (grad_x, grad_weights, six LoRA grads) of ``pending``'s forward."""
        ws, meta = pending.ws, pending.meta
        base = self.dev.resident.weights
        t, tb = pending.tokens, pending.key[1]

        def padded_grad():  # [tb, H] in the output's dtype (the weights'): zero for the padding rows
            return zero_rows_to(grad_out, tb)

        if not pending.in_workspace:  # evicted: its own copies, eagerly
            if pending.saved is None:
                raise RuntimeError(
                    "a second backward through a layer whose resident experts ran from a CUDA graph "
                    "(retain_graph) is not supported: set KT_FT_CUDA_GRAPHS=0"
                )
            m = meta._replace(groups=Groups(pending.counts, pending.saved[0].shape[0]))
            saved = (*pending.saved, *weight_tensors(base))
            pending.saved = None
            return unpad_grads(fused_backward(padded_grad(), saved, m, needs_x, needs_w), t)
        bkey = ("backward", pending.key, needs_x, needs_w)
        if bkey not in self.graphs and not self._capture_backward(
            bkey, ws, meta, padded_grad(), needs_x, needs_w
        ):
            out = self._backward_body(ws, meta, padded_grad(), needs_x, needs_w)
            pending.in_workspace = False
            ws.owner = None
            return unpad_grads(out, t)
        go = ws.bufs["grad_out"]
        go[:t].copy_(grad_out)
        if t < tb:
            go[t:].zero_()
        self.graphs[bkey].graph.replay()
        self.replays += 1
        pending.in_workspace = False
        ws.owner = None
        return tuple(
            (ws.bufs[n][:t] if n in ("grad_x", "grad_w") else ws.bufs[n]).clone()
            if n in ws.bufs and self._wanted(n, needs_x, needs_w)
            else None
            for n in _GRAD_NAMES
        )

    @staticmethod
    def _wanted(name: str, needs_x: bool, needs_w: bool) -> bool:
        return {"grad_x": needs_x, "grad_w": needs_w}.get(name, True)

    def _backward_body(self, ws: Workspace, meta: FusedMeta, go, needs_x, needs_w):
        base = self.dev.resident.weights
        m = meta._replace(groups=Groups(ws.bufs["counts"], ws.bufs["saved0"].shape[0]))
        return fused_backward(go, (*ws.saved(), *weight_tensors(base)), m, needs_x, needs_w)

    def _capture_backward(self, bkey, ws: Workspace, meta: FusedMeta, grad_out, needs_x, needs_w) -> bool:
        """Capture the backward ``bkey`` from one incoming gradient, padded to the bucket ([tb, H])."""
        go = ws.buffer("grad_out", grad_out)
        try:
            go.copy_(grad_out)
            dev = go.device
            with warm_up_stream(dev), torch.no_grad():
                grads = self._backward_body(ws, meta, go, needs_x, needs_w)
            dst = {n: ws.buffer(n, g) for n, g in zip(_GRAD_NAMES, grads) if g is not None}
            del grads
            g = torch.cuda.CUDAGraph()
            with torch.no_grad(), capture_into(g, ws, dev):
                grads = self._backward_body(ws, meta, go, needs_x, needs_w)
                for n, t in zip(_GRAD_NAMES, grads):
                    if t is not None:
                        dst[n].copy_(t)
                del grads
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self._stop(f"backward capture failed {failure(e)}")
            return False
        self.graphs[bkey] = Captured(g, ws, None)
        self.captures += 1
        return True


class _GraphedExperts(torch.autograd.Function):
    """apply(x [T, H], local [T, k] int64, weights [T, k], six LoRA params, (LayerGraphs, key)) ->
    the layer's device share [T, H] in x's dtype, from the forward graph; backward from the
    backward graph (or eagerly, when the forward's tensors were evicted)."""

    @staticmethod
    def forward(ctx, x, local, weights, ga, gb, ua, ub, da, db, lg_key):
        lg, key = lg_key
        pending = lg.forward_pending(key, x.shape[0])
        ctx.lg, ctx.pending = lg, pending
        return lg._replay_forward(key, x, local, weights, pending)

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.lg.backward(ctx.pending, grad, ctx.needs_input_grad[0], ctx.needs_input_grad[2])
        return grads[0], None, grads[1], *grads[2:], None
