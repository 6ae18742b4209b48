"""Validate and serve with use_kt: generation with kt-ft's experts (in process, and through
``llamafactory-cli train`` with ``do_predict`` + ``predict_with_generate``), eval loss during
training, and ``llamafactory-cli api``.

The reference for generation is the same adapter folded into the base weights (``kt-ft merge``)
and run by plain transformers / LLaMA-Factory with ``use_kt: false``. Greedy decoding in fp32 is
compared token for token: the two compute the same function (x @ (W + s B A) against
x @ W + s (x @ A) @ B), the rounding differs by ~1e-7 relative, far below the gap between the
top two logits of these prompts, so any difference in the tokens is a bug, not noise.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("llamafactory")

from helpers.kt_adapters import lf_load  # noqa: E402
from helpers.lf_api import MISSING_API, http_json, start_api, stop_api, stream_text  # noqa: E402
from helpers.lf_runs import failure_text, finish, start_train  # noqa: E402

from kt_ft.backends.registry import BACKENDS  # noqa: E402
from kt_ft.integrations.export.merge import merge_adapter  # noqa: E402

METRICS_PACKAGES = ("jieba", "nltk", "rouge_chinese")  # LLaMA-Factory's `metrics` extra
MISSING_METRICS = [p for p in METRICS_PACKAGES if importlib.util.find_spec(p) is None]
NEED_METRICS = pytest.mark.skipif(
    bool(MISSING_METRICS),
    reason=f"LLaMA-Factory's predict_with_generate scores BLEU/ROUGE with jieba, nltk, rouge-chinese; "
    f"not importable here: {', '.join(MISSING_METRICS)} (requirements/stack.txt has them: `make install`)",
)

PROMPTS = ["Add 12 and 13.", "Reverse the word.\ncat", "How many words are in the list?\nfish bird cloud"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def merged(saved_adapter, tmp_path_factory) -> Path:
    """The random-LoRA adapter of ``saved_adapter`` folded into the demo base (``kt-ft merge``)."""
    _, adapter, _, _ = saved_adapter
    return Path(merge_adapter(adapter, tmp_path_factory.mktemp("merged") / "model"))


def _fake_workflow(attached: bool):
    """A module shaped like llamafactory.train.sft.workflow: run_sft loads the model, then refuses
    generation under use_kt as LLaMA-Factory 0.9.5 does; it reports what it saw."""
    from types import ModuleType, SimpleNamespace

    wf = ModuleType("fake_workflow")
    seen = {}

    def load_model(tokenizer, model_args, *args, **kwargs):
        seen["use_kt_at_load"] = model_args.use_kt
        return SimpleNamespace(_kt_ft_info=object() if attached else None)

    def run_sft(model_args, training_args):
        wf.load_model(None, model_args)
        if getattr(training_args, "fail", False):
            raise RuntimeError("failed after loading")
        if model_args.use_kt and training_args.predict_with_generate:
            raise NotImplementedError("`predict_with_generate` is not supported in KTransformers SFT yet.")
        seen["ran"] = True

    wf.load_model, wf.run_sft = load_model, run_sft
    return wf, seen


@pytest.mark.parametrize("use_kt, attached", [(True, True), (True, False), (False, False)])
def test_workflow_patch_lifts_the_refusal_only_for_kt_ft_models(use_kt, attached):
    from types import SimpleNamespace

    from kt_ft.integrations.llamafactory.workflow import patch_sft_workflow_module

    wf, seen = _fake_workflow(attached)
    patch_sft_workflow_module(wf)
    model_args = SimpleNamespace(use_kt=use_kt)
    args = SimpleNamespace(predict_with_generate=True)
    if use_kt and not attached:  # LF's own (forked) use_kt path: its refusal stays
        with pytest.raises(NotImplementedError):
            wf.run_sft(model_args, args)
    else:
        wf.run_sft(model_args, args)
        assert seen["ran"]
    assert seen["use_kt_at_load"] is use_kt  # the loader sees the real flag (kt-ft attaches there)
    assert model_args.use_kt is use_kt  # restored once run_sft returns


def test_workflow_patch_restores_use_kt_when_run_sft_fails():
    from types import SimpleNamespace

    from kt_ft.integrations.llamafactory.workflow import patch_sft_workflow_module

    wf, _ = _fake_workflow(True)
    patch_sft_workflow_module(wf)
    model_args = SimpleNamespace(use_kt=True)
    with pytest.raises(RuntimeError, match="after loading"):
        wf.run_sft(model_args, SimpleNamespace(fail=True))
    assert model_args.use_kt is True


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_other_inference_engines_are_refused(backend):
    """vLLM / SGLang load the weights themselves: kt-ft's experts and their LoRA would be missing."""
    from types import SimpleNamespace

    from llamafactory.extras.constants import EngineName

    from kt_ft.base.errors import KTConfigError
    from kt_ft.integrations.llamafactory.patches import check_kt_run

    finetuning = SimpleNamespace(finetuning_type="lora", stage="sft")
    check_kt_run(SimpleNamespace(infer_backend=EngineName.HF), finetuning)
    with pytest.raises(KTConfigError, match=f"infer_backend='{backend}' with use_kt"):
        check_kt_run(SimpleNamespace(infer_backend=EngineName(backend)), finetuning)


