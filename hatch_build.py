"""Hatch build hook: ship the start-up `.pth` that activates kt-ft inside LLaMA-Factory, and
compile kt-ft's C++ CPU kernels (`kernels/*.cpp`) into `kt_ft/backends/_native/`.

The `.pth` file must sit at the root of site-packages, which `force-include` in pyproject
reaches for normal wheels only; editable wheels need `force_include_editable`.
Its name sorts after hatchling's own `_kt_ft.pth` (the editable path hook), so the package
is importable when our line runs.

The kernels are compiled for both wheel and editable installs (an editable install loads them
from the source tree, where they are git-ignored). A failed compilation does not fail the
install: the `native` backend then reports itself unavailable with the compiler's reason (and
tries again, into the user cache, on first use).
"""

import importlib.util
import sys
import sysconfig
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH = "kt_ft/integrations/_activate.pth"
TARGET = "kt_ft_activate.pth"
NATIVE_DIR = "kt_ft/backends/_native"


def _native_build(root: Path):
    """kt_ft/backends/native_build.py loaded by path: kt_ft itself (torch) is not importable here."""
    spec = importlib.util.spec_from_file_location(
        "_ktft_native_build", root / "kt_ft/backends/native_build.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        build_data.setdefault("force_include", {})[PTH] = TARGET
        build_data.setdefault("force_include_editable", {})[PTH] = TARGET
        root = Path(self.root)
        nb = _native_build(root)
        lib, why = nb.build(root / NATIVE_DIR, root / "kernels")
        if lib is None:
            print(
                f"kt-ft: native CPU kernels not built ({why}); the 'native' backend will say so",
                file=sys.stderr,
            )
            return
        if version != "editable":  # git-ignored build outputs: included explicitly, as a platform wheel
            for name in (nb.LIB_NAME, nb.HASH_NAME):
                build_data["force_include"][str(root / NATIVE_DIR / name)] = f"{NATIVE_DIR}/{name}"
            build_data["pure_python"] = False
            # the library is loaded with ctypes, not linked against CPython: one wheel for every
            # Python 3 on this platform (py3-none-<platform>), not a cpXY one
            platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
            build_data["tag"] = f"py3-none-{platform}"
