"""kt-ft's modules form layers, each importing only the ones below it (and its own), and no
import cycle: every module imports on its own, in a fresh interpreter.

Layers, lowest first (a module belongs to the layer of its longest matching prefix):

- base: errors, log, settings, the start-up hook, the recipe keys (``hparams``), process topology;
- op: the CPU expert op (``kernels``), the expert-LoRA layout (``lora``) and the quantized weight
  formats (``quant``): tensor code only;
- models: per-family facts (which modules are the experts, their layout as an ExpertSpec);
- planning: rules, plan, ``rules plan``'s estimate, cost model, planner, ``placement: auto``;
- runtime: the experts module (``moe``), rate measurement and re-planning, checkpoints, DDP/FSDP,
  the process memory report, ``kt_ft.apply``, export, the demo model;
- integration: LLaMA-Factory, ``kt-ft bench``, the CLI.

Only module-level imports are checked against the order: a function-local kt-ft import is for
start-up cost or an optional dependency, and says so with a ``# why`` comment on its line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kt_ft"

LAYERS: dict[str, tuple[str, ...]] = {
    "base": (
        "kt_ft",
        "kt_ft._startup",
        "kt_ft.errors",
        "kt_ft.log",
        "kt_ft.settings",
        "kt_ft.hparams",
        "kt_ft.processes",
    ),
    "op": ("kt_ft.kernels", "kt_ft.lora", "kt_ft.quant"),  # quant.loading reads files: runtime (below)
    "models": ("kt_ft.models",),  # derived, dispatch and probe sit higher (below)
    "planning": (
        "kt_ft.rules",
        "kt_ft.placement",  # the package doc; measure and runtime are runtime (below)
        "kt_ft.placement.cost",
        "kt_ft.placement.planner",
        "kt_ft.placement.homes",
        "kt_ft.placement.auto",
        "kt_ft.models.derived",  # a family from a model's meta skeleton (rules.skeleton)
    ),
    "runtime": (
        "kt_ft.moe",
        "kt_ft.quant.loading",  # quantized experts read from the files (moe's readers)
        "kt_ft.placement.measure",
        "kt_ft.placement.runtime",
        "kt_ft.placement.non_expert",
        "kt_ft.checkpoint",
        "kt_ft.distributed",
        "kt_ft.fsdp",
        "kt_ft.memory",
        "kt_ft.run_stats",
        "kt_ft.models.dispatch",  # transformers' experts interface answered by the CPU op (moe)
        "kt_ft.core",
        "kt_ft.export",
        "kt_ft.demo",
        "kt_ft.demo_vl",
    ),
    "integration": (
        "kt_ft.llamafactory",
        "kt_ft.bench",
        "kt_ft.cli",
        "kt_ft.planning",  # `kt-ft rules plan`'s computation (rate measurement: runtime), CLI and LlamaBoard
        "kt_ft.models.probe",
        "kt_ft.models.lf_check",
    ),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def layer_of(module: str, layers: dict[str, tuple[str, ...]] = LAYERS) -> int:
    """Index of ``module``'s layer (longest matching prefix); KeyError when no layer names it."""
    best, rank = -1, None
    for i, prefixes in enumerate(layers.values()):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise KeyError(f"{module} is in no layer of tests/test_layers.py LAYERS")
    return rank


def _target(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def kt_imports(
    module: str, path: Path, known: dict[str, Path]
) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(module-level, function-local) kt_ft imports of ``module``: (line, imported module). A
    ``from X import name`` counts as X.name where that is a module, else X; importing X.Y also
    imports its packages X (their ``__init__``), counted as imports of them too."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    top: list[tuple[int, str]] = []
    local: list[tuple[int, str]] = []

    def add(out, line, name):
        if not name or not name.startswith("kt_ft"):
            return
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # the packages on the way, then the module
            prefix = ".".join(parts[:i])
            if prefix != module and not module.startswith(prefix + "."):
                out.append((line, prefix))

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, True)
                continue
            out = local if in_function else top
            if isinstance(child, ast.ImportFrom):
                target = _target(module, is_package, child)
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    add(out, child.lineno, sub if sub in known else target)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    add(out, child.lineno, alias.name)
            else:
                visit(child, in_function)

    visit(tree, False)
    return top, local