def _prompt_batch(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"  # as LLaMA-Factory generates
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1, "prompts of one length: no padding tested"
    return tok, batch


def _generate_kwargs(tok) -> dict:
    return dict(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
    )


@pytest.fixture(scope="module")
def merged_generation(merged, demo_assets):
    """(prompt batch, generate kwargs, the merged model's greedy tokens), checked to differ from
    the base model's: the adapter changes the tokens, so the comparison sees the expert LoRA."""
    from transformers import AutoModelForCausalLM

    tok, batch = _prompt_batch(demo_assets / "model")
    kw = _generate_kwargs(tok)
    want = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval().generate(**batch, **kw)
    base = AutoModelForCausalLM.from_pretrained(demo_assets / "model", dtype=torch.float32).eval()
    assert not torch.equal(base.generate(**batch, **kw), want), "the adapter does not change the tokens"
    return batch, kw, want


# the model path with the portable backend (the demo is fp32, which kt-ft's native kernels do not
# take; the backends themselves are compared with the reference in test_kernels.py / test_native.py)
@pytest.mark.parametrize("backend", ["torch"])
def test_generate_matches_merged_model(backend, saved_adapter, merged_generation, demo_assets):
    """kt-ft's experts (CPU op, no grad) generate a left-padded batch with the KV cache token for
    token as the merged model does (greedy, fp32); each expert backend that runs fp32 here."""
    reason = BACKENDS[backend].unavailable_reason(torch.float32)
    if reason is not None:
        pytest.skip(f"kt_backend {backend} cannot run the fp32 demo here: {reason}")
    batch, kw, want = merged_generation
    _, adapter, _, _ = saved_adapter
    model = lf_load(demo_assets, False, adapter_name_or_path=str(adapter), kt_backend=backend)
    assert model._kt_ft_info.backend == backend
    experts = [m for m in model.modules() if hasattr(m, "runner")]
    assert len(experts) == 2
    calls = []
    for m in experts:
        m.register_forward_hook(lambda mod, args, out: calls.append(torch.is_grad_enabled()))
    got = model.generate(**batch, **kw)
    assert len(calls) == 2 * NEW_TOKENS and not any(calls), calls  # prefill + 11 cached steps, per layer
    assert got.shape == (len(PROMPTS), batch["input_ids"].shape[1] + NEW_TOKENS)
    assert torch.equal(got, want), f"kt-ft:\n{got}\nmerged:\n{want}"
    if backend == "torch":
        assert torch.equal(
            model.generate(**batch, use_cache=False, **kw), got
        )  # the KV cache changes nothing


def _predict(demo_assets: Path, out: Path, **overrides) -> subprocess.Popen:
    return start_train(
        demo_assets,
        out,
        do_train=False,
        do_predict=True,
        predict_with_generate=True,
        eval_dataset="kt_demo",
        max_samples=6,
        per_device_eval_batch_size=6,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        **overrides,
    )


@pytest.mark.lf_subprocess
@NEED_METRICS
def test_predict_with_generate_matches_use_kt_false(saved_adapter, merged, demo_assets, tmp_path):
    """`llamafactory-cli train` with do_predict + predict_with_generate: use_kt with the adapter
    writes the same generated_predictions.jsonl and BLEU-4 / ROUGE as use_kt false on the merged
    weights (greedy, fp32, seed 42)."""
    _, adapter, _, _ = saved_adapter
    runs = {
        "kt": _predict(demo_assets, tmp_path / "kt", adapter_name_or_path=adapter),
        "ref": _predict(demo_assets, tmp_path / "ref", model_name_or_path=merged, use_kt=False),
    }
    logs = {}
    for name, proc in runs.items():
        rc, logs[name] = finish(proc, timeout=300)
        assert rc == 0, f"{name}:\n{failure_text(logs[name])}"
    assert "8 experts x 2 MoE layers on cpu" in logs["kt"] and "[kt-ft|" not in logs["ref"]
    lines = {n: (tmp_path / n / "generated_predictions.jsonl").read_text().splitlines() for n in runs}
    assert len(lines["kt"]) == 6
    preds = [json.loads(line)["predict"] for line in lines["kt"]]
    assert any(preds), "every generation empty: nothing compared"
    assert lines["kt"] == lines["ref"]
    metrics = {n: json.loads((tmp_path / n / "predict_results.json").read_text()) for n in runs}
    keys = ("predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l")
    for k in keys:
        assert math.isfinite(metrics["kt"][k]) and metrics["kt"][k] == metrics["ref"][k], (k, metrics)


@pytest.mark.lf_subprocess
def test_eval_loss_during_training(demo_assets, tmp_path):
    """do_eval with val_size: eval_loss (and compute_accuracy's eval_accuracy) at every eval_steps
    in trainer_log.jsonl, and the final evaluation in all_results.json."""
    out = tmp_path / "out"
    proc = start_train(
        demo_assets,
        out,
        max_steps=2,
        save_steps=100,
        do_eval=True,
        val_size=0.05,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=8,
        compute_accuracy=True,
    )
    rc, log = finish(proc, timeout=300)
    assert rc == 0, failure_text(log)
    evals = [
        r
        for r in map(json.loads, (out / "trainer_log.jsonl").read_text().splitlines())
        if r.get("eval_loss") is not None
    ]
    assert [r["current_steps"] for r in evals] == [1, 2], evals
    assert all(math.isfinite(r["eval_loss"]) and 0 < r["eval_loss"] < 20 for r in evals), evals
    results = json.loads((out / "all_results.json").read_text())
    assert 0.0 <= results["eval_accuracy"] <= 1.0, results
    # the final evaluation runs the weights of step 2 on the same split: the same loss
    assert abs(results["eval_loss"] - evals[-1]["eval_loss"]) <= 1e-4 * evals[-1]["eval_loss"], (
        results,
        evals,
    )


@pytest.mark.lf_subprocess
@pytest.mark.skipif(bool(MISSING_API), reason=f"LLaMA-Factory's api needs {', '.join(MISSING_API)}")
def test_api_serves_the_adapter(saved_adapter, demo_assets, tmp_path):
    """`llamafactory-cli api` with the adapter and use_kt: an OpenAI-style chat completion gets a
    non-empty answer, and the same request streamed the same answer (LLaMA-Factory answers the
    first under inference_mode, the stream in a plain thread: the expert op's buffers serve both);
    SIGINT stops the server cleanly."""
    _, adapter, _, _ = saved_adapter
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(
        "\n".join(
            f"{k}: {v}"
            for k, v in {
                "model_name_or_path": demo_assets / "model",
                "adapter_name_or_path": adapter,
                "template": "qwen",
                "finetuning_type": "lora",
                "infer_backend": "huggingface",
                "use_kt": "true",
                "cpu_infer": 2,
                "kt_backend": "auto",
            }.items()
        )
    )
    log_path = tmp_path / "api.log"
    proc, base = start_api(recipe, log_path)
    request = {
        "model": "demo",
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "do_sample": False,
        "max_tokens": NEW_TOKENS,
    }
    try:
        reply = http_json(f"{base}/chat/completions", request)
        answer = reply["choices"][0]["message"]["content"]
        assert answer.strip(), reply
        assert reply["usage"]["completion_tokens"] > 0, reply
        assert stream_text(f"{base}/chat/completions", request) == answer
    finally:
        rc = stop_api(proc)
    text = log_path.read_text()
    assert "loaded expert LoRA from" in text, text[-3000:]
    assert rc == 0, f"api exited {rc}\n{text[-3000:]}"
