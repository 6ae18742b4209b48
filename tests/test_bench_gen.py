"""``kt-ft bench --parts gen`` (kt_ft/integrations/bench/generate.py) without running LLaMA-Factory: the predict
recipes it derives from the training one, and how it reads LLaMA-Factory's prediction files. (A
whole run takes minutes: three LLaMA-Factory processes and a merge; docs/benchmarks.md has one.)"""

from __future__ import annotations

import json

import yaml

from kt_ft.integrations.bench.e2e_systems import parse_systems, write_recipe
from kt_ft.integrations.bench.generate import (
    GEN_DATASET,
    _predict_recipe,
    _record,
    _same_predictions,
    force_length,
)


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


def test_records_count_the_forced_tokens_over_lf_runtime(tmp_path):
    for name, preds in (("a", ["x y z", "p q"]), ("b", ["x y z", "p r"])):
        out = tmp_path / name / "output"
        out.mkdir(parents=True)
        lines = [json.dumps({"prompt": "...", "predict": p, "label": "..."}) for p in preds]
        (out / "generated_predictions.jsonl").write_text("\n".join(lines) + "\n")
        (out / "predict_results.json").write_text(json.dumps({"predict_runtime": 2.5}))
    rec = _record("a", tmp_path / "a", 0, 9.0, 8, tmp_path / "log")
    assert rec.samples == 2 and rec.generated_tokens == 16 and rec.tok_s == 16 / 2.5 and not rec.note
    assert _same_predictions(tmp_path / "a", tmp_path / "b") == (1, 2)
    failed = _record("c", tmp_path / "c", 1, 1.0, 8, tmp_path / "log.txt")
    assert failed.tok_s is None and "exit 1" in failed.note


def test_forced_length_makes_generate_emit_exactly_the_new_tokens(tmp_path):
    """A random model whose end token is the likeliest next token (its lm_head biased to it) stops
    at once; with ``force_length``'s generation_config every sequence has exactly N new tokens, as
    ``_record`` counts them. The file's other keys are kept."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    print("seed 0")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, eos_token_id=3, pad_token_id=0)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[3] = 1.0  # every logit 0 but the end token's (positive where h sums > 0)
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": 3, "pad_token_id": 0}))
    prompts = torch.randint(4, 64, (4, 6))

    def new_tokens() -> list[int]:
        m = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
        out = m.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=7, do_sample=False)
        # a sequence's new tokens: up to its end token (padding after it), else all of them
        return [r.index(3) + 1 if 3 in r else len(r) for r in out[:, prompts.shape[1] :].tolist()]

    before = new_tokens()
    force_length(tmp_path / "m", 7)
    after = new_tokens()
    print("new tokens before / after:", before, after)
    assert min(before) < 7  # the bias makes some sequences end early: the check below can fail
    assert after == [7, 7, 7, 7]
    kept = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert kept["eos_token_id"] == 3 and kept["min_new_tokens"] == 7
