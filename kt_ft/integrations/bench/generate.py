"""``kt-ft bench --parts gen``: generation through the path users run, LLaMA-Factory's
``do_predict`` with ``predict_with_generate``, kt-ft's experts against the same weights merged.

One run, each step its own ``llamafactory-cli`` process: the e2e bench's random model of a real
config (``e2e_assets.write_assets``), prompts of ``prompt_len`` tokens cut from its text, an adapter
trained for one step with kt-ft (``system``: every expert on the CPU, or a placement), then

* ``kt-ft``: predict with ``use_kt: true`` and the adapter (generation batched as LLaMA-Factory
  does it: ``per_device_eval_batch_size`` sequences, left-padded, prompt then one token a call);
* ``merged``: ``kt-ft merge`` of that adapter, predicted with ``use_kt: false`` (plain
  transformers: every expert on the training device, the reference for speed and output).

Every sequence generates exactly ``max_new_tokens`` tokens (the model's ``generation_config.json``
gets ``min_new_tokens`` = ``max_new_tokens``: a random model otherwise ends most sequences at once
with an end or special token, and a re-tokenized count of the decoded text then says ~1 tok/s);
tokens/s are those tokens over LLaMA-Factory's ``predict_runtime``. Greedy decoding, so the two
systems' predictions are compared text for text (they may part where a bf16 product rounds
differently).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from kt_ft.integrations.bench.e2e_assets import DATASET, write_assets
from kt_ft.integrations.bench.e2e_run import lf_env, llamafactory_cli
from kt_ft.integrations.bench.e2e_systems import parse_systems, write_recipe

GEN_DATASET = "kt_gen"


@dataclass
class GenRecord:
    system: str
    rc: int
    seconds: float  # the predict process, wall
    samples: int = 0
    generated_tokens: int = 0
    predict_runtime_s: float | None = None  # LLaMA-Factory's figure
    note: str = ""

    @property
    def tok_s(self) -> float | None:
        if not self.predict_runtime_s or not self.generated_tokens:
            return None
        return self.generated_tokens / self.predict_runtime_s


def write_prompts(data_dir: Path, tokenizer, samples: int, prompt_len: int) -> None:
    """``GEN_DATASET``: ``samples`` prompts of ``prompt_len`` tokens from the e2e texts (their
    outputs: the next ``prompt_len`` tokens, for the metrics)."""
    rows = json.loads((data_dir / f"{DATASET}.json").read_text())[:samples]
    out = []
    for r in rows:
        ids = tokenizer(r["output"])["input_ids"]
        out.append(
            {
                "instruction": "Continue the text.",
                "input": tokenizer.decode(ids[:prompt_len]),
                "output": tokenizer.decode(ids[prompt_len : 2 * prompt_len]),
            }
        )
    (data_dir / f"{GEN_DATASET}.json").write_text(json.dumps(out))
    info = json.loads((data_dir / "dataset_info.json").read_text())
    info[GEN_DATASET] = {"file_name": f"{GEN_DATASET}.json"}
    (data_dir / "dataset_info.json").write_text(json.dumps(info))


def _lf(recipe: Path, log: Path, timeout_s: float) -> tuple[int, float]:
    """``llamafactory-cli train recipe`` -> (exit code, seconds); output to ``log``."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run([llamafactory_cli(), "train", str(recipe)], stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout_s, env=lf_env()).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def _predict_recipe(train_recipe: Path, out: Path, *, adapter: Path | None, model: Path | None,
                    samples: int, batch: int, max_new_tokens: int, prompt_len: int) -> Path:  # fmt: skip
    """The train recipe turned into a predict one (the same model, template and kt-ft keys)."""
    r = yaml.safe_load(train_recipe.read_text())
    for k in ("max_steps", "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
              "save_steps", "include_num_input_tokens_seen", "dataset", "lora_target", "lora_rank", "lora_alpha"):  # fmt: skip
        r.pop(k, None)
    r.update(
        do_train=False, do_predict=True, predict_with_generate=True, eval_dataset=GEN_DATASET,
        max_samples=samples, per_device_eval_batch_size=batch, max_new_tokens=max_new_tokens,
        do_sample=False, cutoff_len=prompt_len + 32, output_dir=str(out / "output"),
    )  # fmt: skip
    if adapter is not None:
        r["adapter_name_or_path"] = str(adapter)
    if model is not None:  # the merged model: plain transformers
        r["model_name_or_path"] = str(model)
        for k in [k for k in r if k.startswith("kt_") or k in ("use_kt", "chunk_size", "cpu_infer")]:
            r.pop(k)
        r["finetuning_type"] = "lora"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def force_length(model_dir: Path, new_tokens: int) -> None:
    """Set ``min_new_tokens`` = ``new_tokens`` in ``model_dir``'s ``generation_config.json`` (made if
    missing), so every generated sequence has exactly ``new_tokens`` tokens (``max_new_tokens`` caps
    it); ``kt-ft merge`` copies the file with the rest of the config."""
    path = model_dir / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    cfg["min_new_tokens"] = new_tokens
    path.write_text(json.dumps(cfg, indent=1))


