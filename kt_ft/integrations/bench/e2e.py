"""`kt-ft bench --parts e2e`: the product path measured: `llamafactory-cli train`, once per system.

What a user runs, at the depth the disk allows: a random-weight model of a real config
(``bench/models.py`` ``MODEL_CONFIGS``; ``--layers`` of its decoder layers, default all), a tokenizer
trained here, and a dataset of long examples (each longer than ``cutoff_len``, so every micro-batch
holds exactly ``cutoff_len`` tokens; ``--e2e-lengths varied``: from about a quarter of ``cutoff_len``
to all of it, as SFT data without packing gives). Each system is one `llamafactory-cli train` process on the
same recipe (LoRA r 8 / alpha 16, ``lora_target: all``, batch 1, gradient accumulation 4, bf16 where
there is a GPU, LLaMA-Factory's default gradient checkpointing, kt-ft's default ``cpu_infer`` unless
``--cpu-infer`` says otherwise), differing only in its kt-ft keys:

- ``peft``: ``use_kt: false`` -- transformers + PEFT as LLaMA-Factory runs them (PEFT 0.18's
  ``lora_target: all`` puts no LoRA on the fused experts; LLaMA-Factory 0.9.5 has no recipe key
  for PEFT's ``target_parameters``, so HF+PEFT with expert LoRA cannot run through it).
- ``kt-cpu:<backend>``: every routed expert on the CPU, computed by ``<backend>``.
- ``kt-auto``, ``kt-auto@<GiB>``: ``placement: auto`` uncapped / under ``kt_gpu_memory``.
- ``kt-stream``: every routed expert streamed to the GPU each time its layer runs.
- ``<kt system>+<format>`` (``kt-auto@24+fp8``, ``kt-cpu:torch+int8``, ...): the same system on a
  copy of the model made by ``kt-ft quantize --format <format>`` (fp8, int8, int4), its routed experts
  kept quantized in RAM and on the GPU.
- ``<kt system>%<SETTING>=<value>`` (``kt-auto%KT_FT_CUDA_GRAPHS=1``): the same system with one of
  kt-ft's registered settings (``kt_ft/base/settings.py``) set for its run: two ways of one mechanism
  measured in one benchmark run.
- ``kt-peer``: KTransformers' own SFT path, the peer: LLaMA-Factory's native ``use_kt`` with
  transformers-kt, accelerate-kt and kt-kernel (``kt_config: {kt_backend: AMXBF16, kt_num_threads}``),
  kt-ft's start-up hook off (``KT_FT_DISABLE=1``). Those packages replace transformers and
  accelerate, so they are installed apart (``pip install --no-deps --target DIR``) and the run gets
  ``DIR`` first on its ``PYTHONPATH`` (``--peer-site``). Every routed expert is on the CPU there.

Measured per run, from outside the process: tokens/s from LLaMA-Factory's own
``trainer_log.jsonl`` (elapsed time of a log line = ``total_tokens / throughput``; the rate is taken
between the first logged step and the last, so the first step's start-up stays out); device peak
as the driver reports it (``nvidia-smi`` polled; context and every allocator included); host peak
as used memory (``MemTotal - MemAvailable``: page cache excluded), and its rise over the idle
machine. For kt-ft runs with ``placement: auto`` the cost model's predicted micro-batch time is
read from the run's log and shown beside the measured one.

``--e2e-rounds N`` runs the list N times, each round in the reverse order of the one before
(A B C, C B A, ...): on a host whose speed drifts from process to process (one H100 host measured
the same non-expert work at 143 and 168 ms a micro-batch in two runs of one call), a system that
always runs first after another is not told apart from the order. Each run is then compared with
the ``peft`` run of its own round, and the table ends with each system's median over the rounds.

Every run keeps its recipe, rule and log under ``--workdir``: ``llamafactory-cli train
WORKDIR/runs/<system>/recipe.yaml`` reruns one system by hand (``<system>-r<N>`` with rounds).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from kt_ft.base import settings
from kt_ft.integrations.bench.models import MODEL_CONFIGS, build_model_dir
from kt_ft.integrations.bench.vl_assets import TEMPLATE as VL_TEMPLATE
from kt_ft.integrations.bench.vl_assets import is_vl, real_layers, write_vl_assets
from kt_ft.integrations.demo.text import train_tokenizer
from kt_ft.integrations.llamafactory.host_time import LINE_PREFIX as HOST_LINE
from kt_ft.plan.family import family_of

GIB = 2**30
DATASET = "kt_e2e"
LORA_RANK, LORA_ALPHA = 8, 16
QUANT_FORMATS = ("fp8", "int8", "int4")  # `kt-ft quantize` formats a `+<format>` system takes
DEFAULT_SYSTEMS = "peft,kt-auto,kt-auto@24,kt-auto@12,kt-stream,kt-cpu:kt-kernel,kt-cpu:torch"
_SYLLABLES = "ka to ri mu se lo na vi pe du shi gor tan bel qua zen".split()


@dataclass(frozen=True)
class System:
    """One `llamafactory-cli train` configuration: ``kind`` peft | cpu | auto | stream | peer."""

    name: str
    kind: str
    backend: str = "auto"
    cap_gib: float | None = None
    quant: str | None = None  # ``+fp8`` etc.: runs on the model's ``kt-ft quantize`` copy
    settings: tuple[tuple[str, str], ...] = ()  # ``%NAME=value`` (one or more): kt-ft settings for this run

    @property
    def use_kt(self) -> bool:
        """kt-ft's keys in the recipe (the peer has LLaMA-Factory's own use_kt keys instead)."""
        return self.kind not in ("peft", "peer")


def parse_systems(text: str) -> list[System]:
    """``peft,kt-cpu:torch,kt-auto,kt-auto@24,kt-stream`` -> systems; an unknown name is an error
    that lists the valid forms."""
    out = []
    for full in (s.strip() for s in text.split(",")):
        if not full:
            continue
        head, *suffixes = full.split("%")
        pairs = []
        for setting in suffixes:
            name, eq, value = setting.partition("=")
            if not eq or name not in settings.SETTINGS or not head.startswith("kt-") or head == "kt-peer":
                raise ValueError(
                    f"--systems: {full!r}: a '%<SETTING>=<value>' suffix takes one of kt-ft's settings "
                    f"({', '.join(settings.SETTINGS)}) after a kt-ft system"
                )
            pairs.append((name, value))
        raw, _, quant = head.partition("+")
        if quant:
            if quant not in QUANT_FORMATS or not raw.startswith("kt-") or raw == "kt-peer":
                raise ValueError(
                    f"--systems: {full!r}: a '+<format>' suffix takes one of {', '.join(QUANT_FORMATS)} "
                    "after a kt-ft system (kt-cpu:<backend>, kt-auto, kt-auto@<GiB>, kt-stream)"
                )
        n = len(out)
        if raw == "peft":
            out.append(System(raw, "peft"))
        elif raw.startswith("kt-cpu:") and raw.split(":", 1)[1]:
            out.append(System(raw, "cpu", backend=raw.split(":", 1)[1]))
        elif raw == "kt-auto":
            out.append(System(raw, "auto"))
        elif re.fullmatch(r"kt-auto@\d+(\.\d+)?", raw):
            out.append(System(raw, "auto", cap_gib=float(raw.split("@")[1])))
        elif raw == "kt-stream":
            out.append(System(raw, "stream"))
        elif raw == "kt-peer":
            out.append(System(raw, "peer"))
        else:
            raise ValueError(
                f"--systems: {raw!r} is not a system; valid: peft, kt-cpu:<backend> (torch, kt-kernel, ...), "
                "kt-auto, kt-auto@<GiB>, kt-stream, kt-peer; a kt-ft system may end in "
                f"+<format> ({', '.join(QUANT_FORMATS)})"
            )
        if quant and len(out) > n:
            out[-1] = replace(out[-1], name=full, quant=quant)
        if pairs and len(out) > n:
            out[-1] = replace(out[-1], name=full, settings=tuple(pairs))
    if not out:
        raise ValueError("--systems: no system named")
    return out


# ---------------------------------------------------------------- assets


def _words(rnd: random.Random, n: int) -> list[str]:
    return ["".join(rnd.choice(_SYLLABLES) for _ in range(rnd.randint(1, 3))) for _ in range(n)]


LENGTHS = ("cutoff", "varied")  # the dataset's example lengths (``write_assets``)


def write_assets(
    workdir: Path,
    preset: str,
    layers: int | None,
    cutoff_len: int,
    examples: int,
    seed: int = 0,
    lengths: str = "cutoff",
) -> tuple[Path, Path, int]:
    """``workdir/model`` (random bf16 weights of ``preset`` at ``layers`` decoder layers, and a
    tokenizer trained here) and ``workdir/data`` (``examples`` alpaca examples, each longer than
    ``cutoff_len`` tokens; ``lengths="varied"``: of uniformly random lengths from about
    ``cutoff_len / 4`` up). Kept and reused when ``workdir/assets.json`` says they match.
    Returns (model dir, data dir, layers)."""
    if lengths not in LENGTHS:
        raise ValueError(f"--e2e-lengths {lengths!r}: valid choices: {', '.join(LENGTHS)}")
    real = real_layers(preset) if is_vl(preset) else MODEL_CONFIGS[preset][1]["num_hidden_layers"]
    layers = real if layers is None else layers
    if not 1 <= layers <= real:
        raise ValueError(f"--layers {layers}: {preset} has {real} decoder layers (valid: 1..{real})")
    model_dir, data_dir = workdir / "model", workdir / "data"
    want = {"preset": preset, "layers": layers, "cutoff_len": cutoff_len, "examples": examples, "seed": seed}
    if lengths != "cutoff":
        want["lengths"] = lengths
    stamp = workdir / "assets.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (model_dir / "config.json").is_file():
        print(f"reusing {model_dir} and {data_dir} ({stamp})")
        return model_dir, data_dir, layers
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    vocab_words = _words(rnd, 4000)
    # ~1.5 tokens a word once the tokenizer has merged the syllables: 2x cutoff words is plenty;
    # the length is checked below with the trained tokenizer
    texts = [" ".join(rnd.choice(vocab_words) for _ in range(2 * cutoff_len)) for _ in range(examples)]
    if is_vl(preset):  # pictures with long answers; the tokenizer and processor of a VL model
        write_vl_assets(workdir, preset, layers, cutoff_len, examples, texts, DATASET, seed)
        stamp.write_text(json.dumps(want))
        return model_dir, data_dir, layers
    # no larger than the model's vocabulary: LLaMA-Factory would resize the embeddings otherwise
    vocab = min(2048, MODEL_CONFIGS[preset][1]["vocab_size"])
    tokenizer = train_tokenizer(texts[:64] + ["user assistant system"], vocab_size=vocab)
    counts = [len(tokenizer(t)["input_ids"]) for t in texts]
    if lengths == "varied":  # each cut to a random cutoff_len / 4 .. cutoff_len tokens (by its words)
        for i, (t, n) in enumerate(zip(texts, counts)):
            words = t.split()
            texts[i] = " ".join(words[: len(words) * rnd.randint(cutoff_len // 4, cutoff_len) // n])
        counts = [len(tokenizer(t)["input_ids"]) for t in texts]
    shortest = min(counts)
    if lengths == "varied":
        print(f"example lengths {shortest}..{max(counts)} tokens (cutoff_len {cutoff_len})")
    elif shortest <= cutoff_len:
        raise RuntimeError(f"generated examples are too short: {shortest} tokens <= cutoff_len {cutoff_len}")
    data_dir.mkdir(parents=True)
    rows = [{"instruction": "Continue the text.", "input": "", "output": t} for t in texts]
    (data_dir / f"{DATASET}.json").write_text(json.dumps(rows))
    (data_dir / "dataset_info.json").write_text(json.dumps({DATASET: {"file_name": f"{DATASET}.json"}}))
    t0 = time.perf_counter()
    build_model_dir(preset, layers, model_dir, seed=seed)
    _point_config_at_tokenizer(model_dir, tokenizer)
    tokenizer.model_max_length = max(cutoff_len * 2, 4096)
    tokenizer.save_pretrained(model_dir)
    print(
        f"wrote {preset} x{layers} layers to {model_dir} in {time.perf_counter() - t0:.0f} s; {examples} examples"
    )
    stamp.write_text(json.dumps(want))
    return model_dir, data_dir, layers


def write_quantized(model_dir: Path, fmt: str) -> Path:
    """``kt-ft quantize --format fmt`` of ``model_dir`` into its sibling ``model-<fmt>`` (rewritten each
    time; quantized on the GPU when there is one). Returns that directory."""
    import torch

    from kt_ft.integrations.export.quantize import (
        quantize_checkpoint,  # why: torch loads only in the child that quantizes
    )

    out = model_dir.parent / f"model-{fmt}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    c = quantize_checkpoint(model_dir, out, fmt, device="cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"wrote {out} (kt-ft quantize --format {fmt}: {c['bytes_in'] / 2**30:.1f} GiB -> "
        f"{c['bytes_out'] / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s"
    )
    return out


def _point_config_at_tokenizer(model_dir: Path, tokenizer) -> None:
    """The config's special token ids are the local tokenizer's (the real ones lie outside its vocab)."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    path.write_text(json.dumps(cfg, indent=2))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        g.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        gen.write_text(json.dumps(g, indent=2))


