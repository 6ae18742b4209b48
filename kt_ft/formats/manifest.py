"""``kt_adapter_manifest.json``: what a complete kt-ft adapter / checkpoint directory holds.

Written last (after the adapter files, and in a trainer checkpoint after the optimizer,
scheduler, RNG and trainer state), so its presence means the save finished; every loader
checks it first and refuses, naming the file and the mismatch, anything that does not agree:

    {"format": "kt-ft-adapter", "format_version": 1, "kt_ft_version": "0.1.0",
     "base_model": {"name_or_path": ..., "config_sha256": <sha256 of its config.json>},
     "lora": {"rank": r, "alpha": a, "use_rslora": false},
     "experts": {"layers": [L, ...], "num_experts": E, "targets": [...], "backend": ..., "rule": ...,
                 "base_format": "bf16" | "fp8" | "int4" | "int8" | ...},
     "files": {"adapter_model.safetensors": {"size": bytes, "sha256": hex}, ...},
     "fused_tensors": {"layers.0.experts.gate_lora_a": {"shape": [E, r, H], "dtype": "BF16"}, ...}}
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kt_ft.base.atomic import sha256_file, write_json_atomic
from kt_ft.base.errors import KTConfigError
from kt_ft.base.settings import changed
from kt_ft.formats.expert_lora import FUSED_FILE, MASTER_FILE, fused_header

MANIFEST_FILE = "kt_adapter_manifest.json"
FORMAT = "kt-ft-adapter"
FORMAT_VERSION = 1
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", FUSED_FILE, MASTER_FILE)
# What the HF Trainer adds to a checkpoint-N dir (rng_state_{rank}.pth with several processes).
TRAINER_FILE_PATTERN = re.compile(
    r"(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|trainer_state\.json)"
)
CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)")


@dataclass
class KTAdapterInfo:
    """What an adapter is for: base model, expert-LoRA hyper-parameters, where the experts are."""

    base_model: str
    base_config_sha256: str
    rank: int
    alpha: float
    use_rslora: bool
    layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    targets: list[str] = field(default_factory=list)  # dotted names of the replaced experts modules
    backend: str = ""
    rule: str = ""
    kt_ft_version: str = ""
    # how the frozen routed experts were stored in RAM while training: a dtype (bf16, fp32, ...) or a
    # quantized format of kt_ft.backends.quant (fp8, int4, int8); "" in manifests written before it existed
    base_format: str = ""

    def config_block(self) -> dict:
        """The ``kt_ft`` key kt-ft adds to PEFT's adapter_config.json (PEFT ignores unknown keys)."""
        return {
            "expert_targets": self.targets,
            "expert_layers": self.layers,
            "num_experts": self.num_experts,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "backend": self.backend,
            "rule": self.rule,
            "fused_file": FUSED_FILE,
            "kt_ft_version": self.kt_ft_version,
        }


def base_config_sha256(name_or_path: str) -> str:
    """sha256 of the base model's config.json (a local dir, or the HF cache for a hub id)."""
    local = Path(name_or_path) / "config.json"
    if not local.is_file():
        from transformers.utils import cached_file

        resolved = cached_file(name_or_path, "config.json")
        if resolved is None:
            raise KTConfigError(f"{name_or_path}: no config.json found for the base model")
        local = Path(resolved)
    return sha256_file(local)


def _file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(directory: str | os.PathLike, info: KTAdapterInfo, with_trainer_state: bool) -> Path:
    """Hash the adapter files (and the trainer's files when ``with_trainer_state``); write last."""
    directory = Path(directory)
    names = [n for n in ADAPTER_FILES if (directory / n).is_file()]
    missing = sorted(set(ADAPTER_FILES) - set(names))
    if missing:
        raise KTConfigError(f"{directory}: cannot write {MANIFEST_FILE}: {', '.join(missing)} missing")
    if with_trainer_state:
        names += sorted(p.name for p in directory.iterdir() if TRAINER_FILE_PATTERN.fullmatch(p.name))
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kt_ft_version": info.kt_ft_version,
        "base_model": {"name_or_path": info.base_model, "config_sha256": info.base_config_sha256},
        "lora": {"rank": info.rank, "alpha": info.alpha, "use_rslora": info.use_rslora},
        # KT_FT_* switches this process ran with that are not their defaults (kt_ft/base/settings.py)
        "settings": changed(),
        "experts": {
            "layers": info.layers,
            "num_experts": info.num_experts,
            "targets": info.targets,
            "backend": info.backend,
            "rule": info.rule,
            "base_format": info.base_format,
        },
        "files": {n: _file_entry(directory / n) for n in names},
        "fused_tensors": fused_header(directory / FUSED_FILE),
    }
    target = directory / MANIFEST_FILE
    write_json_atomic(target, manifest)
    return target


