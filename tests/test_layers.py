"""kt-ft's folders are its layers: a module imports only modules of its own layer or below, no
import cycle runs between two modules or between two packages, and no function-local import
goes up a layer or closes a cycle (a deferred import is for start-up cost or an optional
dependency, and says so with a ``# why`` comment on its line, never to dodge a cycle).

Layers, lowest first; each is one folder of ``kt_ft`` (docs/how-it-works.md "Layout"):

- base: errors, the log, the settings registry, process topology, atomic file writes;
- formats: what kt-ft reads and writes on disk: the expert-LoRA file and its layout, the adapter
  manifest, a model's files (its meta skeleton, where its expert bytes lie);
- backends: compute: the CPU expert backends (Python side of ``kernels/``), grouped products,
  quantized formats and their dequantizers, the fused LoRA linear, norm, rotary and loss;
- plan: touches no device: the rule language, model facts, the memory and cost model, the
  planner;
- runtime: the model changed in place: ``kt_ft.apply``, the experts modules and the CPU op,
  placement at run time, loading, streaming, adapters, data parallelism;
- integrations: LLaMA-Factory, the CLI, ``kt-ft bench`` (a leaf: only the CLI imports it),
  export for serving engines, the demo models.

The package root (``kt_ft/__init__.py``, ``__main__.py``) is the public facade above them all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kt_ft"

LAYER_NAMES = ("base", "formats", "backends", "plan", "runtime", "integrations")
LAYERS: dict[str, tuple[str, ...]] = {name: (f"kt_ft.{name}",) for name in LAYER_NAMES}
LAYERS["facade"] = ("kt_ft",)  # the package root: longest prefix wins, so only its own modules
# leaf packages: (package, the only modules that may import it)
LEAVES = {"kt_ft.integrations.bench": ("kt_ft.integrations.cli.main",)}


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
    imports its packages X (their ``__init__``), counted as imports of them too, except the root
    ``kt_ft`` (the facade: every module passes through it, and it imports nothing at load)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    top: list[tuple[int, str]] = []
    local: list[tuple[int, str]] = []

    def add(out, line, name):
        if not name or not name.startswith("kt_ft"):
            return
        parts = name.split(".")
        for i in range(2, len(parts) + 1):  # the packages on the way, then the module
            prefix = ".".join(parts[:i])
            if prefix != module and not module.startswith(prefix + "."):
                out.append((line, prefix))
        if name == "kt_ft" and module != "kt_ft":
            out.append((line, name))

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


def import_graph(package: Path = PACKAGE) -> dict[str, set[tuple[int, str]]]:
    """Module -> every kt_ft module it imports, at module level or inside a function: (line, name)."""
    known = all_modules(package)
    graph = {}
    for m, p in known.items():
        top, local = kt_imports(m, p, known)
        graph[m] = set(top) | set(local)
    return graph


def layer_violations(package: Path = PACKAGE, layers: dict[str, tuple[str, ...]] = LAYERS) -> list[str]:
    """Imports (module-level or deferred) from a lower layer to a higher one, as
    'file:line: a (layer) imports b (layer)'."""
    names = list(layers)
    out = []
    known = all_modules(package)
    for module, edges in import_graph(package).items():
        own = layer_of(module, layers)
        for line, target in sorted(edges):
            other = layer_of(target, layers)
            if other > own:
                out.append(
                    f"{known[module].name}:{line}: {module} ({names[own]}) imports {target} ({names[other]})"
                )
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Cycles of imports between modules, deferred ones included (each as the modules around it)."""
    return _cycles({m: {t for _, t in edges} for m, edges in import_graph(package).items()})


def package_of(module: str, known: dict[str, Path]) -> str:
    return module if known[module].name == "__init__.py" else module.rpartition(".")[0]


