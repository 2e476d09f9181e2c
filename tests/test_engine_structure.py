"""Issue 34, engine: no import cycle in the engine, no ``_private`` name imported from another module of this project,
sensitivity beside the algorithms, and the names users import from ``quantization.api`` still there.

The import graph is read from the source (every import statement, those inside functions included, those under
``if TYPE_CHECKING:`` left out), independently of import-linter, which CI runs on the layer contracts."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tuple(p for p in ("quark", "callbacks", "app", "tasks", "quark_lightning") if (ROOT / p).is_dir())


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every first-party module (a package by its ``__init__``)."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(imported first-party module, imported name or None) for each import statement of one module."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if base not in modules:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None) if sub in modules else (base, alias.name))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m, _ in _imports(name, path, modules)} - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_engine_has_no_import_cycle() -> None:
    """api -> graph -> api, config <-> spec_helpers, config.type <-> formats and app.run <-> app.sweepdir were cycles;
    none is left anywhere in the project's packages."""
    assert [sorted(c) for c in _cycles(_graph())] == []


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("quark.torch.quantization.config.type", "quark.torch.quantization.formats"),
        ("quark.torch.quantization.config.spec_helpers", "quark.torch.quantization.config.config"),
        ("quark.torch.quantization.graph.prepare", "quark.torch.quantization.api"),
        ("quark.torch.quantization.resolve", "quark.torch.quantization.api"),
    ],
)
def test_a_lower_module_does_not_import_an_upper_one(lower: str, upper: str) -> None:
    graph = _graph()
    assert not any(m == upper or m.startswith(upper + ".") for m in graph[lower])


def test_no_private_name_is_imported_from_another_module() -> None:
    modules = _modules()
    found = [
        f"{name} imports {source}.{imported}"
        for name, path in modules.items()
        for source, imported in _imports(name, path, modules)
        if imported is not None and imported.startswith("_") and not imported.startswith("__")
    ]
    assert found == []


def test_sensitivity_lives_beside_the_algorithms_and_its_old_path_still_imports() -> None:
    new = importlib.import_module("quark.torch.algorithm.sensitivity")
    old = importlib.import_module("quark.torch.quantization.sensitivity")
    assert new.measure_sensitivity.__module__ == "quark.torch.algorithm.sensitivity"
    assert all(getattr(old, n) is getattr(new, n) for n in old.__all__)
    assert not any(m.startswith("quark.torch.algorithm") for m in _graph()["quark.torch.quantization.api"])


def test_names_imported_from_api_stay_importable_there() -> None:
    """The split moved resolution, coverage and batch feeding out of api.py; what users import from it stays."""
    api = importlib.import_module("quark.torch.quantization.api")
    homes = {
        "LayerPlan": "resolve",
        "unmatched_names": "resolve",
        "format_plans": "resolve",
        "qparams_source": "resolve",
        "activation_axes_to_check": "resolve",
        "check_activation_shapes": "resolve",
        "run_batch": "batches",
        "uncalibrated_layers": "coverage",
    }
    for name, home in homes.items():
        module = importlib.import_module(f"quark.torch.quantization.{home}")
        assert getattr(api, name) is getattr(module, name), name
    assert api.ModelQuantizer.__module__ == "quark.torch.quantization.api"
