"""The README and the manual in docs/ say what the code defines: every command they show names a module that
exists and flags that command takes, and the README's presets table is the one generated from the presets."""
import re
import shlex

import pytest

from tests.helpers import REPO, help_in_process
from tools import flags_doc
from training.presets import PRESETS

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TRAINER = "rvq_seamless_gpu_cache_nccl.py"


def shown_commands(text: str) -> list[str]:
    """Command lines of the page: each line of a ```bash block (continuations joined, comments dropped), and
    each inline code span that starts a command."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    lines += [span for span in re.findall(r"`([^`\n]+)`", text)
              if re.match(r"(python|torchrun|bash run_nccl_optimized\.sh|\w+=\S* .*(python|bash))", span)]
    return lines


def invocations(line: str) -> list[tuple[str, list[str]]]:
    """(command, its arguments) for each of this repo's commands in a shell line: `tools.X` (with its
    subcommand, e.g. `tools.encode decode`), the trainer, or the launcher (whose flags after the preset are the
    trainer's)."""
    found = []
    for part in re.split(r"&&|;|\||&", line):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("tools."):
                module, rest = words[i + 1], words[i + 2:]
                if module == "tools.encode" and rest[:1] == ["decode"]:
                    module, rest = "tools.encode decode", rest[1:]
                found.append((module, rest))
                break
            if word.endswith(TRAINER):
                found.append(("trainer", words[i + 1:]))
                break
            if word.endswith("run_nccl_optimized.sh") and i + 1 < len(words):
                found.append(("launcher", words[i + 1:]))
                break
    return found


def help_text(command: str) -> str:
    args = {"trainer": [TRAINER]}.get(command) or ["-m", *command.split()]
    r = help_in_process(*map(str, args))
    assert r.returncode == 0, f"{command} --help failed: {r.stderr[-2000:]}"
    return r.stdout


def test_the_pages_show_commands():
    commands = [c for page in PAGES for line in shown_commands(page.read_text()) for c in invocations(line)]
    modules = {module for module, _ in commands}
    assert {"trainer", "launcher", "tools.extract", "tools.tokenize", "tools.encode", "tools.encode decode",
            "tools.export", "tools.report", "tools.check"} <= modules


@pytest.mark.timeout(600)
def test_every_command_shown_names_a_module_and_flags_that_exist():
    wrong = []
    for page in PAGES:
        for line in shown_commands(page.read_text()):
            for command, args in invocations(line):
                if command == "launcher":
                    preset, args = args[0], args[1:]
                    if preset not in (*PRESETS, "doctor", "--help", "PRESET"):
                        wrong.append(f"{page.name}: {line!r}: no preset {preset!r}")
                    if preset == "doctor":
                        continue
                    command = "trainer"
                module = command.split()[0]
                if module != "trainer" and not (REPO / (module.replace(".", "/") + ".py")).is_file():
                    wrong.append(f"{page.name}: {line!r}: no module {module}")
                    continue
                known = set(re.findall(r"--[\w-]+", help_text(command)))
                for flag in (a.split("=")[0] for a in args if a.startswith("--")):
                    if flag not in known:
                        wrong.append(f"{page.name}: {line!r}: {command} has no {flag}")
    assert not wrong, "\n".join(wrong)


def test_the_readmes_presets_table_is_the_generated_one():
    table = "\n".join(flags_doc.presets_table())
    assert table in (REPO / "README.md").read_text(), (
        "the README's presets table differs from training/presets.py: paste `python -m tools.flags_doc --presets`")


def shown_defaults() -> dict[str, set[str]]:
    """Each option of the trainer and of every tool -> the defaults their --help shows for it."""
    from tests.test_help import commands, option_entries

    defaults: dict[str, set[str]] = {}
    for command in commands():
        name = "trainer" if command[0].endswith(".py") else " ".join(command[1:])
        for invocation, text in option_entries(help_text(name)).items():
            shown = re.search(r"\(default: ([^)]*)\)", text)
            for flag in re.findall(r"--[\w-]+", invocation.split("  ")[0]):
                defaults.setdefault(flag, set()).add(shown.group(1) if shown else "")
    return defaults


def normal(value: str) -> str:
    """A default as text to compare: no backticks or thousands commas, and a number as its value (30 = 30.0)."""
    value = value.strip().strip("`").replace(",", "").lower()
    try:
        return repr(float(value))
    except ValueError:
        return value


@pytest.mark.timeout(600)
def test_a_default_the_pages_state_is_the_one_the_code_has():
    """Where the prose says "`--flag` (default V", V is what --help shows for that flag (for some command that
    takes it): a default changed in the code and not in the manual fails here."""
    defaults = shown_defaults()
    wrong, seen = [], 0
    for page in PAGES:
        if page.name == "flags.md":  # generated
            continue
        for flag, value in re.findall(r"`(--[\w-]+)`\s+\(default:?\s+`?([\w.,/-]+)", page.read_text()):
            seen += 1
            if flag not in defaults:
                wrong.append(f"{page.name}: {flag} is no flag of the trainer or of a tool")
            elif not any(normal(d.split()[0] if d.split() else d) == normal(value) for d in defaults[flag]):
                wrong.append(f"{page.name}: {flag} (default {value}), but --help says {sorted(defaults[flag])}")
    assert seen >= 5 and not wrong, "\n".join(wrong)


def split_reads(text: str) -> dict[str, set[str]]:
    """Feature folder -> the splits the page's commands read from it: the trainer's --train_split and
    --valid_split, tools.encode's and tools.evaluate's --split (and --baseline_split), each at its default when
    not given."""
    from tools import encode, evaluate
    from training.config import build_parser

    parsers = {"trainer": build_parser(), "tools.encode": encode.build_parser(False),
               "tools.evaluate": evaluate.build_parser()}
    flags = {"trainer": ("--train_split", "--valid_split"), "tools.encode": ("--split",),
             "tools.evaluate": ("--split", "--baseline_split")}
    reads: dict[str, set[str]] = {}
    for line in shown_commands(text):
        for command, args in invocations(line):
            if command not in parsers or "--data_dir" not in args:
                continue
            folder = args[args.index("--data_dir") + 1]
            for flag in flags[command]:
                given = args[args.index(flag) + 1] if flag in args else None
                reads.setdefault(folder, set()).add(given or parsers[command].get_default(flag.lstrip("-")))
    return reads


def test_an_example_that_extracts_features_and_trains_extracts_every_split_its_page_reads_from_them():
    """A block that extracts features into a folder and trains on them extracts each split the page's commands
    read there (the trainer's held-out split, tools.evaluate's): a reader who follows the example has what the
    next step reads."""
    wrong = []
    for page in PAGES:
        text = page.read_text()
        wrong += unextracted_splits(text, split_reads(text), page.name)
    assert not wrong, "\n".join(wrong)


def unextracted_splits(text: str, reads: dict[str, set[str]], name: str) -> list[str]:
    wrong = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        extracted: dict[str, set[str]] = {}
        trained = set()
        for line in shown_commands(f"```bash\n{block}```"):
            for command, args in invocations(line):
                if command == "tools.extract":
                    source, split, nshard, rank, folder = [a for a in args if not a.startswith("-")][:5]
                    extracted.setdefault(folder, set()).add(split)
                if command == "trainer" and "--data_dir" in args:
                    trained.add(args[args.index("--data_dir") + 1])
        for folder, splits in extracted.items():
            if folder in trained and reads.get(folder, set()) - splits:
                wrong.append(f"{name}: a block extracts {sorted(splits)} into {folder}; the page reads "
                             f"{sorted(reads[folder] - splits)} there too:\n{block}")
    return wrong


def test_the_readme_says_where_the_phone_alignments_it_passes_come_from():
    """The README passes `--alignments valid.phn`: the paragraph says what makes such a file (a forced aligner),
    and the manual's section names the command that makes one."""
    readme = (REPO / "README.md").read_text()
    paragraph = next(p for p in readme.split("\n\n") if "--alignments" in p)
    assert "forced aligner" in paragraph and "docs/evaluating-codes.md" in paragraph, paragraph
    manual = (REPO / "docs" / "evaluating-codes.md").read_text()
    section = manual.split("## Phone alignments", 1)[1].split("\n## ", 1)[0]
    assert "forced aligner" in section and "mfa align" in section
