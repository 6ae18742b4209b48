"""``kt-ft bench --parts gen`` (kt_ft/bench/generate.py) without running LLaMA-Factory: the predict
recipes it derives from the training one, and how it reads LLaMA-Factory's prediction files. (A
whole run takes minutes: three LLaMA-Factory processes and a merge; docs/benchmarks.md has one.)"""

from __future__ import annotations

import json

import yaml

from kt_ft.bench.e2e import parse_systems, write_recipe
from kt_ft.bench.generate import GEN_DATASET, _predict_recipe, _record, _same_predictions


def _train_recipe(tmp_path):
    (system,) = parse_systems("kt-cpu:torch")
    return write_recipe(tmp_path / "train", system, model_dir=tmp_path / "m", data_dir=tmp_path / "d", preset="tiny",
                        cutoff_len=64, steps=1, grad_accum=1, threads=1, bf16=False)  # fmt: skip


def test_predict_recipes_keep_the_model_and_kt_ft_keys_or_drop_them_for_the_merged_model(tmp_path):
    (tmp_path / "train").mkdir()
    train = _train_recipe(tmp_path)
    kw = dict(samples=4, batch=2, max_new_tokens=8, prompt_len=32)
    kt = yaml.safe_load(
        _predict_recipe(train, tmp_path / "kt", adapter=tmp_path / "a", model=None, **kw).read_text()
    )
    assert (
        kt["use_kt"] is True
        and kt["kt_backend"] == "torch"
        and kt["adapter_name_or_path"] == str(tmp_path / "a")
    )
    assert kt["do_train"] is False and kt["do_predict"] is True and kt["predict_with_generate"] is True
    assert kt["eval_dataset"] == GEN_DATASET and kt["do_sample"] is False and kt["max_new_tokens"] == 8
    assert kt["per_device_eval_batch_size"] == 2 and kt["max_samples"] == 4 and kt["cutoff_len"] == 64
    assert "max_steps" not in kt and "dataset" not in kt and "lora_target" not in kt
    merged = yaml.safe_load(
        _predict_recipe(train, tmp_path / "mg", adapter=None, model=tmp_path / "merged", **kw).read_text()
    )
    assert merged["model_name_or_path"] == str(tmp_path / "merged") and "adapter_name_or_path" not in merged
    assert not [k for k in merged if k.startswith("kt_") or k in ("use_kt", "chunk_size", "cpu_infer")]


class _Tok:
    """Counts whitespace-separated words as tokens."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_records_count_generated_tokens_over_lf_runtime(tmp_path):
    for name, preds in (("a", ["x y z", "p q"]), ("b", ["x y z", "p r"])):
        out = tmp_path / name / "output"
        out.mkdir(parents=True)
        lines = [json.dumps({"prompt": "...", "predict": p, "label": "..."}) for p in preds]
        (out / "generated_predictions.jsonl").write_text("\n".join(lines) + "\n")
        (out / "predict_results.json").write_text(json.dumps({"predict_runtime": 2.5}))
    rec = _record("a", tmp_path / "a", 0, 9.0, _Tok(), tmp_path / "log")
    assert rec.samples == 2 and rec.generated_tokens == 5 and rec.tok_s == 5 / 2.5 and not rec.note
    assert _same_predictions(tmp_path / "a", tmp_path / "b") == (1, 2)
    failed = _record("c", tmp_path / "c", 1, 1.0, _Tok(), tmp_path / "log.txt")
    assert failed.tok_s is None and "exit 1" in failed.note
