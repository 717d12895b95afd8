"""The layering docs/development.md states, read from every product module's imports (at any depth in the module,
functions included): tools, rvq_tokenizer.py and the trainer use training, which uses data and models, which use
errors.py; data and models never import each other, and nothing imports a layer above its own."""
import ast
from pathlib import Path

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


# names given to other files than a shard's streams, which share a suffix with one: an utterance folder's arrays
# (data/stores.py) and an audio manifest's names (data/audio_sources.py)
OTHER_FORMATS = {"UTTERANCE_SUFFIXES", "MANIFEST_SUFFIXES"}


def shard_suffix_literals(path: Path) -> list[str]:
    """The string literals of a module (docstrings aside; f-strings' literal parts included) that spell a shard's
    file name: one of data/resumable_shard.py's layout suffixes alone, or ending a shard's name or pattern
    (`_0_1.len`, `_*_*.json`, `_(\\d+)\\.npy$`), in source order. Other files' names (`config.json`) and prose pass."""
    from data.resumable_shard import CODES, FEATURE_DUMP, PARTIAL

    suffixes = {PARTIAL} | {getattr(layout, field) for layout in (FEATURE_DUMP, CODES)
                            for field in ("array", "meta", "lengths", "keys", "skipped", "km", "parquet", "frames",
                                          "folder_lock", "progress") if getattr(layout, field)}
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            skipped.add(id(node.body[0].value))  # a docstring: prose about the files
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in OTHER_FORMATS
                                                for t in node.targets):
            skipped.update(id(n) for n in ast.walk(node.value))
    found = []
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Constant)), key=lambda n: n.lineno):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            text = node.value.rstrip("$").replace("\\.", ".")
            named = text.startswith((".", "_")) or "_0_1" in text or "_*_*" in text  # a suffix, or a shard's name
            if named and " " not in text and any(text.endswith(suffix) for suffix in suffixes):
                found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno} "
                             f"{node.value!r}")
    return found


def test_no_module_but_the_shards_spells_a_shard_file_suffix():
    """data/resumable_shard.py's ShardLayout names every stream of a shard; every other module takes the names
    from it (FEATURE_DUMP.lengths, CODES.km ...)."""
    modules = {name: path for name, path in product_modules().items() if name != "data.resumable_shard"}
    assert [hit for path in modules.values() for hit in shard_suffix_literals(path)] == []


def test_the_suffix_check_sees_a_name_spelled_by_hand(tmp_path):
    module = tmp_path / "hand.py"
    module.write_text('"""Writes NAME.codes.len."""\nPATH = "x" + ".codes.len"\nPATTERN = r"_(\\d+)\\.npy$"\n'
                      'MESSAGE = "see the .len file"\nUTTERANCE_SUFFIXES = (".npy", ".pt")\n')
    assert [hit.split(" ", 1)[1] for hit in shard_suffix_literals(module)] == ["'.codes.len'", "'_(\\\\d+)\\\\.npy$'"]
