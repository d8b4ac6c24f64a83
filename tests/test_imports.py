"""No import cycles between dcpgraph modules, at any level, and package edges that go one way.

Every ``.py`` file under ``dcpgraph/`` is parsed with :mod:`ast`; every ``import`` and
``from ... import`` statement, at module level or inside a function, class or ``if`` block, is an
edge to the dcpgraph module it names (relative imports resolved against the importing module's
package; ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``).
Importing a submodule also runs its parent packages' ``__init__``; those implicit edges are not
counted, as in the usual definition of an import cycle (``pkg/__init__`` importing ``pkg.a``
and ``pkg.a`` importing ``pkg.b`` is no cycle). Cycles are the strongly connected components
of that graph with more than one module.

The same scan, grouped by package (``dcpgraph.X`` for a subpackage or a top-level module, the root
``__init__`` as ``dcpgraph``), must follow :data:`LAYERS`: a package imports only packages of
lower layers, function-level imports included, so no package cycle can form. A new edge either
fits the order or changes the order here, in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dcpgraph

PACKAGE_DIR = Path(dcpgraph.__file__).parent

# Packages from low to high; a package may import packages of lower layers only (none of its own
# layer). Top-level modules count as packages; "dcpgraph" is the root __init__.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "models"),
    ("mesh", "layout", "capacity", "recurrent_state", "devices", "shard_rules"),
    ("program", "ops", "collectives"),
    ("pcp",),  # prefill context parallel: the split, its attention and the eager PCP path
    ("kv_budget",),
    ("memory",),  # the KV cache sized from a memory fraction (vLLM's --gpu-memory-utilization)
    ("runtime",),  # the engine, and the speculative interface (proposer registry, rejection)
    ("plan",),  # the cost model comm="auto" uses; calibration runs runtime's host collectives
    ("passes",),
    ("frontends", "backends"),
    ("tracing",),  # trace: a model's forward as a Program with canonical attention
    ("checkpoints",),
    ("config",),  # the configuration tree compile, LLM and serve build; options is its dict view
    ("speculative", "options"),
    ("compile_config",),  # what compile decides before tracing, and the refusals it makes by name
    ("api",),
    ("explain", "serving"),
    ("dcpgraph", "testing"),
    ("coverage", "cli"),
    ("__main__",),
]
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def package_of(module: str) -> str:
    """``dcpgraph.a.b`` -> ``a``; the root package -> ``dcpgraph``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layering_violations(sites, layer_of: dict[str, int], root: Path) -> list[str]:
    """``file:line: a -> b`` for every import whose package is not in a lower layer than the
    importer's (an unknown package is a violation too, so a new package must be placed)."""
    bad = []
    for name, target, path, line in sites:
        a, b = package_of(name), package_of(target)
        if a == b:
            continue
        if a not in layer_of or b not in layer_of or layer_of[b] >= layer_of[a]:
            where = path.relative_to(root.parent)
            bad.append(f"{where}:{line}: {a} -> {b} ({name} imports {target})")
    return bad


# Known cycles in files other work is moving, as frozensets of module names; the integrator
# empties this list once those moves land. Nothing else may be added here.
ALLOWED_CYCLES: list[frozenset[str]] = []


def module_files(root: Path = PACKAGE_DIR) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every module under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _known(name: str, modules) -> str | None:
    """``name`` or its nearest enclosing dcpgraph module; None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_sites(modules) -> list[tuple[str, str, Path, int]]:
    """``(importer, imported module, file, line)`` for every import of a dcpgraph module."""
    sites = []
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: set[str] = set()
            if isinstance(node, ast.Import):
                found |= {m for a in node.names if (m := _known(a.name, modules))}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    module = target if target in modules else _known(source, modules)
                    if module:
                        found.add(module)
            sites += [(name, target, path, node.lineno) for target in sorted(found) if target != name]
    return sites


def import_edges(modules) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, target, _, _ in import_sites(modules):
        edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], edges: dict[str, set[str]]) -> str:
    inside = set(component)
    lines = [f"  {a} -> {b}" for a in component for b in sorted(edges[a] & inside)]
    return "cycle between " + ", ".join(component) + ":\n" + "\n".join(lines)


def test_the_scanner_sees_relative_function_level_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import pkg.a\nfrom .. import c\n")
    (pkg / "c.py").write_text("from pkg.sub.b import thing\n")
    modules = module_files(pkg)
    edges = import_edges(modules)
    assert edges == {
        "pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a", "pkg.c"}, "pkg.c": {"pkg.sub.b"},
    }
    assert cycles(edges) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_cycles_between_dcpgraph_modules():
    edges = import_edges(module_files())
    assert len(edges) > 40 and "dcpgraph.passes.pipeline" in edges  # the scan found the package
    found = [c for c in cycles(edges) if frozenset(c) not in ALLOWED_CYCLES]
    if found:
        pytest.fail("\n".join(describe(c, edges) for c in found))


def test_the_layering_check_reports_a_disallowed_edge_with_its_line(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import high\n")
    (pkg / "high" / "a.py").write_text("from ..low import b\n")
    (pkg / "low" / "b.py").write_text("import os\n\n\ndef f():\n    from ..high.a import thing\n")
    sites = import_sites(module_files(pkg))
    layers = {"low": 0, "high": 1, "pkg": 2}
    assert layering_violations(sites, layers, pkg) == [
        "pkg/low/b.py:5: low -> high (pkg.low.b imports pkg.high.a)"]
    assert layering_violations(sites, {**layers, "low": 1, "high": 0}, pkg) == [
        "pkg/high/a.py:1: high -> low (pkg.high.a imports pkg.low.b)"]
    assert layering_violations(sites, {"low": 0, "high": 1}, pkg)[0] == (
        "pkg/__init__.py:1: pkg -> high (pkg imports pkg.high)")  # an unplaced package is reported


def test_every_package_is_placed_once_in_the_layers():
    placed = [p for layer in LAYERS for p in layer]
    assert len(placed) == len(set(placed))
    assert {package_of(m) for m in module_files()} == set(placed)


def test_package_imports_go_down_the_layers():
    sites = import_sites(module_files())
    assert len(sites) > 200
    bad = layering_violations(sites, LAYER_OF, PACKAGE_DIR)
    if bad:
        pytest.fail("imports against dcpgraph's package layers (tests/test_imports.py LAYERS):\n  "
                    + "\n  ".join(bad))


# Imports of another dcpgraph package made inside a function, each with the reason it is not at
# module level. Only optional dependencies justify one: anything else goes to the module's top.
FUNCTION_LEVEL_ALLOWED = {
    ("dcpgraph.cli", "dcpgraph.serving.cli"): "`dcpgraph serve` needs the [serve] extra (fastapi, uvicorn)",
    ("dcpgraph.cli", "dcpgraph.serving.proxy"): "`dcpgraph proxy` needs the [serve] extra (fastapi, httpx)",
}


def function_level_cross_package(modules) -> set[tuple[str, str]]:
    """``(importer, imported)`` for every import inside a function of a module of another package."""
    inside: set[tuple[str, int]] = set()
    for name, (path, _) in modules.items():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside |= {(name, n.lineno) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return {(name, target) for name, target, _, line in import_sites(modules)
            if (name, line) in inside and package_of(name) != package_of(target)}


def test_imports_inside_functions_cross_packages_only_for_optional_dependencies():
    found = function_level_cross_package(module_files())
    assert found <= set(FUNCTION_LEVEL_ALLOWED), sorted(found - set(FUNCTION_LEVEL_ALLOWED))
