"""LLaMA-Factory end to end: a model type's demo trains through ``llamafactory-cli train`` with the
same losses with kt-ft (``use_kt: true``) as without (``use_kt: false``).

``lf_parity(model_type, workdir)`` makes the type's demo (``make_demo_model``: tiny config, tokenizer,
dataset; ``sharpen_demo`` makes its loss depend on the experts), writes two recipes that differ only in ``use_kt`` (fp32, learning rate 0, seed 42, a few
steps), runs both as ``llamafactory-cli train`` subprocesses -- what users run -- side by side, and
compares the per-step losses LLaMA-Factory logs (``trainer_log.jsonl``) within ``LOSS_RTOL``.
``kt-ft models --lf`` puts the result in docs/models.md.

Why learning rate 0: every step then runs the same weights on a new batch, so a step's loss
difference is one forward's (kt-ft's CPU op sums the experts in another order than transformers;
the probe's logits differ by ~1e-7) and does not grow with the step count as it would if the two
runs' weights drifted apart through the optimizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kt_ft.integrations.demo.text import make_demo_model, randomize_routing
from kt_ft.plan.family import family_of
from kt_ft.plan.interface import interface_experts
from kt_ft.plan.tiny import tiny_config

# fp32 losses (~10 on the sharpened demo) of one forward each: fp32 rounds a loss to ~6e-8
# relative and the probe's kt-ft-vs-eager logits differ by ~1e-7 absolute, so equal experts give
# <= ~1e-7; 1e-6 leaves 10x for summation order, while scaling every expert's output by 1.01
# moves the sharpened demo's loss by 6e-6 to 8e-5 (measured on dots1, gemma4_text, qwen3_next).
LOSS_RTOL = 1e-6
# A random demo's logits are near-uniform (lm_head std 0.02): its loss is ~ln(vocab) whatever the
# experts compute (a 1% change of every expert moved it by < 1e-6). Larger lm_head and experts
# make the loss depend on them (see LOSS_RTOL); routers get random values as in the probe.
HEAD_SCALE = 20.0
EXPERT_SCALE = 2.0
STEPS = 3
FALLBACK_TEMPLATE = "qwen"  # the demo tokenizer's own (ChatML) tokens
RUN_TIMEOUT_S = 900
# Demos are made one at a time (`kt-ft models --lf-jobs`): their weights come from torch's global
# seed, which concurrent makers would interleave.
_DEMO_LOCK = threading.Lock()


@dataclass
class LfCheck:
    status: str  # "pass" | "fail" | "LF cannot train" | "not run"
    detail: str = ""
    template: str = ""  # the LLaMA-Factory template the runs used
    template_note: str = ""  # why it is not the type's own
    seconds: float = 0.0

    def cell(self) -> str:
        """The docs/models.md cell: status, the template used and why it failed / what was compared."""
        parts = [self.status]
        if self.template:
            note = f" ({self.template_note})" if self.template_note else ""
            parts.append(f"template `{self.template}`{note}")
        if self.detail:
            parts.append(self.detail)
        return "; ".join(parts)


def demo_template(family_template: str) -> tuple[str, str]:
    """(LLaMA-Factory template for the demo, why it is not the family's own -- "" when it is).

    The family's template is what its checkpoints are trained with; the demo tokenizer carries its
    stop words (``demo.template_stop_words``). A template with a multimodal plugin needs the
    checkpoint's processor, which a demo (a tokenizer only) has not: ``qwen`` is used instead."""
    if not family_template:
        return FALLBACK_TEMPLATE, "no template known for the type"
    from llamafactory.data.template import TEMPLATES  # why: optional dependency (LLaMA-Factory)

    plugin = TEMPLATES[family_template].mm_plugin
    if any(getattr(plugin, t, None) for t in ("image_token", "video_token", "audio_token")):
        return FALLBACK_TEMPLATE, f"`{family_template}` needs a processor (multimodal plugin)"
    return family_template, ""


def sharpen_demo(model_dir: Path, head_scale: float = HEAD_SCALE, expert_scale: float = EXPERT_SCALE) -> None:
    """Rewrite the demo model so its loss depends on what the experts compute (see HEAD_SCALE):
    random routers, lm_head x ``head_scale``, every routed-experts tensor x ``expert_scale``."""

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    randomize_routing(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
        for _, experts in interface_experts(model):
            for p in experts.parameters():
                p.mul_(expert_scale)
    model.save_pretrained(model_dir)


def recipe(demo: Path, out: Path, template: str, use_kt: bool, steps: int = STEPS) -> dict:
    """The LF recipe of one run: LoRA on every linear (kt-ft adds expert LoRA), fp32, learning
    rate 0, no checkpoint saves; only ``use_kt`` (and kt-ft's CPU threads) differs between runs."""
    args = dict(
        model_name_or_path=str(demo / "model"),
        stage="sft",
        do_train=True,
        finetuning_type="lora",
        lora_rank=8,
        lora_target="all",
        use_kt=use_kt,
        dataset_dir=str(demo / "data"),
        dataset="kt_demo",
        template=template,
        cutoff_len=128,
        overwrite_cache=True,
        preprocessing_num_workers=1,
        dataloader_num_workers=0,
        output_dir=str(out),
        overwrite_output_dir=True,
        logging_steps=1,
        save_strategy="no",
        plot_loss=False,
        report_to="none",
        per_device_train_batch_size=8,
        learning_rate=0.0,
        max_steps=steps,
        lr_scheduler_type="constant",
        seed=42,
        bf16=False,
        fp16=False,
    )
    if use_kt:
        args["cpu_infer"] = 1  # two runs share the cores
    return args


def llamafactory_cli() -> str:
    """``llamafactory-cli`` of this Python's environment (else the one on PATH)."""
    beside = Path(sys.executable).with_name("llamafactory-cli")
    found = str(beside) if beside.is_file() else shutil.which("llamafactory-cli")
    if not found:
        raise FileNotFoundError("llamafactory-cli not found beside this Python or on PATH")
    return found


def start_run(args: dict, directory: Path, name: str) -> subprocess.Popen:
    """Write ``directory/name.yaml`` (a recipe the user can rerun) and start ``llamafactory-cli
    train`` on it, output to ``directory/name.log``."""
    import yaml

    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(args, sort_keys=False))
    log = open(directory / f"{name}.log", "w")  # noqa: SIM115 - closed by wait_run
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(
        [llamafactory_cli(), "train", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    proc.log_file = log
    return proc


def wait_run(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    """(exit status, log text); a run past ``timeout`` is killed (status -9)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    proc.log_file.close()
    return rc, Path(proc.log_file.name).read_text(errors="replace")


def read_losses(out: Path) -> list[float]:
    """Per-step training losses LLaMA-Factory logged (``trainer_log.jsonl``, logging_steps 1)."""
    path = out / "trainer_log.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def compare_losses(kt: list[float], ref: list[float], rtol: float = LOSS_RTOL) -> str | None:
    """None when ``kt`` equals ``ref`` step by step within ``rtol`` (relative), else why not."""
    if not ref or len(kt) != len(ref):
        return f"{len(kt)} kt-ft losses vs {len(ref)} use_kt=false losses"
    for step, (a, b) in enumerate(zip(kt, ref), start=1):
        if not abs(a - b) <= rtol * abs(b):  # `not <=` so a NaN fails
            return f"step {step}: loss {a:.7g} (kt-ft) vs {b:.7g} (use_kt=false), rel diff > {rtol:g}"
    return None


def error_line(log: str) -> str:
    """The run's last exception line (``SomeError: ...``), else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    return ((errors or lines or ["no output"])[-1])[:240]


def max_rel_diff(kt: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(kt, ref))


def lf_parity(model_type: str, workdir: Path, steps: int = STEPS) -> LfCheck:
    """Run the type's demo through ``llamafactory-cli train`` with and without kt-ft (module doc)."""
    t0 = time.perf_counter()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    check = LfCheck("fail")
    try:
        template, check.template_note = demo_template(family_of(tiny_config(model_type)).template)
        check.template = template
        with _DEMO_LOCK:
            demo = make_demo_model(workdir / "demo", family=model_type)
            sharpen_demo(demo / "model")
        procs = {
            kt: start_run(
                recipe(demo, workdir / f"use_kt_{kt}", template, kt, steps), workdir, f"use_kt_{kt}"
            )
            for kt in (False, True)
        }
        done = {kt: wait_run(p) for kt, p in procs.items()}
        losses = {kt: read_losses(workdir / f"use_kt_{kt}") for kt in procs}
        check.status, check.detail = _verdict(done, losses, steps)
    except Exception as err:  # noqa: BLE001 - one row per type: say why its demo could not run
        check.detail = f"{type(err).__name__}: {err}".replace("\n", " ")[:240]
    finally:
        check.seconds = time.perf_counter() - t0
    return check


def _verdict(done: dict, losses: dict, steps: int) -> tuple[str, str]:
    """(status, detail) of the two runs: LF failing without kt-ft is LF's limit, not kt-ft's."""
    (rc_ref, log_ref), (rc_kt, log_kt) = done[False], done[True]
    if rc_ref != 0:
        kt_ran = "trained" if rc_kt == 0 else f"failed too: {error_line(log_kt)}"
        return (
            "LF cannot train",
            f"use_kt=false run failed: {error_line(log_ref)}; the use_kt=true run {kt_ran}",
        )
    if rc_kt != 0:
        return "fail", f"use_kt=true run failed: {error_line(log_kt)}"
    why = compare_losses(losses[True], losses[False])
    if why:
        return "fail", why
    return "pass", f"{steps} lr-0 losses, max rel diff {max_rel_diff(losses[True], losses[False]):.1e}"
