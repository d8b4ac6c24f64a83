"""No instance attribute hides a method of its own class: ``self.abort = event`` in an
``__init__`` made ``engine.abort(rid)`` a call of ``None`` in the server (every client that went
away killed the engine). Checked statically over every class in the package, bases included."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import dcpgraph


def _classes():
    for info in pkgutil.walk_packages(dcpgraph.__path__, "dcpgraph."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra absent (torch_npu, ...): its modules are not checked
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                yield cls


def _assigned_self_attributes(cls) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (built in C, or made at run time)
        return set()
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def test_no_instance_attribute_shadows_a_method():
    clashes, checked = [], set()
    for cls in _classes():
        checked.add(cls.__module__)
        methods = {name for name, value in inspect.getmembers(cls) if inspect.isfunction(value)}
        for name in _assigned_self_attributes(cls) & methods:
            clashes.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert "dcpgraph.serving.workers" in checked and "dcpgraph.runtime.scheduler" in checked  # the serving extra is installed
    assert not clashes, f"attributes assigned over methods of the same name: {sorted(clashes)}"
