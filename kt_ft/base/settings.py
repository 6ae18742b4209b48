"""Every environment variable kt-ft reads, in one registry: its name, default and what it does.

Code reads them through ``get`` / ``enabled`` (a name missing here is a programming error, not a
silent default); ``log_changed`` says once a process which ones are set to something else than
their default. None is needed to train: they turn kt-ft off, say where its files go, trade memory
for time, rule out a fused operator, or ask for diagnostics. ``markdown_table`` is their
documentation (``kt-ft settings``, docs/settings.md). Imports nothing heavy: the start-up hook
reads ``KT_FT_DISABLE``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from kt_ft.base.errors import KTConfigError

# what a non-default value changes: "nothing" (the same numbers, another mechanism or a file),
# "numerics" (another kernel or summation order: results within the tests' tolerances)
CHANGES = ("nothing", "numerics")


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None  # None: unset (the feature it names is off)
    help: str  # what a value does and when a user would set it
    changes: str = "nothing"  # one of CHANGES
    topic: str = ""  # its heading in the docs (``_BY_TOPIC``)

    def __post_init__(self) -> None:
        if self.changes not in CHANGES:
            raise ValueError(f"setting {self.name}: changes={self.changes!r}; valid: {', '.join(CHANGES)}")


_BY_TOPIC: dict[str, tuple[Setting, ...]] = {
    "kt-ft on or off": (
        Setting(
            "KT_FT_DISABLE",
            "0",
            "1: kt-ft's start-up hook patches nothing, so LLaMA-Factory runs as shipped (use_kt and "
            "kt-ft's other recipe keys are then unknown to it): the same installation without kt-ft",
        ),
    ),
    "Several ranks on a machine": (
        Setting(
            "KT_FT_SHARED_DIR",
            "/dev/shm",
            "directory of the routed-expert file the ranks of a machine share: a RAM-backed file "
            "system or a local disk with room for the experts (Docker's /dev/shm is 64 MB by default); "
            "off (or 0): each rank loads a private copy of the routed experts instead (one more copy "
            "of the experts' host memory a rank), needed for quantized experts with several ranks on "
            "a machine, which are not shared yet",
        ),
    ),
    "Memory and speed": (
        Setting(
            "KT_FT_CUDA_GRAPHS",
            "1",
            "0: a layer whose experts are all resident on the GPU launches its expert work kernel by "
            "kernel instead of replaying CUDA graphs captured per token-count bucket; faster for short "
            "runs on data of varied lengths without packing (each bucket's capture costs more than its "
            "few replays save), and needed where a step runs a backward twice (retain_graph)",
        ),
        Setting(
            "KT_FT_DEQUANT_CHUNK_MIB",
            "1024",
            "MiB of experts kept quantized (fp8, int8, ...) that GPU experts dequantize at once for one "
            "grouped product (at least one expert; a whole layer in one chunk needs no host sync); the "
            "GPU memory plan counts it: lower it to lower a quantized model's GPU peak",
        ),
        Setting(
            "KT_FT_KT_KERNEL_SHARED_CACHE",
            "0",
            "1: the kt-kernel backend keeps one pool of saved activations for all layers instead of one "
            "a layer and runs each layer's CPU forward again before its backward: less host memory "
            "(~0.16 GiB a DeepSeek-V2-Lite layer at 2,048 tokens) for one more CPU forward a layer",
        ),
        Setting(
            "KT_FT_MMAP_THRESHOLD",
            "4M",
            "glibc's mmap threshold for a kt-ft training process (bytes, or with a K or M suffix): "
            "blocks from that size up are mapped per use instead of kept in the heaps, where freed "
            "space stays resident; 0 keeps glibc's adaptive default",
        ),
    ),
    "CPU kernels": (
        Setting(
            "KT_FT_NATIVE_ISA",
            "auto",
            "the native CPU backend's GEMM path: auto (the best this CPU runs), scalar (plain C++), "
            "avx2 (AVX2+FMA), avx512 (AVX-512F fp32), avx512bf16 (vdpbf16ps), amx (AMX-BF16); the last "
            "two round activations to bf16; one the CPU lacks is refused",
            "numerics",
        ),
        Setting(
            "KT_FT_CPU_UPCAST",
            "1",
            "0: on a CPU without native bf16 (no AVX512-BF16 or AMX), the frozen products outside the "
            "routed experts that run on it (the loss's lm_head product, linear layers kept quantized) "
            "run in bf16 as torch does, ~5x slower there than fp32; 1 (the default) computes them in "
            "fp32 from their bf16 (or quantized) weights upcast a block at a time, outputs in bf16",
            "numerics",
        ),
        Setting(
            "KT_FT_NATIVE_BUILD",
            "1",
            "0: never compile the native CPU kernels at run time, only use a library built at install "
            "(machines without a compiler, or where a run must not compile)",
        ),
        Setting(
            "KT_FT_CACHE_DIR",
            None,
            "directory of kt-ft's caches: the measured machine rates and the native kernels compiled "
            "at run time (default ~/.cache/kt-ft)",
        ),
    ),
    "Fused operators": (
        Setting(
            "KT_FT_FUSIONS",
            "lora,norm,rope,loss",
            "the fused paths kt-ft installs, a comma list (or joined by +) of lora (PEFT's LoRA "
            "linears as one autograd node each, instead of PEFT's forward), norm (Llama-style RMSNorm "
            "through torch's rms_norm), rope (q and k's rotary embedding as one autograd node, instead "
            "of transformers' apply_rotary_pos_emb) and loss (lm_head and the cross entropy a chunk of "
            "tokens at a time, no logits of every token at once); none (or 0): none of them. Leave one "
            "out to tell whether it is why a run differs from HF + PEFT, to measure what it saves, or "
            "for a model whose loss kt-ft says it cannot compute in chunks",
            "numerics",
        ),
    ),
    "Diagnostics": (
        Setting(
            "KT_FT_PROFILE",
            None,
            "DIR: one optimizer step of a llamafactory-cli run (the third) under torch.profiler; its "
            "operator tables and wall time go to DIR/step3.txt (kt-ft on or off alike). Options after "
            "DIR, comma-separated: step=N records the N-th optimizer step (1-based) instead, trace also "
            "writes the step's gzipped Chrome trace (DIR,step=5,trace)",
        ),
        Setting(
            "KT_FT_RUN_REPORT",
            None,
            "DIR: at the end of a llamafactory-cli run's training, its host time a step is logged and "
            "written to DIR/host_time.json (the median wall time and its threads' CPU time: whether a "
            "step is bound by the host's work, without a profiler's cost; kt-ft on or off alike), and "
            "each rank of a kt-ft run writes its memory record (resident, proportional and private "
            "bytes, the expert mapping's among them) to DIR/rank0.json, rank1.json, ...",
        ),
    ),
}
_ALL = tuple(replace(s, topic=topic) for topic, group in _BY_TOPIC.items() for s in group)
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


FUSIONS = ("lora", "norm", "rope", "loss")  # KT_FT_FUSIONS's names
_NONE = ("none", "0")


def fusions() -> frozenset[str]:
    """The fused paths ``KT_FT_FUSIONS`` turns on in this process (``parse_fusions``)."""
    return parse_fusions(get("KT_FT_FUSIONS") or "")


def parse_fusions(raw: str) -> frozenset[str]:
    """A ``KT_FT_FUSIONS`` value as a subset of ``FUSIONS`` (names joined by commas or +; ``none``,
    ``0`` or empty: none); a name outside ``FUSIONS`` stops with the variable, the value and the
    valid names."""
    if raw.strip().lower() in _NONE:
        return frozenset()
    names = {n.strip().lower() for n in re.split(r"[,+]", raw)} - {""}
    bad = sorted(names - set(FUSIONS))
    if bad:
        raise KTConfigError(
            f"KT_FT_FUSIONS={raw!r}: {', '.join(bad)} is not a fusion; valid: a comma list of "
            f"{', '.join(FUSIONS)}, or none"
        )
    return frozenset(names)


@dataclass(frozen=True)
class Profile:
    """What ``KT_FT_PROFILE`` asks for: the directory, the optimizer step (1-based), the trace."""

    directory: str
    step: int = 3
    trace: bool = False

    def value(self) -> str:
        """Back to a ``KT_FT_PROFILE`` value (for a child process)."""
        return ",".join([self.directory, f"step={self.step}", *(["trace"] if self.trace else [])])


def profile() -> Profile | None:
    """``KT_FT_PROFILE`` in this process (``parse_profile``); None when unset or empty."""
    return parse_profile(get("KT_FT_PROFILE"))


def parse_profile(raw: str | None) -> Profile | None:
    """A ``KT_FT_PROFILE`` value: ``DIR`` then, comma-separated, ``step=N`` (N >= 1) and ``trace``;
    None for unset or empty. Anything else stops with the variable, the value and the valid forms."""
    if raw is None or not raw.strip():
        return None
    directory, *options = (part.strip() for part in raw.split(","))
    step, trace = Profile.step, False
    for opt in options:
        key, eq, number = opt.partition("=")
        if opt == "trace":
            trace = True
        elif key == "step" and eq and number.isdigit() and int(number) >= 1:
            step = int(number)
        else:
            directory = ""  # refused below
    if not directory:
        raise KTConfigError(
            f"KT_FT_PROFILE={raw!r}: not a profile request; valid: DIR, with options after it "
            "(comma-separated): step=N (the N-th optimizer step, N >= 1), trace, e.g. DIR,step=5,trace"
        )
    return Profile(directory, step, trace)


def changed() -> dict[str, str]:
    """The registered settings set in the environment to something else than their default."""
    return {
        s.name: os.environ[s.name] for s in _ALL if s.name in os.environ and os.environ[s.name] != s.default
    }


def markdown_table() -> str:
    """The registry as Markdown, one table a topic: ``kt-ft settings`` prints it and docs/settings.md
    carries it (tests/test_settings.py keeps the two equal)."""
    rows = []
    for topic, group in _BY_TOPIC.items():
        rows += [f"### {topic}", "", "| variable | default | changes | what it does |", "|---|---|---|---|"]
        for x in group:
            default = f"`{x.default}`" if x.default is not None else "unset"
            rows.append(f"| `{x.name}` | {default} | {x.changes} | {x.help} |")
        rows.append("")
    return "\n".join(rows)


def log_changed(logger) -> None:
    """Once a process: one line per setting that differs from its default, with what it does."""
    global _logged
    if _logged:
        return
    _logged = True
    for name, value in changed().items():
        logger.info(f"setting {name}={value} (default {SETTINGS[name].default}): {SETTINGS[name].help}")
