"""docs/flags.md from the code: the trainer's flags, the launcher's presets and environment.

    python -m tools.flags_doc > docs/flags.md      # after changing a flag, a preset or a launch variable
    python -m tools.flags_doc --check              # exit 1 when docs/flags.md differs from the code
    python -m tools.flags_doc --presets            # the presets table, as the README shows it

The trainer's flags come from its parser (training/config.py builds it from the config
dataclasses), so the page says what `--help` says; the presets from training/presets.py;
the environment from tools/launch_rules.py; the trainer's NCCL settings from
training/nccl_env.py. tests/test_help.py fails when the committed page is out of date.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.launch_rules import LAUNCH_VARIABLES
from training.flag_help import FlagHelpFormatter, shown_default
from training.nccl_env import trainer_nccl_env
from training.presets import PRESETS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
COMMAND = "python -m tools.flags_doc > docs/flags.md"


def cell(text: str) -> str:
    """Prose in a table cell: no markdown read into it."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def trainer_flags() -> list[str]:
    from training.config import build_parser  # imports torch: not for --help

    parser = build_parser()
    formatter = FlagHelpFormatter(parser.prog)
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and a.dest != "help"]
        if not actions:
            continue
        lines += ["", f"### {group.title}", "", "| flag | default | what it does |", "|---|---|---|"]
        for action in actions:
            invocation = formatter._format_action_invocation(action)
            help_text = (action.help or "").replace("%%", "%")
            default = "required" if action.required else shown_default(action.default)
            lines.append(f"| {code(invocation)} | {code(default)} | {cell(help_text)} |")
    return lines


def presets_table() -> list[str]:
    """The presets as a markdown table: in docs/flags.md, and in the README (tests/test_help.py checks that its
    copy is this, verbatim; `python -m tools.flags_doc --presets` prints it)."""
    lines = ["| preset | what it is | trainer flags | NCCL workarounds it sets |", "|---|---|---|---|"]
    for name, preset in PRESETS.items():
        flags = code(" ".join(preset.flags)) if preset.flags else "none"
        workarounds = " ".join(code(f"{k}={v}") for k, v in preset.workarounds.items()) or "none"
        lines.append(f"| {code(name)} | {cell(preset.about)} | {flags} | {workarounds} |")
    return lines


def render() -> str:
    lines = [
        "# Flags, presets and the launcher's environment",
        "",
        f"Generated from the code by `{COMMAND}`; tests/test_help.py fails when",
        "this page and the code differ, so edit the definitions, not this page.",
        "",
        "## The trainer's flags",
        "",
        "`python rvq_seamless_gpu_cache_nccl.py --help` says the same. Defaults are written as you would type",
        "them: `none` is no value (the text says what is used then); a flag shown `--name [NAME]` takes `true`",
        "or `false`, or nothing for true; a flag shown alone (`--prefetch`) takes no value and turns it on.",
        *trainer_flags(),
        "",
        "## Presets",
        "",
        "`bash run_nccl_optimized.sh PRESET [trainer flags...]`: the preset's flags come first, so yours win.",
        "",
        *presets_table(),
    ]
    lines += [
        "",
        "## The launcher's environment",
        "",
        "Read by `run_nccl_optimized.sh` (`python -m tools.launch`); `python -m tools.doctor` checks them.",
        "",
        "| variable | what it does | default |",
        "|---|---|---|",
    ]
    lines += [f"| {code(name)} | {cell(v.what)} | {cell(v.default)} |" for name, v in LAUNCH_VARIABLES.items()]
    lines += [
        "",
        "## Set by the trainer on its NCCL process groups",
        "",
        "Unless you set them; the flight recorder's dumps land in the run's output dir.",
        "",
        "| variable | value |",
        "|---|---|",
    ]
    lines += [f"| {code(name)} | {code(value)} |" for name, value in trainer_nccl_env("OUTPUT_DIR", {}).items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.flags_doc", formatter_class=FlagHelpFormatter,
                                description=__doc__.split("\n\n")[0] + f"\n\n    {COMMAND}")
    p.add_argument("--check", action="store_true",
                   help=f"compare {PAGE.parent.name}/{PAGE.name} with the code instead of printing it; exit 1 "
                        "when they differ")
    p.add_argument("--presets", action="store_true", help="print only the presets table (the README's copy)")
    args = p.parse_args(argv)
    if args.presets:
        sys.stdout.write("\n".join(presets_table()) + "\n")
        return 0
    page = render()
    if not args.check:
        sys.stdout.write(page)
        return 0
    if PAGE.exists() and PAGE.read_text() == page:
        return 0
    print(f"{PAGE} is out of date: run {COMMAND}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