def write_rule(run_dir: Path, model_dir: Path, system: System) -> Path | None:
    """The optimize rule of ``system`` (None: the family's built-in rule, all experts on the CPU)
    for the model written to ``model_dir`` (its family from its config: hand-written or derived)."""
    if system.kind not in ("auto", "stream"):
        return None
    from transformers import AutoConfig

    family = family_of(AutoConfig.from_pretrained(model_dir))
    place = {"placement": "auto"} if system.kind == "auto" else {"stream": "all"}
    rule = [
        {"include": family.builtin_rule},
        {"match": {"class": family.experts_class}, "replace": {"device": "cpu", "backend": "auto", **place}},
    ]
    path = run_dir / "rule.yaml"
    path.write_text(yaml.safe_dump(rule, sort_keys=False))
    return path


def write_recipe(
    run_dir: Path,
    system: System,
    *,
    model_dir: Path,
    data_dir: Path,
    preset: str,
    cutoff_len: int,
    steps: int,
    grad_accum: int,
    threads: int,
    bf16: bool,
    cpu_infer: int | None = None,
) -> Path:
    """``run_dir/recipe.yaml``: the common recipe plus ``system``'s kt-ft keys."""
    recipe = {
        "model_name_or_path": str(model_dir),
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_target": "all",
        "dataset_dir": str(data_dir),
        "dataset": DATASET,
        "template": VL_TEMPLATE if is_vl(preset) else "qwen",
        "cutoff_len": cutoff_len,
        "overwrite_cache": True,
        "preprocessing_num_workers": max(1, min(8, threads)),
        "dataloader_num_workers": 0,
        "output_dir": str(run_dir / "output"),
        "logging_steps": 1,
        "save_steps": 10 * steps + 10,  # no checkpoint inside the timed steps (the final save comes after)
        "overwrite_output_dir": True,
        "plot_loss": False,
        "report_to": "none",
        "include_num_input_tokens_seen": True,  # LF's trainer_log.jsonl then has total_tokens / throughput
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": grad_accum,
        "learning_rate": 1.0e-4,
        "max_steps": steps,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "seed": 42,
        "bf16": bf16,
    }
    if system.kind == "peer":
        # LLaMA-Factory 0.9.5's own keys: transformers-kt's TrainingArguments takes ``kt_config``
        # (kt_kernel.sft.config.KTConfig fields); LF itself passes lora_rank / alpha and cutoff_len.
        # kt-kernel's default activation policy recomputes the GPU part under non-reentrant
        # checkpointing only (with LF's default, reentrant, it stops: "activation_policy.gpu=recompute
        # requires non-reentrant gradient checkpointing with the KT context_fn")
        recipe.update(
            use_kt=True,
            kt_config={"kt_backend": "AMXBF16", "kt_num_threads": cpu_infer or threads},
            use_reentrant_gc=False,
        )
    if system.use_kt:
        recipe.update(use_kt=True, chunk_size=cutoff_len, kt_backend=system.backend)
        if cpu_infer is not None:  # else kt-ft's default, as a recipe without the key gets
            recipe["cpu_infer"] = cpu_infer
        rule = write_rule(run_dir, model_dir, system)
        if rule is not None:
            recipe["kt_optimize_rule"] = str(rule)
        if system.cap_gib is not None:
            recipe["kt_gpu_memory"] = system.cap_gib
    path = run_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# ---------------------------------------------------------------- measuring a run


