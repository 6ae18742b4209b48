"""Optimize-rule loading and planning: every error names file:line, the key and the valid choices."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from kt_ft.errors import KTConfigError
from kt_ft.models import FAMILIES
from kt_ft.rules import builtin_rule_names, load_rules, make_plan, resolve_rule_path


def write(tmp_path, text):
    p = tmp_path / "rule.yaml"
    p.write_text(text)
    return p


def test_builtin_rule_plans_the_tiny_model():
    assert "qwen3_moe" in builtin_rule_names()
    plan = make_plan(
        tiny_model(), load_rules(resolve_rule_path("qwen3_moe")), FAMILIES["qwen3_moe"], "auto", 3
    )
    assert [(p.layer, p.device, p.backend, p.threads) for p in plan.experts] == [
        (0, "cpu", "auto", 3),
        (1, "cpu", "auto", 3),
    ]
    assert [p.name for p in plan.experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_all_problems_reported_at_once_with_lines(tmp_path):
    p = write(
        tmp_path,
        "- match:\n"
        "    clas: Qwen3MoeExperts\n"  # line 2: typo
        "  replace:\n"
        "    device: gpu\n"  # line 4: bad device
        "- match:\n"
        "    name: '([unclosed'\n"  # line 6: bad regex
        "  replace:\n"
        "    device: cpu\n"
        "    backend: amx\n"  # line 9: bad backend
        "    threads: -4\n",  # line 10
    )
    with pytest.raises(KTConfigError) as info:
        load_rules(p)
    probs = info.value.problems
    assert len(probs) == 5, probs
    assert any(f"{p}:2: [0].match.clas: unknown key (did you mean 'class'?)" in x for x in probs)
    assert any(
        f"{p}:4: [0].replace.device: 'gpu' is not a device; valid choices: cpu, cuda, cuda:N" in x
        for x in probs
    )
    assert any(f"{p}:6: [1].match.name: invalid regex" in x for x in probs)
    assert any(f"{p}:9: [1].replace.backend: 'amx'; valid choices: auto, torch" in x for x in probs)
    assert any(f"{p}:10: [1].replace.threads: -4" in x for x in probs)


def test_not_a_list(tmp_path):
    with pytest.raises(KTConfigError, match="YAML list of rules"):
        load_rules(write(tmp_path, "match: {name: x}\n"))


def test_first_match_wins_and_recursive_false(tmp_path):
    p = write(
        tmp_path,
        "- match: {name: 'layers\\.1\\.mlp$'}\n  replace: {device: cpu, threads: 7}\n  recursive: false\n"
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: reference}\n"
        "- default: {device: cpu}\n",
    )
    plan = make_plan(tiny_model(), load_rules(p), FAMILIES["qwen3_moe"], "auto", 2)
    by_layer = {e.layer: e for e in plan.experts}
    assert (by_layer[0].backend, by_layer[0].threads) == ("reference", 2)
    assert (by_layer[1].backend, by_layer[1].threads) == (
        "auto",
        7,
    )  # inherited from the recursive:false rule


def test_recipe_backend_overrides_rule_backend():
    plan = make_plan(
        tiny_model(), load_rules(resolve_rule_path("qwen3_moe")), FAMILIES["qwen3_moe"], "reference", 1
    )
    assert {e.backend for e in plan.experts} == {"reference"}


def test_experts_on_gpu_are_refused_for_now(tmp_path):
    p = write(tmp_path, "- match: {class: Qwen3MoeExperts}\n  replace: {device: cuda}\n")
    with pytest.raises(
        KTConfigError, match=r"rule.yaml:1: routed experts model.layers.0.mlp.experts placed on 'cuda'"
    ):
        make_plan(tiny_model(), load_rules(p), FAMILIES["qwen3_moe"], "auto", 1)
