"""Before any weight is read: where a checkpoint's weights should load, for a run that ``kt_ft.apply``
will then change (any loader that takes a transformers ``device_map``: LLaMA-Factory's, or
``from_pretrained`` in a script).

``prepare_loading`` plans on a meta skeleton (a bad rule, an impossible GPU cap or a quantized
format kt-ft cannot read stop here, in seconds), sets the host allocator's policy for the run, and
says how the routed experts come in: read by kt-ft straight from the files into their one CPU copy
(``ExpertReader``; the device map keeps them on ``meta`` for ``from_pretrained``), mapped from the
copy local rank 0 shares (the other ranks of a machine), or loaded by transformers to the CPU while
the rest goes straight to the training GPU. A run whose host RAM need (``kt-ft rules plan``'s
estimate) exceeds what this machine has available stops here too, saying what would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.base.processes import topology
from kt_ft.formats.skeleton import meta_model
from kt_ft.plan.family import family_of
from kt_ft.plan.loader import load_rules
from kt_ft.plan.recipe import KTConfig
from kt_ft.plan.report import check_gpu_cap, check_host_fit, estimate, train_sizes
from kt_ft.runtime.core import resolve_rule
from kt_ft.runtime.host_alloc import apply as apply_host_alloc
from kt_ft.runtime.loading import plan_expert_reader, planned_device_map
from kt_ft.runtime.shared_weights import meta_device_map, sharing_enabled

logger = get_logger(__name__)


@dataclass
class Loading:
    """How to load: ``device_map`` for ``from_pretrained`` (None: keep the caller's); ``reader``:
    fills the routed experts ``device_map`` left on ``meta`` (``reader.fill(model)`` right after
    loading, or into the mapping the ranks share: ``shared``); ``mapped``: this rank reads no expert
    (another rank of this machine does, and this one maps its copy)."""

    device_map: dict | None = None
    reader: Any = None
    shared: bool = False
    mapped: bool = False


def prepare_loading(
    config: Any,
    model_path: str,
    kt: KTConfig,
    *,
    training_device: str,
    single_device: bool,
    quant: Any = None,
    source: str = "KTConfig",
) -> Loading:
    """``config``: the checkpoint's transformers config; ``training_device``: where the non-expert
    weights train (``cuda:N`` or ``cpu``); ``single_device``: the caller loads everything to that one
    device (kt-ft may then pick the device map); ``quant``: the checkpoint's quantized format
    (``kt_ft.backends.quant_detect.take_quantization_config``), or None; ``source``: the file the
    errors name."""
    apply_host_alloc(logger)  # before the weights load: the heaps' policy for the whole run
    family = family_of(config)
    rules = load_rules(resolve_rule(kt.rule, family))
    skeleton = meta_model(config, torch.bfloat16)  # the plan and both checks' estimates (bf16 weights)
    device_map, plan = planned_device_map(
        config, rules, family, kt.backend, kt.threads, training_device, skeleton=skeleton
    )
    if kt.gpu_memory_gib is not None and torch.device(training_device).type == "cuda":
        # too small even with every auto-placed expert on the CPU: stop before any weight is read
        check_gpu_cap(skeleton, plan, torch.bfloat16, train_sizes(kt), kt.gpu_memory_gib, source)
    topo = topology()
    expert_names = [e.name for e in plan.experts]
    sharing = single_device and sharing_enabled(topo.local_world_size)
    if topo.local_rank == 0:  # one check per machine: the ranks of a machine share one expert copy
        check_host_memory(skeleton, plan, kt, quant, source, training_device)
    if sharing and topo.local_rank != 0:
        logger.info(f"local rank {topo.local_rank}: routed experts not read here (shared from local rank 0)")
        return Loading(meta_device_map(device_map, expert_names), mapped=True)
    if quant is not None and (not single_device or sharing):
        raise KTConfigError(
            f"{model_path}: {quant.name} routed experts are read by one process per machine "
            "with a single training device only in this version"
            + ("; set KT_FT_SHARED_DIR=off (each rank reads its own quantized copy)" if sharing else "")
        )
    reader = plan_expert_reader(model_path, config, expert_names, quant) if single_device else None
    if reader is not None:
        logger.info(
            f"loading {len(expert_names)} routed-experts modules ({fmt_bytes(reader.nbytes)} in the files) "
            f"straight from the files into CPU RAM, the rest to {training_device}"
        )
        # transformers loads the rest; kt-ft reads the experts right after, or (several ranks here)
        # local rank 0 reads them straight into the shared mapping
        return Loading(reader.device_map(device_map), reader, shared=sharing)
    if single_device and torch.cuda.is_available() and torch.device(training_device).type == "cuda":
        logger.info(
            f"loading {len(expert_names)} routed-experts modules into CPU RAM, the rest to {training_device}"
        )
        return Loading(device_map)
    return Loading()


def host_memory() -> tuple[int, int, int]:
    """(MemTotal, MemAvailable, MemFree) in bytes, as /proc/meminfo (what ``free`` shows) says;
    zeros where it cannot be read (not Linux)."""
    values = {}
    try:
        for line in open("/proc/meminfo"):
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0, 0
    return values.get("MemTotal", 0), values.get("MemAvailable", 0), values.get("MemFree", 0)


def check_host_memory(
    model: Any, plan: Any, kt: KTConfig, quant: Any, source: str, training_device: str = "cpu"
) -> None:
    """The run's host RAM need (``kt-ft rules plan``'s estimate of ``model``, a bf16 meta skeleton,
    routed experts as stored; training on the CPU, what the plan puts on the training GPU is host
    RAM too, less the CUDA runtime) against this machine's: refused when it cannot fit, a warning
    when it fits only by evicting page cache or with little headroom."""
    total, available, free = host_memory()
    if not total:
        return
    report = estimate(model, plan, torch.bfloat16, train_sizes(kt), expert_format=quant)
    if torch.device(training_device).type == "cpu":
        host = dict.fromkeys(("param_bytes", "train_state_bytes", "activation_bytes", "runtime_bytes"), 0)
        for name, d in report["devices"].items():
            for key in host:
                host[key] += 0 if key == "runtime_bytes" and name != "cpu" else d[key]
        report["devices"] = {"cpu": {**host, "total_bytes": sum(host.values())}}
    warning = check_host_fit(
        report,
        total=total,
        available=available,
        free=free,
        where=source,
        expert_bytes=report["expert_bytes"],
        quantized=quant is not None,
    )
    if warning:
        logger.warning(warning)
