"""The house rules of docs/architecture.md: imports flow one way (pallas <- longspec_jax <- infer <- infer.bench
<- tools; train uses longspec_jax), no import cycles (imports inside functions included), nothing imports tests,
the installed packages never import tools, no module over 400 lines, and every module imports in a fresh
interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

PACKAGES = ("pallas", "longspec_jax", "infer", "train", "tools")  # tools/ is not installed (pyproject.toml)
MODEL_FILES = REPO_ROOT / "infer" / "default_model"  # weights, and the scripts that made them (run elsewhere)
# Which top-level parts each part may import (infer.bench is a part of its own).
ALLOWED = {"pallas": {"pallas"}, "longspec_jax": {"longspec_jax", "pallas"},
           "infer": {"infer", "longspec_jax", "pallas"},
           "infer.bench": {"infer.bench", "infer", "longspec_jax", "pallas"},
           "train": {"train", "longspec_jax", "pallas"},
           "tools": {"tools", "infer.bench", "infer", "longspec_jax", "pallas"}}
MAX_LINES = 400


def _modules() -> dict[str, object]:
    mods = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path.is_relative_to(MODEL_FILES):
                continue
            name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _part(module: str) -> str:
    return "infer.bench" if module.startswith("infer.bench") else module.split(".")[0]


def _imports(path) -> set[str]:
    """Every module named by an import statement anywhere in the file (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _graph():
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = {t for t in _imports(path) if t in mods and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return mods, graph


def test_pyproject_installs_the_product_packages_only():
    import tomllib

    include = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert sorted(include["include"]) == sorted(f"{p}*" for p in PACKAGES if p != "tools")


def test_no_module_imports_tests_or_breaks_the_flow():
    mods, graph = _graph()
    problems = []
    for name, path in mods.items():
        for target in _imports(path):
            if target.split(".")[0] == "tests":
                problems.append(f"{name} imports {target}")
        for dep in graph[name]:
            if _part(dep) not in ALLOWED[_part(name)]:
                problems.append(f"{name} imports {dep} against the flow")
    assert not problems, problems


def test_import_graph_has_no_cycle():
    _, graph = _graph()
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, cycles


def test_no_module_over_400_lines():
    long = {name: n for name, path in _modules().items() if (n := path.read_text().count("\n")) > MAX_LINES}
    assert not long, long


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(_modules())
    script = "import importlib, sys\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(names) > 50