def host_used_bytes() -> int:
    """MemTotal - MemAvailable from /proc/meminfo (what ``free`` calls used; page cache excluded)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


# the line LLaMA-Factory's trainer logs when training starts (the model is loaded by then)
TRAIN_START = "***** Running training *****"


class Monitor:
    """Polls the device memory the driver reports (``nvidia-smi``, GPU ``gpu_index``) and host used
    memory while a run lasts; keeps the peaks (bytes), and the GPU's mean utilization (the driver's
    share of time a kernel ran) once training started (``gpu_util``: near 100 a run waits on the
    GPU, well under it on the host). With ``log_path``, the host peak is also
    kept for the time before ``TRAIN_START`` appears in that log (``host_peak_load``: loading and
    preparing the model, where a second copy of weights would show) and a timeline of host used
    memory, one sample a second, goes to ``timeline_path`` (CSV: seconds, GiB, phase)."""

    def __init__(
        self,
        gpu_index: str | None,
        interval_s: float = 0.2,
        log_path: Path | None = None,
        timeline_path: Path | None = None,
    ) -> None:
        self.gpu_index, self.interval_s = gpu_index, interval_s
        self.log_path, self.timeline_path = log_path, timeline_path
        self.gpu_peak: int | None = None
        self.host_peak = 0
        self.host_peak_load = 0
        self.training = False
        self._util: list[int] = []  # utilization.gpu samples (percent) while training
        self._log_offset = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._smi: subprocess.Popen | None = None

    def __enter__(self) -> Monitor:
        self._threads.append(threading.Thread(target=self._poll_host, daemon=True))
        if self.gpu_index is not None and shutil.which("nvidia-smi"):
            ms = str(max(50, int(self.interval_s * 1000)))
            self._smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits",
                 "-i", self.gpu_index, "-lms", ms],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            self._threads.append(threading.Thread(target=self._read_smi, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def _training_started(self) -> bool:
        """Whether TRAIN_START is in the log yet (read on from where the last look stopped)."""
        if self.training or self.log_path is None:
            return self.training
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(max(0, self._log_offset - len(TRAIN_START)))
                text = f.read()
                self._log_offset = f.tell()
        except OSError:
            return False
        self.training = TRAIN_START in text
        return self.training

    def _poll_host(self) -> None:
        t0, last = time.perf_counter(), -1.0
        out = open(self.timeline_path, "w") if self.timeline_path is not None else None
        try:
            if out is not None:
                out.write("seconds,host_used_gib,phase\n")
            while not self._stop.is_set():
                used = host_used_bytes()
                self.host_peak = max(self.host_peak, used)
                training = self._training_started()
                if not training:
                    self.host_peak_load = max(self.host_peak_load, used)
                now = time.perf_counter() - t0
                if out is not None and now - last >= 1.0:
                    out.write(f"{now:.1f},{used / GIB:.2f},{'train' if training else 'load'}\n")
                    out.flush()
                    last = now
                self._stop.wait(self.interval_s)
        finally:
            if out is not None:
                out.close()

    def _read_smi(self) -> None:
        assert self._smi is not None and self._smi.stdout is not None
        for line in self._smi.stdout:
            try:
                mib, util = (int(v) for v in line.strip().split(","))
            except ValueError:
                continue
            used = mib * 2**20
            self.gpu_peak = used if self.gpu_peak is None else max(self.gpu_peak, used)
            if self.training:
                self._util.append(util)

    @property
    def gpu_util(self) -> float | None:
        """Mean GPU utilization (percent) over the samples taken while training, or None."""
        return sum(self._util) / len(self._util) if self._util else None

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait()
        for t in self._threads:
            t.join(timeout=5)


@dataclass
class E2ERecord:
    system: str
    preset: str
    layers: int
    rc: int
    seconds: float  # wall time of the whole process (load, train, save)
    steps_logged: int = 0
    tokens_per_step: float | None = None
    tok_s: float | None = None  # between the first and the last logged step
    # over the last half of the steps: a placement: auto run settles its split in its first steps
    # (calibration, trial: placement/runtime.py), a long run runs at this rate
    tok_s_last_half: float | None = None
    step_s: list[float] = field(default_factory=list)  # per optimizer step after the first
    first_loss: float | None = None
    losses: list[float] = field(default_factory=list)  # each logged step's (LF's trainer_log.jsonl)
    gpu_peak_bytes: int | None = None
    host_peak_bytes: int = 0
    host_rise_bytes: int = 0
    # host peak before LF's trainer started (load and preparation); 0 where it never started
    host_peak_load_bytes: int = 0
    predicted_micro_s: float | None = None  # cost model: one micro-batch (placement: auto)
    # the CPU expert op's wall time a micro-batch, all layers, as the run's summary line states it
    # (over every micro-batch of the run; ``--parts op`` times one layer's op at the same shape)
    cpu_op_micro_s: float | None = None
    cap_gib: float | None = None
    grad_accum: int = 1  # micro-batches an optimizer step
    note: str = ""
    round: int = 1  # ``--e2e-rounds``: which pass over the systems (1-based)
    # ``KT_FT_HOST_TIME``'s line (``llamafactory/host_time.py``): median wall ms a step and the main
    # thread's CPU ms in it, unprofiled
    host_step_ms: float | None = None
    host_main_ms: float | None = None
    host_line: str = ""
    gpu_util: float | None = None  # mean GPU utilization while training, percent (``Monitor``)
    # a run that streamed experts: the tokens/s its link allows at most (``link_bound``)
    link_bound_tok_s: float | None = None

    @property
    def measured_micro_s(self) -> float | None:
        """Measured seconds a micro-batch: the optimizer step over its micro-batches."""
        if not self.step_s or self.tok_s is None or not self.tokens_per_step:
            return None
        return self.tokens_per_step / self.tok_s / self.grad_accum


def read_trainer_log(path: Path) -> list[dict]:
    """LLaMA-Factory's trainer_log.jsonl lines of training steps (a loss) that carry tokens
    (``include_num_input_tokens_seen``); the summary line at the end of training has no loss."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r and "total_tokens" in r and r.get("throughput")]


