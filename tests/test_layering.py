"""The layering docs/development.md states, read from every product module's imports (at any depth in the module,
functions and type checks included):

    tools, the trainer          the commands and the training script
    rvq_tokenizer               the Python API (the package's own module and its tokenizer.py): importing it imports
                                nothing of the layers below until load() is called
    rvq_tokenizer.*             the library under both: a trained codec over audio
    training                    what a run is made of
    data.audio | models         the audio path (audio -> features) | the codec
    data                        the trainer's input, shards and their files
    errors

Each imports only layers below it (data and models never each other; the trainer uses neither rvq_tokenizer nor
tools), and nothing imports a layer above its own: so no command stands on another, and the API stands on no
command."""
import ast
from pathlib import Path

from tests.helpers import REPO

BELOW = {"errors": set(), "data": {"errors"}, "data.audio": {"data", "errors"}, "models": {"errors"}}
BELOW["training"] = {"data.audio", "models", *BELOW["data.audio"]}
BELOW["library"] = {"training", *BELOW["training"]}
BELOW["api"] = {"library", *BELOW["library"]}
BELOW["tools"] = {"library", *BELOW["library"]}
BELOW["trainer"] = {"training", *BELOW["training"]} - {"data.audio"}
LAYERS = {layer: {layer, *below} for layer, below in BELOW.items()}
TRAINER = "rvq_seamless_gpu_cache_nccl"
API = ("rvq_tokenizer", "rvq_tokenizer.tokenizer")  # the package's own module and the class it hands out
PROJECT = {"errors", "data", "models", "training", "rvq_tokenizer", "tools", TRAINER}


def product_modules() -> dict[str, Path]:
    """Every module of the product by its dotted name (a package's __init__ by the package's)."""
    found = {name: REPO / f"{name}.py" for name in ("errors", TRAINER)}
    for package in ("data", "models", "training", "rvq_tokenizer", "tools"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def project_imports(path: Path) -> list[tuple[str, int]]:
    """(the project module a statement imports, its line) for every import statement of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "data" else [f"data.{a.name}" for a in node.names]
        else:
            continue
        out += [(name, node.lineno) for name in names if name.split(".")[0] in PROJECT]
    return out


def layer(module: str) -> str:
    if module == TRAINER:
        return "trainer"
    if module in API:
        return "api"
    if module.startswith("rvq_tokenizer."):
        return "library"
    if module == "data.audio" or module.startswith("data.audio."):
        return "data.audio"
    return module.split(".")[0]


def violations(modules: dict[str, Path]) -> list[str]:
    def shown(path: Path) -> str:
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

    return [f"{shown(path)}:{line} imports {name}" for module, path in modules.items()
            for name, line in project_imports(path) if layer(name) not in LAYERS[layer(module)]]


def test_every_product_module_imports_down_only():
    modules = product_modules()
    assert len(modules) > 80 and all(path.is_file() for path in modules.values())
    assert {layer(m) for m in modules} == set(LAYERS)
    assert violations(modules) == []


def test_the_check_sees_an_import_that_runs_back_up(tmp_path):
    """The check can fail: an import inside a function of a data module that reaches models, a models module that
    reaches training, a trainer's-input module that reaches the audio path, the library that reaches a command,
    and a command that stands on the Python API, are all found."""
    cases = {"data.bad": "import numpy\n\ndef f():\n    from models.codes import code_frames\n    return code_frames\n",
             "models.worse": "from training import checkpoint\nimport errors\n",
             "data.stores_like": "from data.audio.features import FRAME_RATE\n",
             "data.also": "from data import audio\n",
             "rvq_tokenizer.up": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tools.cli import run\n",
             "tools.on_api": "import rvq_tokenizer\n",
             "rvq_seamless_gpu_cache_nccl": "from rvq_tokenizer.codec_files import load_codec\n"}
    modules = {}
    for i, (module, text) in enumerate(cases.items()):
        modules[module] = tmp_path / f"m{i}.py"
        modules[module].write_text(text)
    found = violations(modules)
    assert [v.split(" imports ")[1] for v in found] == [
        "models.codes", "training", "data.audio.features", "data.audio", "tools.cli", "rvq_tokenizer",
        "rvq_tokenizer.codec_files"]
    assert found[0].startswith(f"{modules['data.bad']}:4")


def test_the_api_imports_nothing_of_its_library_nor_the_codec_s_libraries_when_imported():
    """`import rvq_tokenizer` leaves the caller's process as it was: no variable set (numpy's BLAS threads, torch's
    inductor cache, which importing the quantizer library sets), no module of the project or of the codec imported
    until load() asks for them."""
    import os
    import subprocess
    import sys

    script = ("import os, sys, json\nbefore = dict(os.environ)\nimport rvq_tokenizer\n"
              "print(json.dumps({'changed': sorted(k for k in set(before) | set(os.environ) "
              "if before.get(k) != os.environ.get(k)), 'modules': sorted(m for m in sys.modules if m.split('.')[0] in "
              "('data', 'models', 'training', 'tools', 'errors', 'vector_quantize_pytorch', 'einx'))}))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    import json

    assert json.loads(out) == {"changed": [], "modules": []}


# names given to other files than a shard's streams, which share a suffix with one: an utterance folder's arrays
# (data/stores.py) and an audio manifest's names (data/audio/sources.py)
OTHER_FORMATS = {"UTTERANCE_SUFFIXES", "MANIFEST_SUFFIXES"}


def shard_suffix_literals(path: Path) -> list[str]:
    """The string literals of a module (docstrings aside; f-strings' literal parts included) that spell a shard's
    file name: one of data/resumable_shard.py's layout suffixes alone, or ending a shard's name or pattern
    (`_0_1.len`, `_*_*.json`, `_(\\d+)\\.npy$`), in source order. Other files' names (`config.json`) and prose pass."""
    from data.shard_layout import CODES, FEATURE_DUMP, PARTIAL

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
    """data/shard_layout.py's ShardLayout names every stream of a shard; every other module takes the names
    from it (FEATURE_DUMP.lengths, CODES.km ...)."""
    modules = {name: path for name, path in product_modules().items() if name != "data.shard_layout"}
    assert [hit for path in modules.values() for hit in shard_suffix_literals(path)] == []


def test_the_suffix_check_sees_a_name_spelled_by_hand(tmp_path):
    module = tmp_path / "hand.py"
    module.write_text('"""Writes NAME.codes.len."""\nPATH = "x" + ".codes.len"\nPATTERN = r"_(\\d+)\\.npy$"\n'
                      'MESSAGE = "see the .len file"\nUTTERANCE_SUFFIXES = (".npy", ".pt")\n')
    assert [hit.split(" ", 1)[1] for hit in shard_suffix_literals(module)] == ["'.codes.len'", "'_(\\\\d+)\\\\.npy$'"]
