"""Hatch build hook: ship the start-up `.pth` that activates kt-ft inside LLaMA-Factory.

The `.pth` file must sit at the root of site-packages, which `force-include` in pyproject
reaches for normal wheels only; editable wheels need `force_include_editable`.
Its name sorts after hatchling's own `_kt_ft.pth` (the editable path hook), so the package
is importable when our line runs.
"""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH = "kt_ft/_activate.pth"
TARGET = "kt_ft_activate.pth"


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        build_data.setdefault("force_include", {})[PTH] = TARGET
        build_data.setdefault("force_include_editable", {})[PTH] = TARGET
