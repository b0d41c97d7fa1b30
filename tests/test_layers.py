"""Arrows run down: the runtime a user imports never imports what is built on it, and no modules import each other.

Layers, lowest first (an import, at module level or inside a function, may only point to its own layer or lower):

    runtime       qcache/*.py                 the cache and what it reads (codecs, store, RoPE, kernels, file format)
    tools         qcache/tools/               applications on the runtime (models, data, size, demo, export, publish,
                                              footprint)
    calibration   calibration/                learning from real text (its command: calibration/cli.py)
    eval          eval/                       measurement (lm-eval adapter, fidelity, the doctor)
    bench         bench/                      benchmarks writing docs/results

The three entry points a user types, `python -m qcache.calibrate`, `qcache.demo` and `qcache.size`, are two-line
shims in qcache/ that hand over to the command above; nothing imports them.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "tools", "calibration", "eval", "bench")
ENTRY_POINTS = {"qcache.calibrate": "calibration", "qcache.demo": "tools", "qcache.size": "tools"}


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("qcache", "calibration", "eval", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()
PACKAGES = ("qcache", "calibration", "eval", "bench")


def _layer(module: str) -> str:
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    if module == "qcache.tools" or module.startswith("qcache.tools."):
        return "tools"
    if module == "qcache" or module.startswith("qcache."):
        return "runtime"
    return module.split(".")[0]


def _imports(module: str) -> set[str]:
    """The project modules `module` imports anywhere in its file; `from pkg import sub` names the submodule."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        for target in targets:
            if target.split(".")[0] not in PACKAGES:
                continue  # not the project's
            if target not in MODULES:
                found.add(f"<missing {target}>")  # a module that moved away: a stale import
            elif target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_project_import_resolves():
    """An import of a module that moved away (a relative import inside a function runs only when called)."""
    stale = {m: sorted(t for t in targets if t.startswith("<missing")) for m, targets in GRAPH.items()}
    assert {m: t for m, t in stale.items() if t} == {}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = LAYERS.index(_layer(module))
    upward = sorted(t for t in GRAPH[module] if not t.startswith("<") and LAYERS.index(_layer(t)) > mine)
    assert upward == [], f"{module} ({_layer(module)}) imports {upward} from a layer above it"


def test_nothing_imports_the_entry_points():
    importers = sorted(m for m, targets in GRAPH.items() if targets & set(ENTRY_POINTS))
    assert importers == []


def test_entry_points_only_hand_over():
    for module in ENTRY_POINTS:
        assert len(MODULES[module].read_text().splitlines()) <= 10, module


def test_no_import_cycles():
    """Tarjan's strongly connected components over the module graph: every component is one module."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in (t for t in GRAPH[node] if not t.startswith("<")):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert cycles == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walker finds a function-local relative import (the kind that hid the old cycles)."""
    fake = tmp_path / "qcache" / "cache.py"
    fake.parent.mkdir()
    fake.write_text("def f():\n    from .tools import models\n    from eval.fidelity import run_fidelity\n"
                    "    from .needles import build_needles\n")
    monkeypatch.setitem(MODULES, "qcache.cache", fake)
    assert {"qcache.tools.models", "eval.fidelity", "<missing qcache.needles>"} <= _imports("qcache.cache")
