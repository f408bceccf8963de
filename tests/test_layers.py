"""The import contract: the layers of .importlinter hold, a wrong import breaks them by name,
and no module imports itself through others (no import circle)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "engine", "backends")


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the packages under ``tree`` (first on the path: not the installed ones)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                                                 "sys.exit(lint_imports_command())", "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def copy_tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so", "lib"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def test_the_layers_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, wrong", [
    ("engine/sched/request.py", "engine.frontend.async_engine"),  # the scheduler reaching up to the front
    ("engine/runner/sampler.py", "engine.sched.scheduler"),  # the runner reading the scheduler
    ("engine/core/core_actor.py", "api.app"),  # the engine importing the HTTP layer
    ("engine/sched/request.py", "engine.structured_outputs"),  # torch and trio into the scheduler, indirectly
    ("engine/config.py", "engine.core.engine_core"),  # the vocabulary reaching up
])
def test_a_wrong_import_breaks_the_contract_by_name(tmp_path, module, wrong):
    tree = copy_tree(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\nimport {wrong}  # noqa: E402,F401\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {wrong}" in result.stdout, result.stdout


@pytest.mark.parametrize("module, absent", [("engine.sched.scheduler", ("torch", "trio")),
                                            ("engine.runner.model_runner", ("trio",))])
def test_a_layer_loads_without_what_it_must_not_use(module, absent):
    """What the contract says of the imports holds at run time too (nothing loads it lazily)."""
    code = f"import sys, {module}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    modules = sorted(graph.modules)
    imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    # Tarjan's strongly connected components: any component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in imports.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(modules)))
    for module in modules:
        if module not in index:
            visit(module)
    assert circles == []


def test_only_the_serve_entry_point_imports_the_http_layer_from_the_engine():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    importers = {m for m in graph.modules if m.startswith("engine")
                 and any(d.split(".")[0] == "api" for d in graph.find_modules_directly_imported_by(m))}
    assert importers == {"engine.api"}