def rate_from_log(
    rows: list[dict], skip_step: int | None = None
) -> tuple[float | None, list[float], float | None]:
    """(tokens/s over the logged steps after the first, seconds of each of those steps, tokens per
    step). Elapsed time at a log line = total_tokens / throughput (LF's own figures).
    ``skip_step``: an optimizer step (1-based) left out of the rate (the profiled one)."""
    if len(rows) < 2:
        return None, [], None
    t = [r["total_tokens"] / r["throughput"] for r in rows]
    tok = [r["total_tokens"] for r in rows]
    steps = [b - a for a, b in zip(t, t[1:])]
    pairs = [
        (tok[i + 1] - tok[i], steps[i])
        for i in range(len(steps))
        if rows[i + 1].get("current_steps") != skip_step
    ]
    secs = sum(s for _, s in pairs)
    rate = sum(n for n, _ in pairs) / secs if pairs and secs > 0 else None
    per_step = (tok[-1] - tok[0]) / (len(rows) - 1)
    return rate, steps, per_step


def last_half_rate(rows: list[dict], skip_step: int | None = None) -> float | None:
    """Tokens/s over the last half (rounded up) of the logged steps after the first, ``skip_step``
    left out (as ``rate_from_log``)."""
    half = len(rows) - 1 - (len(rows) - 1) // 2
    return rate_from_log(rows[-half - 1 :], skip_step)[0] if half > 0 else None


