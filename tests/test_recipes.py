"""Every shipped real-model recipe is consistent with kt-ft and LLaMA-Factory (static, no model).

Checks, per recipe: the kt keys validate (KTArguments), the rule is the family's built-in rule and
matches the family's experts class, the template exists in LLaMA-Factory, bf16 and LoRA are on;
and every supported family ships a recipe and a rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.loader import load_rules
from kt_ft.plan.recipe import KTArguments

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
KT_KEYS = ("use_kt", "kt_optimize_rule", "cpu_infer", "chunk_size", "kt_backend")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_recipe(family):
    fam = FAMILIES[family]
    path = RECIPES / fam.recipe
    assert path.is_file(), f"{family}: no recipe {path}"
    r = yaml.safe_load(path.read_text())
    assert all(k in r for k in KT_KEYS), [k for k in KT_KEYS if k not in r]
    KTArguments(**{k: r[k] for k in KT_KEYS})  # validates every kt key, loads the rule
    assert r["kt_optimize_rule"] == fam.builtin_rule
    rules = load_rules(resolve_rule_path(fam.builtin_rule))
    assert any(fam.experts_class in rule.classes and rule.device == "cpu" for rule in rules.rules)
    assert r["template"] == fam.template
    assert r["use_kt"] is True and r["bf16"] is True and r["finetuning_type"] == "lora"
    assert r.get("trust_remote_code", False) is False  # remote code has no fused experts to replace


def test_templates_exist_in_llamafactory():
    templates = pytest.importorskip("llamafactory.data.template").TEMPLATES
    missing = {f: fam.template for f, fam in FAMILIES.items() if fam.template not in templates}
    assert not missing, f"not LLaMA-Factory templates: {missing}"
