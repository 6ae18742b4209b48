"""Which model types of the installed transformers kt-ft fine-tunes: found, checked, and written up.

``interface_model_types()`` lists the model types whose modeling file decorates an experts class
with ``use_experts_implementation``; ``probe(model_type)`` builds a tiny random model of one
(``tiny.py``), derives its family (or records the refusal and its reason) and, where supported,
runs it twice on the same random tokens -- experts computed by transformers' ``eager`` and by
kt-ft's CPU op through the ``"kt_ft"`` experts implementation (``dispatch.py``) -- and compares
the logits (fp32, max abs difference <= 1e-4). ``kt-ft models --write docs/models.md`` writes
the table (``models_markdown``); tests/test_interface_families.py checks training parity; with
``--lf`` each supported type also trains through ``llamafactory-cli train`` (``lf_check.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.cli.lf_check import LOSS_RTOL
from kt_ft.integrations.demo.text import randomize_routing
from kt_ft.plan.family import family_of
from kt_ft.plan.interface import derive_spec, interface_experts
from kt_ft.plan.tiny import tiny_config
from kt_ft.runtime.dispatch import use_kt_ft_experts

LOGITS_ATOL = 1e-4  # fp32; kernels sum in another order than eager


def interface_model_types() -> list[str]:
    """Model types (of CONFIG_MAPPING) whose modeling file uses ``@use_experts_implementation``,
    that are causal LMs and not composites (a composite's language model has its own ``*_text``
    type, listed where transformers has one)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(transformers.__file__).parent / "models"
    dirs = {
        p.parent.name for p in root.glob("*/modeling_*.py") if "@use_experts_implementation" in p.read_text()
    }
    types = []
    for t in CONFIG_MAPPING_NAMES:
        if (
            model_type_to_module_name(t) in dirs
            and t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and not _composite(t)
        ):
            types.append(t)
    return sorted(types)


def _composite(model_type: str) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    return hasattr(config, "get_text_config") and config.get_text_config() is not config


@dataclass
class ProbeRow:
    model_type: str
    status: str  # "supported" | "refused" | "error"
    experts: str = ""  # experts class names
    layout: str = ""  # the derived ExpertSpec, described
    rule: str = ""
    detail: str = ""  # refusal reason, error, or the logits difference
    seconds: float = 0.0
    lf: str = "not run"  # `kt-ft models --lf`: lf_check.LfCheck.cell()


def probe(model_type: str, seed: int = 0) -> ProbeRow:
    """Derive, refuse or check ``model_type`` on a tiny random model (see module doc)."""
    t0 = time.perf_counter()
    row = ProbeRow(model_type, "error")
    try:
        config = tiny_config(model_type)
        try:
            family = family_of(config)
        except KTConfigError as err:
            row.status, row.detail = "refused", str(err).replace("\n", " ")
            return row
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize_routing(model)
        found = interface_experts(model)
        row.experts = ", ".join(sorted({type(m).__name__ for _, m in found}))
        row.layout = "; ".join(sorted({derive_spec(m)[0].describe() for _, m in found}))
        row.rule = family.builtin_rule
        ids = torch.randint(
            3, config.get_text_config().vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed)
        )
        with torch.no_grad():
            use_kt_ft_experts(model, "eager")
            eager = model(input_ids=ids).logits
            use_kt_ft_experts(model)
            kt = model(input_ids=ids).logits
        diff = (eager - kt).abs().max().item()
        ok = diff <= LOGITS_ATOL
        row.status = "supported" if ok else "error"
        row.detail = f"logits max |eager - kt_ft| {diff:.1e}" + ("" if ok else f" > {LOGITS_ATOL:g}")
    except Exception as err:  # noqa: BLE001 - a row per type: record why the tiny model failed
        row.detail = f"{type(err).__name__}: {err}".replace("\n", " ")[:300]
    finally:
        row.seconds = time.perf_counter() - t0
    return row


LF_COLUMN_DOC = (
    "The last column is `kt-ft models --lf` (`kt_ft/integrations/cli/lf_check.py`): the type's "
    "`kt-ft make-demo-model --family <type>` demo (routers random, lm_head and experts scaled up so the "
    "loss depends on the experts) trained by two `llamafactory-cli train` subprocesses that differ only "
    "in `use_kt` (true / false), fp32, learning rate 0, seed 42, 3 steps; *pass* when the per-step losses "
    "LLaMA-Factory logs agree to a relative {rtol:g}; *LF cannot train* when the run without kt-ft fails "
    "(LLaMA-Factory's own limit; the cell says whether the kt-ft run trained); *not run* when the type is "
    "refused or `--lf` was not given. The template is the type's LLaMA-Factory template (the demo "
    "tokenizer has its stop words), or `qwen` (the demo tokenizer's ChatML) where the type has none "
    "or its template needs a processor."
)


def models_markdown(rows: list[ProbeRow], transformers_version: str) -> str:
    """docs/models.md: the probe's table (generated; not edited by hand)."""
    lines = [
        "# Model types kt-ft fine-tunes",
        "",
        f"Generated by `kt-ft models --lf --write docs/models.md` on transformers {transformers_version}; "
        "do not edit by hand. Every model type whose routed experts use transformers' experts interface "
        "(`@use_experts_implementation`) was built tiny from its config class's defaults "
        "(`kt_ft/plan/tiny.py`) and its family derived from the module (`kt_ft/plan/interface.py`); "
        "a supported type's logits with its experts computed by kt-ft's CPU op (experts implementation "
        f"`kt_ft`) equal transformers' eager ones to {LOGITS_ATOL:g} (fp32). Training parity for each is "
        "`tests/test_interface_families.py`. Composite (vision-language) types use their language model's "
        "row (e.g. `qwen3_5_moe` -> `qwen3_5_moe_text`).",
        "",
        LF_COLUMN_DOC.format(rtol=LOSS_RTOL),
        "",
        "| model_type | status | experts class | layout / activation | built-in rule | detail | LLaMA-Factory lr-0 parity |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        detail, lf = (text.replace("|", "\\|") for text in (r.detail, r.lf))
        lines.append(
            f"| {r.model_type} | {r.status} | {r.experts} | {r.layout} | {r.rule} | {detail} | {lf} |"
        )
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- kt-ft models: begin -->"
README_END = "<!-- kt-ft models: end -->"


def readme_models_block(models_md: str) -> str:
    """README's generated sentence on the experts-interface types, from docs/models.md's table
    (the types whose status is supported and whose LLaMA-Factory lr-0 parity passed; the rest
    named with their status), between ``README_BEGIN`` and ``README_END``."""
    rows = []
    for line in models_md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 7 and cells[1] in ("supported", "refused", "error"):
            rows.append((cells[0], cells[1], cells[6]))
    passed = [t for t, status, lf in rows if status == "supported" and lf.startswith("pass")]
    others = [
        f"{t} ({'refused' if status != 'supported' else lf.split(';')[0]})"
        for t, status, lf in rows
        if t not in passed
    ]
    text = (
        f"{README_BEGIN}\nOf the {len(rows)} model types of transformers whose experts use its experts interface, "
        f"{len(passed)} train through `llamafactory-cli train` with the losses of `use_kt: false` "
        f"({', '.join(passed)}); not so: {', '.join(others) or 'none'}.\n{README_END}"
    )
    return text


def update_readme(readme: Path, models_md: str) -> None:
    """Replace README's generated block (``readme_models_block``) in place."""
    s = readme.read_text()
    a, b = s.index(README_BEGIN), s.index(README_END) + len(README_END)
    readme.write_text(s[:a] + readme_models_block(models_md) + s[b:])