_PREDICTED = re.compile(r"predicted step ([0-9.]+) ms")
_CPU_OP = re.compile(r"CPU op busy ([0-9.]+) s in")
_STREAMED = re.compile(r"run summary: streamed ([0-9.]+) (GiB|MiB) in")
_LINK = re.compile(r"\blink ([0-9.]+) GB/s")
_HOST = re.compile(
    rf"({re.escape(HOST_LINE)} .*?: wall ([0-9]+) ms; CPU busy: main thread ([0-9]+) ms.*)$", re.M
)


def link_bound(text: str, steps: int, tokens_per_step: float | None) -> float | None:
    """The tokens/s a run that streamed experts cannot beat: its bytes streamed a step (the run
    summary's total over its ``steps`` optimizer steps) at the host -> GPU rate it planned with (the
    log's ``link ... GB/s``), every other cost hidden under the copies. None where nothing streamed."""
    streamed, link = _STREAMED.findall(text), _LINK.findall(text)
    if not streamed or not link or not steps or not tokens_per_step:
        return None
    value, unit = streamed[-1]
    per_step = float(value) * (2**30 if unit == "GiB" else 2**20) / steps
    if per_step <= 0:
        return None
    return tokens_per_step / (per_step / (float(link[-1]) * 1e9))


def llamafactory_cli() -> str:
    """The ``llamafactory-cli`` on PATH, else the one beside this Python."""
    return shutil.which("llamafactory-cli") or str(Path(sys.executable).with_name("llamafactory-cli"))


def lf_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, offline (no hub), plus ``extra``: what each LF run gets."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(extra or {})}


