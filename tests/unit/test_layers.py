"""The package's architecture, checked: every module sits in a layer, imports run one way (a module
imports only from its own layer and the layers below it), there is no import cycle, and no module
calls another module's private function."""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

PACKAGE = Path(qkv.__file__).parent
# Bottom to top; the layers of one row may import each other's modules, none imports a row above.
LAYERS = [("errors",), ("model", "data"), ("io",), ("infer",), ("train", "interop"), ("inspect",), ("document",), ("serve",), ("cli",)]
RANK = {name: rank for rank, row in enumerate(LAYERS) for name in row}


def modules() -> dict[str, Path]:
    """qkv's modules by dotted name (packages by their __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The qkv modules ``path`` imports, anywhere in it (functions and TYPE_CHECKING blocks included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("qkv.")}
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module == "qkv" or node.module.startswith("qkv.")):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if m in known}


def layer(module: str) -> str | None:
    """The layer of ``module``: its subpackage, or the top-level module's own name; None for qkv itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_every_module_is_in_a_layer():
    assert [m for m in graph() if layer(m) is not None and layer(m) not in RANK] == []


def test_imports_run_downward_only():
    wrong = [
        f"{module} ({layer(module)}) imports {target} ({layer(target)})"
        for module, targets in graph().items() if layer(module) is not None
        for target in targets if layer(target) is not None and RANK[layer(target)] > RANK[layer(module)]
    ]
    assert wrong == []


def test_there_is_no_import_cycle():
    edges = {m: {t for t in ts if layer(t) is not None} for m, ts in graph().items() if layer(m) is not None}
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path + [node, target]
            if target not in state and (cycle := visit(target, path + [node])):
                return cycle
        state[node] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, " -> ".join(cycle[cycle.index(cycle[-1]):])


def test_the_checker_sees_a_wrong_import_and_a_cycle(tmp_path):
    """The tests above could pass by seeing nothing: here they must see a made-up upward import."""
    known = {"qkv.model.config", "qkv.cli.main", "qkv.io.checkpoint"}
    bad = tmp_path / "config.py"
    bad.write_text("from qkv.cli.main import main\nimport qkv.io.checkpoint\n")
    assert imports(bad, known) == {"qkv.cli.main", "qkv.io.checkpoint"}
    assert RANK[layer("qkv.cli.main")] > RANK[layer("qkv.model.config")]


def test_no_module_calls_another_modules_private_functions():
    found = modules()
    wrong = []
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qkv") and node.module != name:
                wrong += [f"{name} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert wrong == []


def test_the_public_api_is_importable_from_qkv():
    assert qkv.Transformer and qkv.ModelConfig and qkv.Translator and qkv.QkvError
    assert issubclass(qkv.QkvError, ValueError)
