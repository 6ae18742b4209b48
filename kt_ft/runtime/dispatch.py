"""kt-ft's entry in transformers' ``ALL_EXPERTS_FUNCTIONS``: ``experts_implementation="kt_ft"``.

A decorated experts module (``interface.py``) dispatches its ``forward(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` on ``config._experts_implementation``;
registered under ``"kt_ft"``, that call runs kt-ft's CPU op on the module's own weights, in the
layout and activation ``derive_spec`` read off it, without LoRA (differentiable w.r.t. the
hidden states and the routing weights). It is what ``kt-ft models`` uses to check a model type:
one model, its experts computed once by transformers' ``eager`` and once through ``"kt_ft"``.

Training does not go through it: ``moe/patch.py`` still swaps each experts module for a
``KTExperts``. Why (transformers 5.6): the experts must stay in CPU RAM while the HF Trainer moves
the model to the GPU (``KTExperts._apply`` is pinned; the decorated class is HF's and moves);
PEFT >= 0.21 wraps targeted experts in ``ParamWrapper`` layers whose forward runs PEFT's own
expert LoRA around the dispatch; and 5.6's ``set_experts_implementation`` /
``from_pretrained(experts_implementation=...)`` accept only eager, grouped_mm, batched_mm and
deepgemm (``get_correct_experts_implementation``), so a registered name is reachable only by
writing the private ``config._experts_implementation_internal``. The swap keeps HF's parameter
objects under their names, so checkpoints are unchanged either way.
"""

from __future__ import annotations

import torch

from kt_ft.backends.base import DEFAULT_SPEC, ExpertWeights, LoraTensors
from kt_ft.backends.quant_weights import is_quantized
from kt_ft.backends.registry import select_backend
from kt_ft.base.errors import KTConfigError
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.family import _fused_silu_problems, _gpt_oss_problems, expert_spec
from kt_ft.plan.interface import derive_spec
from kt_ft.runtime.function import CPUExpertsFunction, ExpertRunner

IMPLEMENTATION = "kt_ft"


def register_experts_function() -> bool:
    """Register ``kt_ft_experts_forward`` as ``"kt_ft"`` where this transformers has the experts
    interface (idempotent); False where it has none (transformers < 5)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION) is not kt_ft_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, kt_ft_experts_forward)
    return True


def use_kt_ft_experts(model: torch.nn.Module, name: str = IMPLEMENTATION) -> None:
    """Make every decorated experts module of ``model`` dispatch to ``name`` (``"eager"`` to undo):
    the private config attribute, on the model's config and its sub-configs (see module doc)."""
    register_experts_function()
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_experts_implementation_internal"):
            config._experts_implementation_internal = name


def _runner(module: torch.nn.Module):
    """The module's cached ExpertRunner (torch backend, its derived spec) and a zero rank-1 LoRA."""
    cached = getattr(module, "_kt_ft_runner", None)
    if cached is not None:
        return cached
    if is_quantized(getattr(module, "gate_up_proj", None)):
        # kt-ft's quantized reader took them: they are no parameters for ``derive_spec`` to read;
        # the families' own checks say which layout they are (``models``: the default fused silu
        # one, or gpt_oss's, which run shapes, biases and the module's gate)
        spec, problems = _quantized_spec(module)
    else:
        spec, problems = derive_spec(module)
    if spec is None:
        raise KTConfigError(
            [f"experts_implementation='kt_ft' on {type(module).__name__}: {p}" for p in problems]
        )
    names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    tensors = [getattr(module, n, None) for n in names]
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        raise KTConfigError(
            f"experts_implementation='kt_ft' on {type(module).__name__}: its weights are on "
            f"{tensors[0].device}; kt-ft's CPU op reads them in CPU memory (valid: cpu)"
        )
    # weights kept quantized (``kt_ft.backends.quant``) are read as they are, dequantized a chunk of experts at a time
    base = ExpertWeights(*(t if t is None or is_quantized(t) else t.detach() for t in tensors), spec=spec)
    backend, _ = select_backend("torch", base.gate_up.dtype, spec, base.quantized)
    runner = ExpertRunner(backend, base, 0.0, chunk_size=8192, threads=None)
    e, h, i = base.num_experts, base.hidden, base.intermediate
    shapes = ((e, 1, h), (e, i, 1), (e, 1, h), (e, i, 1), (e, 1, i), (e, h, 1))
    lora = LoraTensors(*(torch.zeros(s, dtype=torch.float32) for s in shapes))
    module._kt_ft_runner = (runner, lora)
    return runner, lora


def _quantized_spec(module: torch.nn.Module):
    """(spec, problems) of an experts module whose weights are kept quantized: the default layout
    if it passes that check, else gpt_oss's if it passes that one, else (None, both lists)."""
    problems = _fused_silu_problems(module)
    if not problems:
        return DEFAULT_SPEC, []
    oss = _gpt_oss_problems(module)
    if not oss:
        return expert_spec(FAMILIES["gpt_oss"], module), []
    return None, [*problems, *(f"(as gpt_oss) {p}" for p in oss)]


def kt_ft_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-interface call, answered by kt-ft's CPU op (see module doc)."""
    runner, lora = _runner(self)
    ids = top_k_index.to(torch.int64)
    # expert parallelism's sentinel (>= E) is a masked pair for the op: skipped, weight zeroed
    ids = ids.masked_fill(ids >= runner.base.num_experts, -1)
    weights = top_k_weights.masked_fill(ids < 0, 0)
    return CPUExpertsFunction.apply(hidden_states, ids, weights, runner, *lora).to(hidden_states.dtype)
