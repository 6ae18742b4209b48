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
  measured in one benchmark run (``kt-auto%KT_FT_FUSIONS=none``: without kt-ft's fused non-expert
  paths; a list's names joined by ``+``, ``%KT_FT_FUSIONS=rope+loss``, as commas separate systems).
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

The part's modules: ``e2e_systems`` (the systems and their recipes), ``e2e_assets`` (model,
tokenizer, data), ``e2e_run`` (one system's run), measured by ``e2e_monitor`` (memory, GPU use)
and ``e2e_logs`` (LF's and kt-ft's log lines), reported by ``e2e_report`` (table, JSON); this one
runs the list.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

from kt_ft.base import settings
from kt_ft.integrations.bench.e2e_assets import write_assets, write_quantized

# tests/test_host_time.py reads the host-time line's pattern from here
from kt_ft.integrations.bench.e2e_logs import _HOST  # noqa: F401
from kt_ft.integrations.bench.e2e_report import one_line, print_table, write_json
from kt_ft.integrations.bench.e2e_run import E2ERecord, run_system
from kt_ft.integrations.bench.e2e_systems import System, write_recipe
from kt_ft.integrations.bench.real_width import REAL_WIDTH


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
    prof_root = settings.profile()
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
            steps=steps, grad_accum=grad_accum, threads=threads, bf16=cuda or preset in REAL_WIDTH,
            cpu_infer=cpu_infer,
        )  # fmt: skip
        print(f"[{system.name}] llamafactory-cli train {recipe}", flush=True)
        # KT_FT_PROFILE=DIR for the bench: each run profiles one step into DIR/<system> (that step
        # is left out of its rate; kt_ft/integrations/trainer/profile.py), the options kept
        env = {}
        if prof_root is not None:
            own = replace(prof_root, directory=str(Path(prof_root.directory) / run_dir.name))
            env["KT_FT_PROFILE"] = own.value()
        # every system's host time a step, unprofiled, logged at its end (``host_time.py``); the memory
        # records of a kt-ft run's ranks beside it (``runtime/memory.py``)
        env["KT_FT_RUN_REPORT"] = str(run_dir / "report")
        env.update(dict(system.settings))
        if system.kind == "peer":
            path = os.pathsep.join(p for p in (str(peer_site), os.environ.get("PYTHONPATH", "")) if p)
            env = {"PYTHONPATH": path, "KT_FT_DISABLE": "1"}
        rec = run_system(
            system, recipe, run_dir, preset=preset, layers=layers, grad_accum=grad_accum,
            gpu_index=gpu_index, timeout_s=timeout_s, env=env,
        )  # fmt: skip
        rec.round = rnd
        print(f"[{system.name}] {one_line(rec)}", flush=True)
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