def _record(name: str, run_dir: Path, rc: int, seconds: float, new_tokens: int, log: Path) -> GenRecord:
    rec = GenRecord(name, rc, seconds)
    out = run_dir / "output"
    preds = out / "generated_predictions.jsonl"
    results = out / "predict_results.json"
    if rc != 0 or not preds.is_file() or not results.is_file():
        rec.note = f"exit {rc}: see {log}"
        return rec
    rows = [json.loads(line) for line in preds.read_text().splitlines() if line.strip()]
    rec.samples = len(rows)
    rec.generated_tokens = len(rows) * new_tokens  # every sequence's length is forced (force_length)
    rec.predict_runtime_s = json.loads(results.read_text()).get("predict_runtime")
    return rec


def run_generate(
    *,
    preset: str,
    layers: int | None,
    system: str,
    workdir: Path,
    threads: int,
    samples: int = 16,
    batch: int = 8,
    prompt_len: int = 256,
    max_new_tokens: int = 64,
    timeout_s: float = 1800,
    json_path: str | None = None,
    merged_dir: Path | None = None,
) -> list[GenRecord]:
    """The run of the module doc; prints a table, returns the records (kt-ft first, merged second).

    ``merged_dir``: where ``kt-ft merge`` writes the merged model (default ``workdir/gen/merged-model``);
    a full-size model and its merged copy may not fit one disk together (e.g. put it in /dev/shm).
    The merge runs after kt-ft's predictions, so the disk holds the two copies for the merged run only."""
    from transformers import AutoTokenizer

    (sys_,) = parse_systems(system)
    if not sys_.use_kt:
        raise ValueError(f"--gen-system {system!r}: a kt-ft system (kt-cpu:<backend>, kt-auto, ...)")
    model_dir, data_dir, layers = write_assets(workdir, preset, layers, prompt_len * 2, max(samples, 8))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    write_prompts(data_dir, tokenizer, samples, prompt_len)
    force_length(model_dir, max_new_tokens)
    runs = workdir / "gen"
    train_dir = runs / "train"
    train_dir.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()  # bf16 where a GPU computes, fp32 on the CPU (as the e2e bench)
    recipe = write_recipe(train_dir, sys_, model_dir=model_dir, data_dir=data_dir, preset=preset,
                          cutoff_len=prompt_len * 2, steps=1, grad_accum=1, threads=threads, bf16=cuda)  # fmt: skip
    rc, _ = _lf(recipe, train_dir / "log.txt", timeout_s)
    if rc != 0:
        raise RuntimeError(f"training the adapter failed (exit {rc}): {train_dir / 'log.txt'}")
    adapter = train_dir / "output"
    merged = Path(merged_dir) if merged_dir else runs / "merged-model"
    kw = dict(samples=samples, batch=batch, max_new_tokens=max_new_tokens, prompt_len=prompt_len)
    records = []
    for name, adapter_dir in ((sys_.name, adapter), ("merged", None)):
        if adapter_dir is None:
            subprocess.run([sys.executable, "-m", "kt_ft.integrations.cli.main", "merge", str(adapter), str(merged), "--base", str(model_dir)],
                           check=True, capture_output=True, text=True)  # fmt: skip
        run_dir = runs / name.replace(":", "-")
        pr = _predict_recipe(
            recipe, run_dir, adapter=adapter_dir, model=None if adapter_dir else merged, **kw
        )
        log = run_dir / "log.txt"
        rc, seconds = _lf(pr, log, timeout_s)
        records.append(_record(name, run_dir, rc, seconds, max_new_tokens, log))
    same = _same_predictions(runs / sys_.name.replace(":", "-"), runs / "merged")
    print(
        f"\ngeneration: llamafactory-cli train (do_predict, predict_with_generate), {preset} x{layers} layers, "
        f"{samples} prompts of {prompt_len} tokens, batch {batch}, {max_new_tokens} new tokens each, greedy"
    )
    print(f"{'system':<20}{'tok/s':>9}{'x merged':>10}{'tokens':>8}{'predict s':>11}  note")
    ref = records[1].tok_s
    for r in records:
        tok = f"{r.tok_s:,.1f}" if r.tok_s else "-"
        x = f"{r.tok_s / ref:.2f}" if r.tok_s and ref else "-"
        rt = f"{r.predict_runtime_s:.1f}" if r.predict_runtime_s else "-"
        print(f"{r.system:<20}{tok:>9}{x:>10}{r.generated_tokens:>8}{rt:>11}  {r.note}")
    if same is not None:
        print(f"identical predictions: {same[0]} of {same[1]} (greedy; a bf16 rounding may part them)")
    if json_path:
        Path(json_path).write_text(json.dumps({"records": [asdict(r) | {"tok_s": r.tok_s} for r in records],
                                               "identical": same}, indent=1))  # fmt: skip
    return records


def _same_predictions(a: Path, b: Path) -> tuple[int, int] | None:
    pa, pb = (d / "output" / "generated_predictions.jsonl" for d in (a, b))
    if not pa.is_file() or not pb.is_file():
        return None
    ra = [json.loads(x)["predict"] for x in pa.read_text().splitlines() if x.strip()]
    rb = [json.loads(x)["predict"] for x in pb.read_text().splitlines() if x.strip()]
    return sum(x == y for x, y in zip(ra, rb)), min(len(ra), len(rb))
