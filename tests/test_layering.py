"""The layering docs/development.md states, read from every product module's imports (at any depth in the module,
functions included): tools, rvq_tokenizer.py and the trainer use training, which uses data and models, which use
errors.py; data and models never import each other, and nothing imports a layer above its own."""
import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

LAYERS = {"errors": set(), "data": {"data", "errors"}, "models": {"models", "errors"},
          "training": {"training", "data", "models", "errors"},
          "tools": {"tools", "training", "data", "models", "errors"}}
# top-level scripts and modules: the entry points, at the tools' level
ENTRY_POINTS = ("rvq_seamless_gpu_cache_nccl", "rvq_tokenizer")
PROJECT = set(LAYERS) | set(ENTRY_POINTS)


def product_modules() -> dict[str, Path]:
    found = {name: REPO / f"{name}.py" for name in ("errors", *ENTRY_POINTS)}
    for package in ("data", "models", "training", "tools"):
        found.update({f"{package}.{p.stem}": p for p in sorted((REPO / package).glob("*.py"))})
    return found


def project_imports(path: Path) -> list[tuple[str, int]]:
    """(the project module a statement imports, its line) for every import statement of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out += [(name, node.lineno) for name in names if name.split(".")[0] in PROJECT]
    return out


def layer(module: str) -> str:
    top = module.split(".")[0]
    return "tools" if top in ENTRY_POINTS else top


def violations(modules: dict[str, Path]) -> list[str]:
    def shown(path: Path) -> str:
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

    return [f"{shown(path)}:{line} imports {name}" for module, path in modules.items()
            for name, line in project_imports(path) if layer(name) not in LAYERS[layer(module)]]


def test_every_product_module_imports_down_only():
    modules = product_modules()
    assert len(modules) > 60 and all(path.is_file() for path in modules.values())
    assert violations(modules) == []


def test_the_check_sees_an_import_that_runs_back_up(tmp_path):
    """The check can fail: an import inside a function of a data module that reaches models, and a models module
    that reaches training, are both found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy\n\ndef f():\n    from models.codes import code_frames\n    return code_frames\n")
    worse = tmp_path / "worse.py"
    worse.write_text("from training import checkpoint\nimport errors\n")
    found = violations({"data.bad": bad, "models.worse": worse})
    assert [v.split(" imports ")[1] for v in found] == ["models.codes", "training"]
    assert found[0].startswith(f"{bad}:4")
