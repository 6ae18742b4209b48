"""Optimize-rule loading and planning: every error names file:line, the key and the valid choices."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.tiny_models import tiny_model

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.builtin import builtin_rule_names, resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan


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


def rule_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def plan_of(path, planning_only=False, family="qwen3_moe", **model_kw):
    model = tiny_model(family, **model_kw)
    return make_plan(model, load_rules(path), FAMILIES[family], "auto", 2, planning_only=planning_only)


def test_wrong_types_name_the_key_value_and_choices(tmp_path):
    p = rule_file(
        tmp_path,
        "types.yaml",
        "- match: {layers: 'x-3'}\n"  # line 1
        "  replace: {device: cpu, gpu_experts: 'many'}\n"  # line 2
        "  recursive: 'no'\n"  # line 3
        "- match: Qwen3MoeExperts\n"  # line 4: a string, not a mapping
        "  replace: {device: 0}\n",  # line 5
    )
    with pytest.raises(KTConfigError) as info:
        load_rules(p)
    probs = info.value.problems
    assert len(probs) == 5, probs
    assert any(f"{p}:1: [0].match.layers: 'x-3' is not a layer index or range; expected" in x for x in probs)
    assert any(f"{p}:2: [0].replace.gpu_experts: " in x and "expected a count (4)" in x for x in probs)
    assert any(f"{p}:3: [0].recursive: 'no'; expected true or false" in x for x in probs)
    assert any(f"{p}:4: [1].match: expected a mapping with keys name, class, layers" in x for x in probs)
    assert any(
        f"{p}:5: [1].replace.device: 0 is not a device; valid choices: cpu, cuda, cuda:N" in x for x in probs
    )


def test_shadowed_rules_name_both_lines(tmp_path):
    p = rule_file(
        tmp_path,
        "shadow.yaml",
        "- match: {class: Qwen3MoeExperts}\n"  # line 1
        "  replace: {device: cpu}\n"
        "- match: {class: Qwen3MoeExperts, name: 'layers\\.1\\.'}\n"  # line 3: class X plus more
        "  replace: {device: cpu, threads: 3}\n"
        "- match: {name: 'q_proj$', layers: '0-5'}\n"  # line 5
        "  replace: {device: cuda}\n"
        "- match: {name: 'q_proj$', layers: [1, '3-4']}\n"  # line 7: a subset of the layers of line 5
        "  replace: {device: cuda}\n"
        "- match: {name: 'k_proj$', layers: '0-1'}\n"  # line 9: not shadowed (another regex)
        "  replace: {device: cuda}\n",
    )
    with pytest.raises(KTConfigError) as info:
        load_rules(p)
    probs = info.value.problems
    assert len(probs) == 2, probs
    assert probs[0].startswith(f"{p}:3: rule #2 (class=Qwen3MoeExperts, name=/layers\\.1\\./)")
    assert f"can never match: the earlier rule #1 (class=Qwen3MoeExperts) at {p}:1" in probs[0]
    assert (
        probs[1].startswith(f"{p}:7: rule #4")
        and f"rule #3 (name=/q_proj$/, layers=0-5) at {p}:5" in probs[1]
    )


def test_rule_matching_no_module_is_an_error(tmp_path):
    p = rule_file(
        tmp_path,
        "none.yaml",
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu}\n"
        "- match: {name: 'mlp\\.experts$', layers: '5-9'}\n  replace: {device: cpu}\n",  # 2 layers only
    )
    with pytest.raises(
        KTConfigError, match=r"none.yaml:3: rule #2 \(name=.*layers=5-9\) .* matches no module"
    ):
        plan_of(p)


def test_devices_this_machine_lacks(tmp_path, monkeypatch):
    from kt_ft.plan import placement as plan_mod

    p = rule_file(
        tmp_path,
        "dev.yaml",
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu}\n"
        "- match: {name: 'self_attn$'}\n"
        "  replace:\n"
        "    device: cuda:3\n"  # line 5
        "- default: {device: cuda:1}\n",  # line 6
    )
    monkeypatch.setattr(plan_mod, "cuda_device_count", lambda: 1)
    with pytest.raises(KTConfigError) as info:
        plan_of(p)
    probs = info.value.problems
    assert (
        f"{p}:5: [1].replace.device: 'cuda:3' does not exist: this machine has 1 CUDA device(s); valid choices: cpu, cuda, cuda:0"
        in probs
    )
    assert any(x.startswith(f"{p}:6: [2].default.device: 'cuda:1' does not exist") for x in probs)
    monkeypatch.setattr(plan_mod, "cuda_device_count", lambda: 0)
    with pytest.raises(
        KTConfigError, match=r"dev.yaml:5: .*'cuda:3' does not exist: this machine has no CUDA device"
    ):
        plan_of(p)
    # planning only: a note, not an error (the plan is for the target machine)
    plan = plan_of(p, planning_only=True)
    assert any("not on this machine" in n and "cuda:3" in n for n in plan.notes)


def test_cuda_falls_back_to_cpu_without_cuda(tmp_path, monkeypatch):
    from kt_ft.plan import placement as plan_mod

    monkeypatch.setattr(plan_mod, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = rule_file(
        tmp_path,
        "fb.yaml",
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu}\n- default: {device: cuda:0}\n",
    )
    plan = plan_of(p)
    assert plan.default_device == torch.device("cpu")
    assert plan.notes == ["device 'cuda:0' asked for but CUDA is not available: using cpu"]


def test_layer_ranges_match_by_decoder_layer_index(tmp_path):
    p = rule_file(
        tmp_path,
        "layers.yaml",
        "- match: {layers: [0, '2-3'], class: Qwen3MoeExperts}\n  replace: {device: cpu, threads: 5}\n"
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, threads: 1}\n"
        "- default: {device: cpu}\n",
    )
    plan = plan_of(p, num_hidden_layers=4)
    assert [(e.layer, e.threads) for e in plan.experts] == [(0, 5), (1, 1), (2, 5), (3, 5)]
    # modules outside the decoder layers (embeddings, final norm) never match a `layers` rule
    assert plan.module_devices["model.embed_tokens"] == "cpu"
    # the decoder layer itself matches its index too (a class + layers rule, no regex)
    p = rule_file(
        tmp_path,
        "decoder.yaml",
        "- match: {layers: '1-2', class: Qwen3MoeDecoderLayer}\n  replace: {device: cpu, threads: 6}\n"
        "  recursive: false\n"
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, threads: 1}\n"
        "- default: {device: cpu}\n",
    )
    plan = plan_of(p, num_hidden_layers=4)
    assert [(e.layer, e.threads) for e in plan.experts] == [(0, 1), (1, 6), (2, 6), (3, 1)]


def test_include_overrides_and_default(tmp_path):
    base = rule_file(
        tmp_path,
        "base.yaml",
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: torch, threads: 2}\n"
        "- default: {device: cuda}\n",
    )
    sub = tmp_path / "sub"
    sub.mkdir()
    top = rule_file(
        sub,
        "top.yaml",
        "- include: ../base.yaml\n"
        "- match: {class: Qwen3MoeExperts, layers: 1}\n  replace: {device: cpu, backend: reference}\n"
        "- default: {device: cpu}\n",
    )
    rules = load_rules(top)
    assert [r.where for r in rules.rules] == [f"{top}:2", f"{base}:1"]  # own rules first
    assert (rules.default_device, rules.default_where) == ("cpu", f"{top}:4")
    assert rules.includes == [str(base)]
    plan = make_plan(tiny_model(), rules, FAMILIES["qwen3_moe"], "auto", 4)
    assert [(e.layer, e.backend, e.threads) for e in plan.experts] == [(0, "torch", 2), (1, "reference", 4)]
    # no default of its own: the included default; a built-in name works as include too
    nodef = rule_file(tmp_path, "nodef.yaml", "- include: qwen3_moe\n")
    rules = load_rules(nodef)
    builtin = resolve_rule_path("qwen3_moe")
    line = builtin.read_text().splitlines().index("- default:") + 1
    assert (rules.default_device, rules.default_where) == ("cuda", f"{builtin}:{line}")
    assert rules.rules[0].cls == "Qwen3MoeExperts"


def test_include_cycle_and_missing_include(tmp_path):
    a = rule_file(tmp_path, "a.yaml", "- include: b.yaml\n- include: nowhere.yaml\n")
    b = rule_file(tmp_path, "b.yaml", "- match: {class: X}\n  replace: {device: cpu}\n- include: a.yaml\n")
    with pytest.raises(KTConfigError) as info:
        load_rules(a)
    probs = info.value.problems
    assert len(probs) == 2, probs
    assert f"{b}:3: [1].include: include cycle: {a.resolve()} -> {b.resolve()} -> {a.resolve()}" in probs
    assert any(
        x.startswith(f"{a}:2: [1].include: 'nowhere.yaml': no file") and "built-in rules: " in x
        for x in probs
    )


def test_gpu_experts_forms():
    from kt_ft.plan.schema import parse_gpu_experts

    g = parse_gpu_experts(4)
    assert g.for_layer(7).count == 4
    g = parse_gpu_experts({"layers": "0-11", "ids": [0, 5, 7]})
    assert g.for_layer(11).ids == (0, 5, 7) and g.for_layer(12) is None
    g = parse_gpu_experts({0: [1, 2], "3-5": [4]})
    assert g.for_layer(0).ids == (1, 2) and g.for_layer(4).ids == (4,) and g.for_layer(2) is None
    g = parse_gpu_experts([{"layers": 1, "count": 2}, {"ids": [3]}])
    assert g.for_layer(1).count == 2 and g.for_layer(0).ids == (3,)
    assert parse_gpu_experts(0).is_empty() and not parse_gpu_experts([0]).is_empty()
    for bad in (
        "all",
        -1,
        [1, 1],
        {"layers": 1},
        {"layers": 1, "ids": [1], "count": 1},
        {"layer": 1, "ids": [1]},
    ):
        with pytest.raises(ValueError, match="expected a count"):
            parse_gpu_experts(bad)


def test_gpu_experts_are_planned_for_a_run(tmp_path):
    p = rule_file(
        tmp_path,
        "gpu.yaml",
        "- match: {class: Qwen3MoeExperts}\n"
        "  replace:\n"
        "    device: cpu\n"
        "    gpu_experts: {layers: 1, ids: [0, 5]}\n",
    )
    plan = plan_of(p)  # a run accepts it (moe/resident.py computes them)
    assert [(e.layer, e.gpu_experts and e.gpu_experts.ids) for e in plan.experts] == [(0, None), (1, (0, 5))]
    assert plan.refusals == []
    too_many = rule_file(
        tmp_path, "many.yaml", "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, gpu_experts: 9}\n"
    )
    with pytest.raises(
        KTConfigError, match=r"many.yaml:1: gpu_experts: count 9 > the 8 experts .*valid: 0-8"
    ):
        plan_of(too_many)
    bad = rule_file(
        tmp_path,
        "bad.yaml",
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, gpu_experts: [9]}\n",
    )
    with pytest.raises(
        KTConfigError, match=r"bad.yaml:1: gpu_experts: expert ids \[9\] do not exist .*valid: 0-7"
    ):
        plan_of(bad, planning_only=True)


@pytest.mark.parametrize("name", builtin_rule_names())
def test_shipped_rule_plans_a_tiny_model_of_its_family(name):
    """Every shipped rule: its header names its preview command, it loads, and every rule of the
    file matches a (meta) tiny model of its family; rules written for a layer count say it."""
    from transformers import AutoConfig

    from kt_ft.formats.skeleton import meta_model
    from kt_ft.plan.derived import GENERIC_RULE
    from kt_ft.plan.family import family_of
    from kt_ft.plan.tiny import tiny_config

    path = resolve_rule_path(name)
    text = path.read_text()
    assert f"# Preview: kt-ft rules plan --rule {name} --model DIR" in text
    if name == GENERIC_RULE:  # the rule of derived families: a tiny model of one of them
        config = tiny_config("dots1")
        family = family_of(config)
    elif name.split("-")[0] not in FAMILIES:  # a derived family's own rule (e.g. qwen3_vl_moe)
        config = tiny_config(name.split("-")[0])
        family = family_of(config)
        assert family.builtin_rule == name.split("-")[0]
    else:
        family = FAMILIES[name.split("-")[0]]
        cfg = dict(family.demo_config)
        layers = re.search(r"\((\d+) layers", text.splitlines()[0])
        if layers:
            cfg["num_hidden_layers"] = int(layers.group(1))
            cfg.pop("layer_types", None)
        config = AutoConfig.for_model(family.demo_type, vocab_size=97, **cfg)
    plan = make_plan(
        meta_model(config, torch.bfloat16), load_rules(path), family, "auto", 2, planning_only=True
    )
    assert len(plan.experts) >= 1 and all(e.device == "cpu" for e in plan.experts)
    if name.endswith("-2gpu"):
        assert {d for d in plan.module_devices.values()} == {"cpu", "cuda:0", "cuda:1"}
        assert plan.refusals and "not implemented yet" in plan.refusals[0]
    else:
        assert not plan.refusals
    if name.endswith("-stream"):  # every routed expert streamed: the CPU op never runs
        assert all(e.stream_experts is not None and e.stream_experts.is_all for e in plan.experts)
    for backend in ("torch", "kt-kernel"):
        if name.endswith(f"-{backend}"):
            assert {e.backend for e in plan.experts} == {backend}


def test_a_key_given_twice_is_refused_not_last_wins(tmp_path):
    """YAML takes the last of two equal keys without a word; a rule file saying one thing twice is
    refused with both lines, at a rule's own keys and inside a value (a gpu_experts mapping)."""
    p = write(tmp_path, "- match:\n    name: a\n    name: b\n  replace:\n    device: cpu\n")
    with pytest.raises(
        KTConfigError, match=re.escape(f"{p}:3: [0].match.name: given twice in one mapping (first at line 2)")
    ):
        load_rules(p)
    p = write(tmp_path, "- match: {class: X}\n  replace: {device: cpu}\n  replace: {device: cuda}\n")
    with pytest.raises(
        KTConfigError, match=re.escape(f"{p}:3: [0].replace: given twice in one mapping (first at line 2)")
    ):
        load_rules(p)
    p = write(
        tmp_path, "- match:\n    class: X\n  replace:\n    device: cpu\n    gpu_experts: {0: [1], 0: [2]}\n"
    )
    with pytest.raises(KTConfigError) as info:
        load_rules(p)
    assert info.value.problems == [f"{p}:5: key '0': given twice in one mapping (first at line 5)"]


@pytest.mark.parametrize(
    "text, line",
    [
        ("- match:\n    name: !!python/object:os.system x\n  replace:\n    device: cpu\n", 2),
        ("- !!python/object/apply:os.system ['true']\n", 1),
    ],
)
def test_a_tag_beyond_plain_yaml_is_refused_with_its_line(tmp_path, text, line):
    """A tag the safe loader has no constructor for is kt-ft's error at file:line, not a traceback
    from inside PyYAML; nothing is constructed."""
    p = write(tmp_path, text)
    tag = "tag:yaml.org,2002:" + text.split("!!")[1].split()[0]
    with pytest.raises(KTConfigError) as info:
        load_rules(p)
    assert info.value.problems == [
        f"{p}:{line}: tag {tag}: not a plain YAML value (could not determine a constructor for the tag "
        f"'{tag}'); write the value itself"
    ]
