"""Start-up hook, run by ``kt_ft_activate.pth`` in every Python process.

It only registers an import hook: when (and if) LLaMA-Factory's argument parser, model
loader, training entry (tuner), SFT and PT workflows, chat engine or LlamaBoard's Train tab, runner and
labels are imported, kt-ft's patches are applied right after the module body has run.
Nothing heavy is imported here, so a process that never imports llamafactory pays about
nothing. Set ``KT_FT_DISABLE=1`` to turn the hook off.
"""

from __future__ import annotations

import importlib
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

from kt_ft.base.settings import enabled

# module imported -> "package.module:function" that patches it
POST_IMPORT_PATCHES = {
    "llamafactory.hparams.parser": "kt_ft.integrations.llamafactory.patches:patch_parser_module",
    "llamafactory.model.loader": "kt_ft.integrations.llamafactory.patches:patch_loader_module",
    "llamafactory.train.tuner": "kt_ft.integrations.llamafactory.workflow:patch_tuner_module",
    "llamafactory.train.sft.workflow": "kt_ft.integrations.llamafactory.workflow:patch_sft_workflow_module",
    "llamafactory.train.pt.workflow": "kt_ft.integrations.llamafactory.workflow:patch_pt_workflow_module",
    "llamafactory.chat.hf_engine": "kt_ft.integrations.llamafactory.chat:patch_hf_engine_module",
    # LlamaBoard (llamafactory-cli webui): the kt-ft fields of the Train tab
    "llamafactory.webui.locales": "kt_ft.integrations.llamafactory.webui:patch_locales_module",
    "llamafactory.webui.components.train": "kt_ft.integrations.llamafactory.webui:patch_train_tab_module",
    "llamafactory.webui.runner": "kt_ft.integrations.llamafactory.webui:patch_runner_module",
}


def _run_patch(target: str, module: ModuleType) -> None:
    mod_name, func_name = target.split(":")
    getattr(importlib.import_module(mod_name), func_name)(module)


class _PatchingLoader(Loader):
    """Delegates to the real loader, then applies the patch to the executed module."""

    def __init__(self, inner: Loader, target: str) -> None:
        self._inner = inner
        self._target = target

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _run_patch(self._target, module)

    def __getattr__(self, name: str):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


class PostImportFinder(MetaPathFinder):
    """Finds nothing itself: wraps the spec the other finders return for patched modules."""

    def find_spec(self, fullname, path, target=None):
        patch = POST_IMPORT_PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    if enabled("KT_FT_DISABLE"):
        return
    if any(isinstance(f, PostImportFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, PostImportFinder())
    # Modules imported before the hook (only possible when install() is called late, e.g. tests).
    for name, patch in POST_IMPORT_PATCHES.items():
        if name in sys.modules:
            _run_patch(patch, sys.modules[name])


install()