def run_system(
    system: System,
    recipe: Path,
    run_dir: Path,
    *,
    preset: str,
    layers: int,
    grad_accum: int,
    gpu_index: str | None,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> E2ERecord:
    """One `llamafactory-cli train recipe` in its own process, measured from outside."""
    cli = llamafactory_cli()
    log_path = run_dir / "train.log"
    idle = host_used_bytes()
    t0 = time.perf_counter()
    with (
        open(log_path, "w") as log,
        Monitor(gpu_index, log_path=log_path, timeline_path=run_dir / "host_memory.csv") as mon,
    ):
        proc = subprocess.Popen(
            [cli, "train", str(recipe)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=lf_env(env),
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            rc = rc if rc else -9
    seconds = time.perf_counter() - t0
    rows = read_trainer_log(run_dir / "output" / "trainer_log.jsonl")
    skip = int(settings.get("KT_FT_PROFILE_STEP")) if (env or {}).get("KT_FT_PROFILE") else None
    rate, steps, per_step = rate_from_log(rows, skip_step=skip)
    text = log_path.read_text(errors="replace")
    pred = _PREDICTED.findall(text)
    op = _CPU_OP.findall(text)
    host = _HOST.findall(text)
    rec = E2ERecord(
        system=system.name,
        preset=preset,
        layers=layers,
        rc=rc,
        seconds=seconds,
        steps_logged=len(rows),
        tokens_per_step=per_step,
        tok_s=rate,
        tok_s_last_half=last_half_rate(rows, skip),
        step_s=steps,
        first_loss=rows[0].get("loss") if rows else None,
        losses=[r["loss"] for r in rows],
        gpu_peak_bytes=mon.gpu_peak,
        gpu_util=mon.gpu_util,
        host_peak_bytes=mon.host_peak,
        host_rise_bytes=max(0, mon.host_peak - idle),
        host_peak_load_bytes=mon.host_peak_load if mon.training else 0,
        predicted_micro_s=float(pred[-1]) / 1e3 if pred else None,
        cpu_op_micro_s=float(op[-1]) / (len(rows) * grad_accum) if op and rows else None,
        cap_gib=system.cap_gib,
        grad_accum=grad_accum,
    )
    rec.link_bound_tok_s = link_bound(text, len(rows), per_step)
    if host:
        rec.host_line, wall, main = host[-1]
        rec.host_step_ms, rec.host_main_ms = float(wall), float(main)
    if rc != 0:
        rec.note = f"exit {rc}: " + _failure(text)
    elif rate is None:
        rec.note = "fewer than two logged steps: no rate"
    return rec


def _failure(text: str) -> str:
    """The last error line of a failed run's log."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|error:|Killed|Traceback)", ln)]
    return (errs[-1] if errs else (lines[-1] if lines else "no output"))[:300]


# ---------------------------------------------------------------- the benchmark


def run_e2e(
    *,
    preset: str,
    layers: int | None,
    systems: list[System],
    workdir: Path,
    cutoff_len: int = 2048,
    steps: int = 5,
    grad_accum: int = 4,
    threads: int,
    cpu_infer: int | None = None,
    timeout_s: float = 900,
    json_path: str | None = None,
    keep_model: bool = True,
    peer_site: str | None = None,
    lengths: str = "cutoff",
    rounds: int = 1,
) -> list[E2ERecord]:
    """Write the assets, run every system (one process each; ``rounds`` passes over them, each in
    the reverse order of the one before), print the table. ``peer_site``: the directory holding
    transformers-kt, accelerate-kt and kt-kernel for ``kt-peer``."""
    if rounds < 1:
        raise ValueError(f"--e2e-rounds {rounds}: at least 1")
    import torch

    if any(s.kind == "peer" for s in systems) and not (peer_site and Path(peer_site).is_dir()):
        raise ValueError(
            f"--peer-site {peer_site!r}: kt-peer needs a directory holding transformers-kt, accelerate-kt "
            "and kt-kernel (pip install --no-deps --target DIR ...); drop kt-peer from --e2e-systems otherwise"
        )
    cuda = torch.cuda.is_available()
    # the runs' GPU as nvidia-smi names it: CUDA_VISIBLE_DEVICES's first entry (an index or a UUID)
    gpu_index = (os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0") if cuda else None
    examples = steps * grad_accum + 8
    args = (workdir, preset, layers, cutoff_len, examples, 0, lengths)
    if cuda:
        # in a child process: the model is built on the GPU, and the CUDA context (~0.6 GiB on an
        # H200) leaves with the child, so what the driver reports during the runs is theirs alone
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            model_dir, data_dir, layers = pool.apply(write_assets, args)
            quant_dirs = {q: pool.apply(write_quantized, (model_dir, q)) for q in _quants(systems)}
    else:
        model_dir, data_dir, layers = write_assets(*args)
        quant_dirs = {q: write_quantized(model_dir, q) for q in _quants(systems)}
    records = []
    prof_root = settings.get("KT_FT_PROFILE")
    runnable = []
    for system in systems:
        if not cuda and system.kind in ("auto", "stream", "peer"):
            print(f"skipping {system.name}: needs a CUDA GPU")
        else:
            runnable.append(system)
    for rnd, system in run_order(runnable, rounds):
        run_dir = workdir / "runs" / re.sub(r"[^\w.+-]", "-", system.name.replace("@", "-at-"))
        if rounds > 1:
            run_dir = run_dir.with_name(f"{run_dir.name}-r{rnd}")
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        recipe = write_recipe(
            run_dir, system, model_dir=quant_dirs.get(system.quant, model_dir), data_dir=data_dir, preset=preset, cutoff_len=cutoff_len,
            steps=steps, grad_accum=grad_accum, threads=threads, bf16=cuda, cpu_infer=cpu_infer,
        )  # fmt: skip
        print(f"[{system.name}] llamafactory-cli train {recipe}", flush=True)
        # KT_FT_PROFILE=DIR for the bench: each run profiles one step into DIR/<system> (that step
        # is left out of its rate; kt_ft/integrations/llamafactory/profile.py)
        env = {"KT_FT_PROFILE": str(Path(prof_root) / run_dir.name)} if prof_root else {}
        env["KT_FT_HOST_TIME"] = "1"  # every system's host time a step, unprofiled (``host_time.py``)
        env.update(dict(system.settings))
        if system.kind == "peer":
            path = os.pathsep.join(p for p in (str(peer_site), os.environ.get("PYTHONPATH", "")) if p)
            env = {"PYTHONPATH": path, "KT_FT_DISABLE": "1"}
        rec = run_system(
            system, recipe, run_dir, preset=preset, layers=layers, grad_accum=grad_accum,
            gpu_index=gpu_index, timeout_s=timeout_s, env=env,
        )  # fmt: skip
        rec.round = rnd
        print(f"[{system.name}] {_one_line(rec)}", flush=True)
        records.append(rec)
        if json_path:
            write_json(json_path, records, cutoff_len, grad_accum, threads)
        # the adapters (tens of MB each) are not read: keep LF's log, drop the rest
        log = run_dir / "output" / "trainer_log.jsonl"
        if log.is_file():
            shutil.copy(log, run_dir / "trainer_log.jsonl")
        shutil.rmtree(run_dir / "output", ignore_errors=True)
    print_table(records, cutoff_len, grad_accum)
    if not keep_model:
        for d in (model_dir, *quant_dirs.values()):
            shutil.rmtree(d, ignore_errors=True)
    return records


def run_order(systems: list, rounds: int) -> list[tuple[int, object]]:
    """(round, system) in run order: ``rounds`` passes over ``systems``, each in the reverse order
    of the one before (1-based rounds)."""
    out = []
    for rnd in range(1, rounds + 1):
        out += [(rnd, s) for s in (systems if rnd % 2 else systems[::-1])]
    return out


def _quants(systems: list[System]) -> list[str]:
    """The formats the systems' ``+<format>`` suffixes name, each once."""
    return sorted({s.quant for s in systems if s.quant})


def _one_line(r: E2ERecord) -> str:
    tok = f"{r.tok_s:,.0f} tok/s" if r.tok_s else "no rate"
    gpu = f", GPU peak {r.gpu_peak_bytes / GIB:.1f} GiB" if r.gpu_peak_bytes else ""
    load = f" (before training {r.host_peak_load_bytes / GIB:.1f})" if r.host_peak_load_bytes else ""
    op = f", CPU op {r.cpu_op_micro_s * 1e3:.0f} ms a micro-batch" if r.cpu_op_micro_s else ""
    util = f", GPU busy {r.gpu_util:.0f}%" if r.gpu_util is not None else ""
    if r.link_bound_tok_s:
        reached = f", {r.tok_s / r.link_bound_tok_s:.0%} of it" if r.tok_s else ""
        util += f", link bound {r.link_bound_tok_s:,.0f} tok/s{reached}"
    host = f"; {r.host_line}" if r.host_line else ""
    return (
        f"rc {r.rc}, {tok}{gpu}{util}, host peak {r.host_peak_bytes / GIB:.1f} GiB{load}{op}, {r.seconds:.0f} s "
        f"{r.note}{host}"
    )


def write_json(path: str, records: list[E2ERecord], cutoff_len: int, grad_accum: int, threads: int) -> None:
    import platform

    import torch

    meta = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "threads": threads,
            "cutoff_len": cutoff_len, "gradient_accumulation_steps": grad_accum}  # fmt: skip
    if torch.cuda.is_available() and shutil.which("nvidia-smi"):  # the driver's word: no CUDA context here
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        meta["gpu"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
    for mod in ("transformers", "peft", "llamafactory"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (absent or broken: the file says so)
            meta[mod] = None
    rows = []
    for r in records:
        row = asdict(r)
        row["measured_micro_s"] = r.measured_micro_s
        rows.append(row)
    Path(path).write_text(json.dumps({"meta": meta, "records": rows}, indent=1))


def loss_agreement(records: list[E2ERecord]) -> tuple[str, float, int] | None:
    """(reference system, largest relative loss difference, steps compared) of the kt-ft systems'
    losses step by step against the first kt-ft system that logged any; None: fewer than two.

    Every kt-ft placement trains the same adapter from the same initialisation, so past the first
    step too their losses differ only by the placements' arithmetic (bf16 on the GPU, the CPU op's
    order of summation), amplified a little by the optimizer; a cache that kept an old LoRA, or a
    placement that trains something else, shows here as a difference that grows with the steps."""
    kt = [r for r in records if r.system.startswith("kt-") and r.system != "kt-peer" and r.losses]
    if len(kt) < 2:
        return None
    ref, worst, steps = kt[0], 0.0, 0
    for r in kt[1:]:
        n = min(len(r.losses), len(ref.losses))
        steps = max(steps, n)
        for a, b in zip(r.losses[:n], ref.losses[:n]):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return ref.system, worst, steps


def print_table(records: list[E2ERecord], cutoff_len: int, grad_accum: int) -> None:
    if not records:
        return
    r0 = records[0]
    rounds = max(r.round for r in records)

    def base_of(rec: E2ERecord) -> E2ERecord | None:  # the peft run of its round, else the first one
        peft = [r for r in records if r.system == "peft" and r.tok_s]
        return next((r for r in peft if r.round == rec.round), peft[0] if peft else None)

    print(
        f"\nllamafactory-cli train, {r0.preset} x{r0.layers} layers, cutoff_len {cutoff_len}, batch 1 x "
        f"{grad_accum} accumulation; tokens/s between the first and last logged steps (LF's trainer_log.jsonl)"
    )
    head = f"{'system':<20}" + (f"{'round':>6}" if rounds > 1 else "")
    head += f"{'tok/s':>9}{'x peft':>8}{'last half':>10}{'GPU peak':>10}{'x peft':>8}"
    head += f"{'host peak':>11}{'host rise':>11}"
    head += f"{'ms/micro':>10}{'predicted':>11}{'host main':>10}{'GPU busy':>9}{'loss 1':>9}"
    print(head)
    for r in records:
        base = base_of(r)
        tok = f"{r.tok_s:,.0f}" if r.tok_s else "-"
        half = f"{r.tok_s_last_half:,.0f}" if r.tok_s_last_half else "-"
        xs = f"{r.tok_s / base.tok_s:.2f}" if base and r.tok_s else "-"
        gpu = f"{r.gpu_peak_bytes / GIB:.2f}G" if r.gpu_peak_bytes else "-"
        xg = (
            f"{r.gpu_peak_bytes / base.gpu_peak_bytes:.2f}"
            if base and base.gpu_peak_bytes and r.gpu_peak_bytes
            else "-"
        )
        meas = f"{r.measured_micro_s * 1e3:.0f}" if r.measured_micro_s else "-"
        pred = f"{r.predicted_micro_s * 1e3:.0f}" if r.predicted_micro_s else "-"
        loss = f"{r.first_loss:.4f}" if r.first_loss is not None else "-"
        # the main thread's CPU ms a step over the step's wall ms (``host_time.py``)
        hm = f"{r.host_main_ms / r.host_step_ms:.0%}" if r.host_main_ms and r.host_step_ms else "-"
        busy = f"{r.gpu_util:.0f}%" if r.gpu_util is not None else "-"
        rnd = f"{r.round:>6}" if rounds > 1 else ""
        print(
            f"{r.system:<20}{rnd}{tok:>9}{xs:>8}{half:>10}{gpu:>10}{xg:>8}{r.host_peak_bytes / GIB:>10.1f}G"
            f"{r.host_rise_bytes / GIB:>10.1f}G{meas:>10}{pred:>11}{hm:>10}{busy:>9}{loss:>9}"
            + (f"  {r.note}" if r.note else "")
        )
    bound = [r for r in records if r.link_bound_tok_s]
    if bound:
        print("link bounds (a run's bytes streamed a step at its planned host -> GPU rate):")
        for r in bound:
            reached = f", {r.tok_s / r.link_bound_tok_s:.0%} reached" if r.tok_s else ""
            print(f"  {r.system:<30} {r.link_bound_tok_s:,.0f} tok/s{reached}")
    if rounds > 1:
        print(median_summary(records))
    agree = loss_agreement(records)
    if agree is not None:
        ref, worst, steps = agree
        print(
            f"kt-ft systems' losses over {steps} logged steps: at most {worst:.2e} relative from {ref}'s "
            "(the same adapter from the same start: placement arithmetic only)"
        )


def median_summary(records: list[E2ERecord]) -> str:
    """Each system's median tokens/s over its rounds (its range), and the ratio of that median to
    peft's; the GPU peak as its largest."""
    import statistics

    names = list(dict.fromkeys(r.system for r in records))
    rates = {n: [r.tok_s for r in records if r.system == n and r.tok_s] for n in names}
    peft = statistics.median(rates["peft"]) if rates.get("peft") else None
    lines = ["medians over the rounds:"]
    for n in names:
        if not rates[n]:
            lines.append(f"  {n:<30} no rate")
            continue
        med = statistics.median(rates[n])
        ratio = f", {med / peft:.2f}x peft's median" if peft else ""
        peaks = [r.gpu_peak_bytes for r in records if r.system == n and r.gpu_peak_bytes]
        gpu = f", GPU peak up to {max(peaks) / GIB:.2f}G" if peaks else ""
        lines.append(
            f"  {n:<30} {med:,.0f} tok/s ({min(rates[n]):,.0f}-{max(rates[n]):,.0f}, {len(rates[n])} runs){ratio}{gpu}"
        )
    return "\n".join(lines)
