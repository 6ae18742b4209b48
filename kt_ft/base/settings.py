"""Every environment switch kt-ft reads, in one registry: its name, default and what it does.

Code reads them through ``get`` / ``enabled`` (a name missing here is a programming error, not a
silent default); ``log_changed`` says once a process which ones are set to something else than
their default. Most exist to compare a path with its alternative (``0`` turns a mechanism off);
none is needed to run. Imports nothing heavy: the start-up hook reads ``KT_FT_DISABLE``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# what a non-default value changes: "nothing" (the same numbers, another mechanism or a file),
# "numerics" (another kernel or summation order: results within the tests' tolerances),
# "placement" (which experts run where, hence the arithmetic's order)
CHANGES = ("nothing", "numerics", "placement")


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None  # None: unset (the feature it names is off)
    help: str
    changes: str = "nothing"  # one of CHANGES

    def __post_init__(self) -> None:
        if self.changes not in CHANGES:
            raise ValueError(f"setting {self.name}: changes={self.changes!r}; valid: {', '.join(CHANGES)}")


_ALL = (
    Setting("KT_FT_DISABLE", "0", "1: the start-up hook patches nothing (LLaMA-Factory runs as shipped)"),
    Setting(
        "KT_FT_CHUNKED_LOSS",
        "1",
        "0: the training loss through the model's own forward (logits of every token) instead of lm_head and "
        "the cross entropy a chunk of tokens at a time (kt_ft/backends/lm_loss.py)",
        "numerics",
    ),
    Setting(
        "KT_FT_SHARE_EXPERTS", "1", "0: several ranks on a machine each load a private copy of the experts"
    ),
    Setting(
        "KT_FT_SHARED_DIR", "/dev/shm", "directory of the routed-expert file the ranks of a machine share"
    ),
    Setting(
        "KT_FT_KT_KERNEL_SHARED_CACHE",
        "0",
        "1: the kt-kernel backend keeps one pool of saved activations for all layers instead of one a layer "
        "(less host memory: ~0.16 GiB a DeepSeek-V2-Lite layer at 2,048 tokens) and runs each layer's CPU "
        "forward again before its backward (kt_ft/backends/kt_kernel.py)",
    ),
    Setting(
        "KT_FT_MMAP_THRESHOLD",
        "4M",
        "glibc's mmap threshold for a kt-ft training process (bytes, or K/M): larger blocks are mapped per use "
        "instead of kept in the heaps, where freed space stays resident (kt_ft/runtime/host_alloc.py); 0: glibc's "
        "adaptive default",
    ),
    Setting(
        "KT_FT_CUDA_GRAPHS",
        "1",
        "0: a layer whose experts are all resident on the GPU launches each kernel of its expert work "
        "instead of replaying CUDA graphs captured per token-count bucket (kt_ft/runtime/graphed.py)",
    ),
    Setting(
        "KT_FT_DEQUANT_CHUNK_MIB",
        "1024",
        "MiB of experts kept quantized (fp8, int8, ...) that GPU experts dequantize at once for one grouped "
        "product (a chunk of experts; at least one expert; a whole layer in one chunk needs no host sync); "
        "the GPU memory plan counts it",
    ),
    Setting(
        "KT_FT_FUSED_LORA",
        "1",
        "0: PEFT's LoRA linears (attention, shared experts, dense MLPs) run PEFT's own forward instead of one "
        "fused autograd node each (kt_ft/backends/lora_linear.py)",
        "numerics",
    ),
    Setting(
        "KT_FT_FUSED_NORM",
        "1",
        "0: Llama-style RMSNorm modules run their own forward (8 operators) instead of torch's rms_norm "
        "(kt_ft/backends/rms_norm.py)",
        "numerics",
    ),
    Setting(
        "KT_FT_FUSED_ROPE",
        "1",
        "0: the rotary embedding of q and k runs transformers' own apply_rotary_pos_emb (14 operators) instead "
        "of one autograd node (kt_ft/backends/rotary.py)",
        "numerics",
    ),
    Setting(
        "KT_FT_NATIVE_ISA",
        "auto",
        "native CPU GEMMs' path: scalar (plain C++), avx2 (AVX2+FMA), avx512 (AVX-512F fp32), avx512bf16 "
        "(vdpbf16ps), amx (AMX-BF16); the last two round activations to bf16; one the CPU lacks is refused",
        "numerics",
    ),
    Setting(
        "KT_FT_NATIVE_BUILD",
        "1",
        "0: never compile the native CPU kernels at run time (only a library built at install is used)",
    ),
    Setting("KT_FT_CACHE_DIR", None, "directory of the measured machine rates (default ~/.cache/kt-ft)"),
    Setting(
        "KT_FT_MEMORY_REPORT", None, "DIR: each rank writes its memory record there at the end of training"
    ),
    Setting("KT_FT_PROFILE", None, "DIR: one optimizer step of a llamafactory-cli run under torch.profiler"),
    Setting("KT_FT_PROFILE_STEP", "3", "the optimizer step KT_FT_PROFILE records (1-based)"),
    Setting("KT_FT_PROFILE_TRACE", "0", "1: KT_FT_PROFILE also writes a gzipped Chrome trace"),
    Setting(
        "KT_FT_HOST_TIME",
        "0",
        "1: a llamafactory-cli run logs, at its end, each step's wall time and its threads' CPU time (medians)",
    ),
    Setting("KT_FT_BENCH_PROFILE", None, "DIR: the in-process step bench profiles one step there"),
    Setting("KT_FT_BENCH_TRACE", "0", "1: KT_FT_BENCH_PROFILE also writes the timeline"),
    Setting(
        "KT_FT_BENCH_REPLAN", "1", "0: the step bench times auto's first split (no calibration, no trial)"
    ),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}
_FALSE = ("0", "false", "no", "off", "")
_logged = False


def get(name: str) -> str | None:
    """The value of setting ``name`` in this process (its default when unset)."""
    return os.environ.get(name, SETTINGS[name].default)


def enabled(name: str) -> bool:
    """A yes/no setting: anything but 0 / false / no / off (any case) or empty is yes."""
    value = get(name)
    return value is not None and value.strip().lower() not in _FALSE


def positive_number(name: str) -> float:
    """A numeric setting, > 0; anything else stops with the name, the value and the default."""
    raw = get(name)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: not a positive number (default {SETTINGS[name].default})")
    return value


def changed() -> dict[str, str]:
    """The registered settings set in the environment to something else than their default."""
    return {
        s.name: os.environ[s.name] for s in _ALL if s.name in os.environ and os.environ[s.name] != s.default
    }


def markdown_table() -> str:
    """The registry as the Markdown table docs/how-it-works.md carries (a test keeps them equal)."""
    rows = ["| variable | default | changes | effect |", "|---|---|---|---|"]
    for x in _ALL:
        default = f"`{x.default}`" if x.default is not None else "unset"
        rows.append(f"| `{x.name}` | {default} | {x.changes} | {x.help} |")
    return "\n".join(rows) + "\n"


def log_changed(logger) -> None:
    """Once a process: one line per setting that differs from its default, with what it does."""
    global _logged
    if _logged:
        return
    _logged = True
    for name, value in changed().items():
        logger.info(f"setting {name}={value} (default {SETTINGS[name].default}): {SETTINGS[name].help}")