def layer_violations(package: Path = PACKAGE, layers: dict[str, tuple[str, ...]] = LAYERS) -> list[str]:
    """Module-level imports from a lower layer to a higher one, as 'file:line: a (layer) -> b (layer)'."""
    names = list(layers)
    out = []
    known = all_modules(package)
    for module, path in known.items():
        own = layer_of(module, layers)
        top, _ = kt_imports(module, path, known)
        for line, target in top:
            other = layer_of(target, layers)
            if other > own:
                out.append(f"{path.name}:{line}: {module} ({names[own]}) imports {target} ({names[other]})")
    return out


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Cycles of module-level imports (each as the list of modules around it)."""
    known = all_modules(package)
    graph = {m: {t for _, t in kt_imports(m, p, known)[0]} for m, p in known.items()}
    cycles, state = [], {}

    def walk(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            walk(m, [])
    return cycles


def unexplained_local_imports(package: Path = PACKAGE) -> list[str]:
    out = []
    known = all_modules(package)
    for module, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        ends = {n.lineno: n.end_lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
        _, local = kt_imports(module, path, known)
        for line, target in sorted(set(local)):
            text = lines[line - 1]
            if not any("# why" in t for t in lines[line - 1 : ends.get(line, line)]):
                out.append(f"{path.name}:{line}: {module} imports {target} inside a function: {text.strip()}")
    return out


def test_every_module_is_in_a_layer():
    for module in all_modules():
        layer_of(module)  # raises for a new module nobody placed


def test_no_module_level_import_goes_up_a_layer():
    assert layer_violations() == []


def test_no_import_cycle():
    assert import_cycles() == []


def test_function_local_kt_ft_imports_say_why():
    assert unexplained_local_imports() == []


def test_every_module_imports_on_its_own():
    """Each module imported with no other kt-ft module loaded (all are dropped from
    ``sys.modules`` between two), in one fresh interpreter (torch and the like stay loaded: a
    process per module would take minutes): an import cycle that only works in some import order
    fails here; ``test_no_import_cycle`` checks the same statically."""
    script = (
        "import importlib, sys, traceback\n"
        "bad = []\n"
        f"for m in {sorted(all_modules())!r}:\n"
        "    for k in [k for k in sys.modules if k == 'kt_ft' or k.startswith('kt_ft.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# The checker itself: it must see a violation, a cycle and an unexplained local import.


@pytest.fixture
def toy(tmp_path):
    pkg = tmp_path / "kt_ft"
    for rel, text in {
        "__init__.py": "",
        "errors.py": "",
        "rules/__init__.py": "",
        "rules/plan.py": "from ..moe import experts\n",  # planning -> runtime: up a layer
        "moe/__init__.py": "",
        "moe/experts.py": "from . import patch\n",
        "moe/patch.py": "from .experts import x\n\ndef f():\n    from ..rules import plan\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    layers = {"base": ("kt_ft", "kt_ft.errors"), "planning": ("kt_ft.rules",), "runtime": ("kt_ft.moe",)}
    return pkg, layers


def test_checker_sees_an_upward_import(toy):
    pkg, layers = toy
    assert layer_violations(pkg, layers) == [
        "plan.py:1: kt_ft.rules.plan (planning) imports kt_ft.moe (runtime)",
        "plan.py:1: kt_ft.rules.plan (planning) imports kt_ft.moe.experts (runtime)",
    ]
    assert layer_violations(pkg, {**layers, "planning": ("kt_ft.rules", "kt_ft.moe")}) == []


def test_checker_sees_a_cycle_and_an_unexplained_local_import(toy):
    pkg, _ = toy
    assert import_cycles(pkg) == [["kt_ft.moe.experts", "kt_ft.moe.patch", "kt_ft.moe.experts"]]
    assert unexplained_local_imports(pkg) == [
        "patch.py:4: kt_ft.moe.patch imports kt_ft.rules inside a function: from ..rules import plan",
        "patch.py:4: kt_ft.moe.patch imports kt_ft.rules.plan inside a function: from ..rules import plan",
    ]
    with pytest.raises(KeyError, match="kt_ft.lora is in no layer"):
        layer_of("kt_ft.lora", {"base": ("kt_ft.errors",)})
