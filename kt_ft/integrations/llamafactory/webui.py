"""LlamaBoard (``llamafactory-cli webui``): kt-ft's recipe keys on the Train tab.

LLaMA-Factory 0.9.5's board has no field for any ``use_kt`` key (its own KTransformers path is
recipe-only), so kt-ft adds them, through the start-up hook, when the board's modules load:

* ``llamafactory.webui.components.train``: ``create_train_tab`` also builds a "kt-ft" accordion
  (``use_kt``, ``kt_optimize_rule``, ``kt_backend``, ``cpu_infer``, ``chunk_size``,
  ``kt_gpu_memory``) and a plan button whose box shows ``kt-ft rules plan``'s report for the
  model path, rule and sizes of the form (from ``config.json`` on a meta skeleton: no weight is
  read). The fields join the tab's inputs, so LLaMA-Factory's own start / preview / save / load
  of a configuration carry them.
* ``llamafactory.webui.runner``: ``Runner._parse_train_args`` writes the keys into the generated
  ``training_args.yaml`` when ``use_kt`` is ticked (nothing otherwise), and ``Runner._initialize``
  checks them as a run would, before anything starts: a bad value shows kt-ft's own message
  (file, key, value, valid choices) in the output box.
* ``llamafactory.webui.locales``: labels and help texts of the fields (English in every language).

With ``use_kt`` unticked the board builds LLaMA-Factory's arguments unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from types import ModuleType, SimpleNamespace
from typing import Any

from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.llamafactory.patches import check_kt_run
from kt_ft.plan.builtin import builtin_rule_names
from kt_ft.plan.recipe import KTArguments
from kt_ft.plan.schema import KT_BACKENDS

TAB = "train"
# the recipe keys the form sets, in the order they are shown
KEYS = ("use_kt", "kt_optimize_rule", "kt_backend", "cpu_infer", "chunk_size", "kt_gpu_memory")
PLAN_BUTTON, PLAN_BOX, ACCORDION = "kt_plan_btn", "kt_plan_box", "kt_tab"
LANGS = ("en", "ru", "zh", "ko", "ja")  # LLaMA-Factory's board languages: change_lang needs each

# the fields' labels are the recipe keys, their help the keys' own (kt_ft/plan/recipe.py); an
# emptied number field (0) means the key's default
LABELS: dict[str, dict[str, str]] = {
    ACCORDION: {"label": "kt-ft (MoE experts on the CPU)"},
    **{f.name: {"label": f.name, "info": f.metadata["help"]} for f in fields(KTArguments) if f.name in KEYS},
    PLAN_BUTTON: {"value": "Plan (kt-ft rules plan)"},
    PLAN_BOX: {"value": "The plan of the model path and rule above: what goes where and its memory."},
}


def patch_locales_module(locales: ModuleType) -> None:
    """Labels for the fields: LLaMA-Factory labels every element through ``LOCALES[name][lang]``
    when the page loads and when the language changes."""
    for name, text in LABELS.items():
        locales.LOCALES.setdefault(name, {lang: dict(text) for lang in LANGS})


def kt_train_args(values: dict[str, Any]) -> dict[str, Any]:
    """The recipe keys of the form's ``values`` (name -> value): none unless ``use_kt`` is ticked;
    an empty (or 0) rule, thread count, chunk size or GPU cap is left out (the run's default)."""
    if not values.get("use_kt"):
        return {}
    args: dict[str, Any] = {"use_kt": True, "kt_backend": values.get("kt_backend") or "auto"}
    rule = (values.get("kt_optimize_rule") or "").strip()
    if rule:
        args["kt_optimize_rule"] = rule
    for key, kind in (("cpu_infer", int), ("chunk_size", int), ("kt_gpu_memory", float)):
        value = values.get(key)
        # an emptied number field comes back as 0 (or None): the key's default, as when left out
        if value is not None and value != "" and value != 0:
            # gradio's Number gives floats; a whole float becomes the int the recipe key wants,
            # anything else is passed as typed so the check names the bad value
            args[key] = int(value) if kind is int and float(value).is_integer() else value
    return args


def check_train_args(args: dict[str, Any]) -> None:
    """What a run checks of its kt-ft keys before loading (``KTArguments.validate_kt``,
    ``check_kt_run``), for the arguments the board would launch; the messages name the
    ``training_args.yaml`` it writes. Raises one KTConfigError with every problem."""
    from llamafactory.extras.constants import TRAINING_ARGS

    source = os.path.join(str(args.get("output_dir", ".")), TRAINING_ARGS)
    names = {f.name for f in fields(KTArguments)}
    kt = KTArguments(**{k: v for k, v in args.items() if k in names and k != "use_kt"})
    problems: list[str] = []
    kt.use_kt = True  # set after construction: __post_init__ would check with the command line's file name
    try:
        kt.validate_kt(source=source)
    except KTConfigError as e:
        problems.extend(e.problems)
    model_args = SimpleNamespace(
        quantization_bit=args.get("quantization_bit"), infer_backend=args.get("infer_backend", "huggingface")
    )
    finetuning_args = SimpleNamespace(
        finetuning_type=args.get("finetuning_type"), stage=args.get("stage"), use_dora=args.get("use_dora")
    )
    try:
        check_kt_run(model_args, finetuning_args, source=source)
    except KTConfigError as e:
        problems.extend(e.problems)
    if problems:
        raise KTConfigError(problems)


def form_values(manager: Any, data: dict) -> dict[str, Any]:
    """The kt-ft fields' values in a callback's ``data`` (component -> value); empty when the tab
    was built without them."""
    out = {}
    for key in KEYS:
        try:
            out[key] = data[manager.get_elem_by_id(f"{TAB}.{key}")]
        except KeyError:
            continue
    return out


def patch_runner_module(runner: ModuleType) -> None:
    """``Runner._parse_train_args`` adds the keys; ``Runner._initialize`` refuses bad ones."""
    cls = runner.Runner
    if getattr(cls, "_kt_ft_patched", False):
        return
    original_parse = cls._parse_train_args
    original_initialize = cls._initialize

    def _parse_train_args(self, data):
        args = original_parse(self, data)
        kt = kt_train_args(form_values(self.manager, data))
        if not kt:
            return args
        extra = json.loads(data[self.manager.get_elem_by_id(f"{TAB}.extra_args")] or "{}")
        for key, value in kt.items():
            args.setdefault(key, value)  # "extra arguments" (JSON) win, as they do over LF's fields
        if "trust_remote_code" not in extra:
            # the board sets it for every model; a hub repo's remote code has per-expert modules,
            # not the fused experts module kt-ft replaces (README: known traps)
            args["trust_remote_code"] = False
        return args

    def _initialize(self, data, do_train, from_preview):
        error = original_initialize(self, data, do_train, from_preview)
        if error or not do_train:
            return error
        args = self._parse_train_args(data)
        if not args.get("use_kt"):
            return error
        try:
            check_train_args(args)
        except KTConfigError as e:
            return str(e)
        return error

    cls._parse_train_args = _parse_train_args
    cls._initialize = _initialize
    cls._kt_ft_patched = True


def plan_markdown(
    model_path: str,
    rule: str | None,
    kt_backend: str | None,
    cpu_infer: float | None,
    kt_gpu_memory: float | None,
    cutoff_len: int,
    batch_size: int,
    lora_rank: int,
) -> str:
    """``kt-ft rules plan``'s report for the form, as markdown (an error: kt-ft's message)."""
    from kt_ft.runtime.rules_plan import (  # why: torch on use only
        PlanRequest,
        default_rule,
        fits,
        format_plan,
        plan_report,
    )

    if not (model_path or "").strip():
        return "kt-ft plan: set the model path first (a local directory with config.json)."
    values = {"use_kt": True, "kt_optimize_rule": rule, "kt_backend": kt_backend, "cpu_infer": cpu_infer}
    values["kt_gpu_memory"] = kt_gpu_memory
    args = kt_train_args(values)
    try:
        KTArguments(**{k: v for k, v in args.items() if k != "use_kt"}).validate_kt(source="LlamaBoard")
        name = args.get("kt_optimize_rule") or default_rule(model_path)
        request = PlanRequest(
            rule=name,
            model=model_path,
            gpu_mem=args.get("kt_gpu_memory"),
            cutoff_len=int(cutoff_len),
            batch=int(batch_size),
            lora_rank=int(lora_rank),
            cpu_infer=args.get("cpu_infer"),
            kt_backend=args["kt_backend"],
        )
        report = plan_report(request)
    except (KTConfigError, OSError, ValueError) as e:
        # the message the command line prints (KTConfigError is a ValueError); the board shows it
        # instead of a stack trace in the server log
        return f"```text\n{e}\n```"
    verdict = "fits the budget" if fits(report) else "EXCEEDS the budget"
    head = f"rule `{name}`{'' if args.get('kt_optimize_rule') else ' (the family default)'}: {verdict}"
    return f"{head}\n\n```text\n{format_plan(report, model_path)}\n```"


def _create_fields() -> dict[str, Any]:
    import gradio as gr

    with gr.Accordion(open=False) as accordion:
        with gr.Row():
            use_kt = gr.Checkbox(elem_id="kt_ft_use_kt")
            rule = gr.Dropdown(
                choices=builtin_rule_names(), value=None, allow_custom_value=True, elem_id="kt_ft_rule"
            )
            backend = gr.Dropdown(choices=list(KT_BACKENDS), value="auto", elem_id="kt_ft_backend")
            cpu_infer = gr.Number(value=None, precision=0, minimum=1, elem_id="kt_ft_cpu_infer")
            chunk_size = gr.Number(value=4096, precision=0, minimum=1, elem_id="kt_ft_chunk_size")
            gpu_memory = gr.Number(value=None, minimum=0, elem_id="kt_ft_gpu_memory")
        with gr.Row():
            plan_btn = gr.Button(elem_id="kt_ft_plan_btn")
        with gr.Row():
            plan_box = gr.Markdown(elem_id="kt_ft_plan_box")
    return {
        ACCORDION: accordion,
        "use_kt": use_kt,
        "kt_optimize_rule": rule,
        "kt_backend": backend,
        "cpu_infer": cpu_infer,
        "chunk_size": chunk_size,
        "kt_gpu_memory": gpu_memory,
        PLAN_BUTTON: plan_btn,
        PLAN_BOX: plan_box,
    }


def _move_before(block: Any, anchor: Any) -> None:
    """Show ``block`` just above ``anchor`` (gradio lays a page out from each container's children
    list when the page is built): the fields sit above the Start button, not below the loss plot.
    Where the tab's layout is not what this expects, the fields stay where they were made."""
    parent = getattr(anchor, "parent", None)
    if parent is None or block.parent is not parent:
        return
    parent.children.remove(block)
    parent.children.insert(parent.children.index(anchor), block)


def patch_train_tab_module(train: ModuleType) -> None:
    """``create_train_tab``: the kt-ft fields join the tab, its inputs and its element ids."""
    if getattr(train, "_kt_ft_patched", False):
        return
    original = train.create_train_tab

    def create_train_tab(engine):
        created = _create_fields()
        inputs = {created[k] for k in KEYS}
        manager = engine.manager
        base_elems = manager.get_base_elems
        # the tab takes its input set from get_base_elems() first thing, and every button of the
        # tab (preview, start, save / load a configuration) sends that set: the fields join it
        manager.get_base_elems = lambda: base_elems() | inputs
        try:
            elems = original(engine)
        finally:
            del manager.get_base_elems  # the class's method again (the eval tab asks too)
        _move_before(created[ACCORDION], elems["start_btn"].parent)
        top = {k: manager.get_elem_by_id(f"top.{k}") for k in ("model_path",)}
        created[PLAN_BUTTON].click(
            plan_markdown,
            [
                top["model_path"],
                created["kt_optimize_rule"],
                created["kt_backend"],
                created["cpu_infer"],
                created["kt_gpu_memory"],
                elems["cutoff_len"],
                elems["batch_size"],
                elems["lora_rank"],
            ],
            [created[PLAN_BOX]],
            concurrency_limit=None,
        )
        return {**elems, **created}

    train.create_train_tab = create_train_tab
    train._kt_ft_patched = True