def _complete_siblings(directory: Path) -> list[str]:
    """Other checkpoint-N dirs beside ``directory`` that hold a manifest (for the error message)."""
    if not CHECKPOINT_DIR.fullmatch(directory.name) or not directory.parent.is_dir():
        return []
    found = [
        p
        for p in directory.parent.iterdir()
        if CHECKPOINT_DIR.fullmatch(p.name) and (p / MANIFEST_FILE).is_file()
    ]
    return [str(p) for p in sorted(found, key=lambda p: int(CHECKPOINT_DIR.fullmatch(p.name).group(1)))]


def read_manifest(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        others = _complete_siblings(directory)
        hint = f"; complete checkpoints here: {', '.join(others)}" if others else ""
        raise KTConfigError(
            f"{path}: missing: the save into {directory} did not finish (killed mid-save?) or was not made by "
            f"kt-ft; kt-ft will not resume from or load an incomplete adapter{hint}"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KTConfigError(f"{path}: unreadable ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise KTConfigError(
            f"{path}: key format/format_version={manifest.get('format')!r}/{manifest.get('format_version')!r}; "
            f"this kt-ft reads {FORMAT!r}/{FORMAT_VERSION}"
        )
    return manifest


def verify_adapter_dir(directory: str | os.PathLike, expected: KTAdapterInfo | None = None) -> dict:
    """Check every file the manifest lists (size, sha256), the fused tensors, and (with
    ``expected``) the base model and LoRA hyper-parameters; raise KTConfigError listing all
    mismatches. Returns the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems = []
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing (listed in {MANIFEST_FILE})")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{path}: size {size} bytes, {MANIFEST_FILE} says {entry['size']} (truncated?)")
        elif (digest := sha256_file(path)) != entry["sha256"]:
            problems.append(
                f"{path}: sha256 {digest[:16]}..., {MANIFEST_FILE} says {entry['sha256'][:16]}..."
            )
    if not problems:
        header = fused_header(directory / FUSED_FILE)
        if header != manifest["fused_tensors"]:
            problems.append(f"{directory / FUSED_FILE}: tensors differ from {MANIFEST_FILE}'s fused_tensors")
    if expected is not None:
        problems += _compare_info(directory, manifest, expected)
    if problems:
        raise KTConfigError(problems)
    return manifest


def _compare_info(directory: Path, manifest: dict, expected: KTAdapterInfo) -> list[str]:
    path = directory / MANIFEST_FILE
    problems = []
    base = manifest["base_model"]
    if base["config_sha256"] != expected.base_config_sha256:
        problems.append(
            f"{path}: base_model.config_sha256={base['config_sha256'][:16]}... (trained on {base['name_or_path']}) "
            f"but the base model {expected.base_model} has config.json sha256 {expected.base_config_sha256[:16]}...: "
            "this adapter belongs to another base model"
        )
    lora = manifest["lora"]
    for key, want in (
        ("rank", expected.rank),
        ("alpha", expected.alpha),
        ("use_rslora", expected.use_rslora),
    ):
        if lora[key] != want:
            problems.append(f"{path}: lora.{key}={lora[key]!r} but this run has {key}={want!r}")
    experts = manifest["experts"]
    if experts["layers"] != expected.layers or experts["num_experts"] != expected.num_experts:
        problems.append(
            f"{path}: experts.layers={experts['layers']} num_experts={experts['num_experts']}, the model has "
            f"layers={expected.layers} num_experts={expected.num_experts}"
        )
    return problems


def info_from_manifest(manifest: dict) -> KTAdapterInfo:
    e = manifest["experts"]
    return KTAdapterInfo(
        base_model=manifest["base_model"]["name_or_path"],
        base_config_sha256=manifest["base_model"]["config_sha256"],
        rank=manifest["lora"]["rank"],
        alpha=manifest["lora"]["alpha"],
        use_rslora=manifest["lora"]["use_rslora"],
        layers=e["layers"],
        num_experts=e["num_experts"],
        targets=e["targets"],
        backend=e["backend"],
        rule=e["rule"],
        kt_ft_version=manifest.get("kt_ft_version", ""),
        base_format=e.get("base_format", ""),
    )


__all__ = [
    "ADAPTER_FILES",
    "MANIFEST_FILE",
    "KTAdapterInfo",
    "base_config_sha256",
    "info_from_manifest",
    "read_manifest",
    "verify_adapter_dir",
    "write_manifest",
]