def package_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Cycles between packages (folders): package A imports a module of B and B one of A. The
    packages a dotted import passes through do not count; only the modules it names."""
    known = all_modules(package)
    graph: dict[str, set[str]] = {}
    for m, edges in import_graph(package).items():
        src = package_of(m, known)
        for _, t in edges:
            if known[t].name == "__init__.py" and t in {x.rpartition(".")[0] for x in known}:
                continue  # a package on the way (or the package's own doc module)
            dst = package_of(t, known)
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return _cycles(graph)


def leaf_violations(package: Path = PACKAGE, leaves: dict[str, tuple[str, ...]] = LEAVES) -> list[str]:
    """Imports of a leaf package from outside it by modules other than its allowed importers."""
    out = []
    for m, edges in import_graph(package).items():
        for leaf, allowed in leaves.items():
            if m == leaf or m.startswith(leaf + ".") or m in allowed:
                continue
            for line, t in sorted(edges):
                if t == leaf or t.startswith(leaf + "."):
                    out.append(f"{m}:{line} imports {t} (only {', '.join(allowed)} may)")
    return out


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


def test_every_module_is_in_a_layer_folder():
    """Every module lives in one of the layer folders (the root holds only the facade)."""
    for module, path in all_modules().items():
        assert path.parent != PACKAGE or path.name in ("__init__.py", "__main__.py"), (
            f"{path} sits at the package root: move it into one of {', '.join(LAYER_NAMES)}"
        )
        layer_of(module)


def test_no_import_goes_up_a_layer():
    assert layer_violations() == []


def test_no_import_cycle_between_modules():
    assert import_cycles() == []


def test_no_import_cycle_between_packages():
    assert package_cycles() == []


def test_leaf_packages_are_imported_only_by_their_front_end():
    assert leaf_violations() == []


def test_function_local_kt_ft_imports_say_why():
    assert unexplained_local_imports() == []


def test_every_module_imports_on_its_own():
    """Each module imported with no other kt-ft module loaded (all are dropped from
    ``sys.modules`` between two), in one fresh interpreter (torch and the like stay loaded: a
    process per module would take minutes): an import cycle that only works in some import order
    fails here; ``test_no_import_cycle_between_modules`` checks the same statically."""
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


# The checker itself: it must see an upward import (deferred ones too), a module cycle, a package
# cycle, a leaf imported from elsewhere and an unexplained local import.


@pytest.fixture
def toy(tmp_path):
    pkg = tmp_path / "kt_ft"
    for rel, text in {
        "__init__.py": "",
        "base/__init__.py": "",
        "base/errors.py": "",
        "plan/__init__.py": "",
        "plan/rules.py": "from ..runtime import experts\n",  # plan -> runtime: up a layer
        "plan/cost.py": "def f():\n    from ..runtime import patch  # why: dodges nothing, still upward\n",
        "runtime/__init__.py": "",
        "runtime/experts.py": "from . import patch\n",
        "runtime/patch.py": "from .experts import x\n\ndef f():\n    from ..plan import rules\n",
        "runtime/sub/__init__.py": "",
        "runtime/sub/leaf.py": "from ..experts import x\n",
        "runtime/uses_leaf.py": "from .sub import leaf\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    layers = {
        "base": ("kt_ft.base",),
        "plan": ("kt_ft.plan",),
        "runtime": ("kt_ft.runtime",),
        "facade": ("kt_ft",),
    }
    return pkg, layers


def test_checker_sees_upward_imports_deferred_ones_too(toy):
    pkg, layers = toy
    assert layer_violations(pkg, layers) == [
        "cost.py:2: kt_ft.plan.cost (plan) imports kt_ft.runtime (runtime)",
        "cost.py:2: kt_ft.plan.cost (plan) imports kt_ft.runtime.patch (runtime)",
        "rules.py:1: kt_ft.plan.rules (plan) imports kt_ft.runtime (runtime)",
        "rules.py:1: kt_ft.plan.rules (plan) imports kt_ft.runtime.experts (runtime)",
    ]
    assert layer_violations(pkg, {**layers, "plan": ("kt_ft.plan", "kt_ft.runtime")}) == []


def test_checker_sees_module_and_package_cycles(toy):
    pkg, _ = toy
    cycles = [set(c) for c in import_cycles(pkg)]
    assert any({"kt_ft.runtime.experts", "kt_ft.runtime.patch"} <= c for c in cycles), cycles
    packages = [set(c) for c in package_cycles(pkg)]
    # runtime.patch's deferred import of plan.rules closes plan -> runtime -> plan
    assert {"kt_ft.plan", "kt_ft.runtime"} in packages, packages
    # runtime -> runtime.sub (uses_leaf) and runtime.sub -> runtime (leaf): a cycle between folders
    assert {"kt_ft.runtime", "kt_ft.runtime.sub"} in packages, packages


def test_checker_sees_a_leaf_imported_from_elsewhere(toy):
    pkg, _ = toy
    assert leaf_violations(pkg, {"kt_ft.runtime.sub": ("kt_ft.runtime.patch",)}) == [
        "kt_ft.runtime.uses_leaf:1 imports kt_ft.runtime.sub (only kt_ft.runtime.patch may)",
        "kt_ft.runtime.uses_leaf:1 imports kt_ft.runtime.sub.leaf (only kt_ft.runtime.patch may)",
    ]


def test_checker_sees_an_unexplained_local_import(toy):
    pkg, _ = toy
    assert unexplained_local_imports(pkg) == [
        "patch.py:4: kt_ft.runtime.patch imports kt_ft.plan inside a function: from ..plan import rules",
        "patch.py:4: kt_ft.runtime.patch imports kt_ft.plan.rules inside a function: from ..plan import rules",
    ]
    with pytest.raises(KeyError, match="kt_ft.lora is in no layer"):
        layer_of("kt_ft.lora", {"base": ("kt_ft.base",)})
