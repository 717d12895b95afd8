"""--help tells the truth: every command answers it with exit 0, every option shows its help and its default
once (or "(required)"), the launcher's and the doctor's help come from the definitions they describe, and
docs/flags.md is what the code generates."""
import argparse
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO, TRAINER, env, help_output, trainer_in_process
from tests.test_launcher import launch_env
from tools import flags_doc
from tools.launch import EXAMPLES
from tools.launch_rules import LAUNCH_VARIABLES
from training.flag_help import FlagHelpFormatter
from training.presets import PRESETS

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)


def commands() -> list[list[str]]:
    """The trainer; `python -m tools.NAME` for each module of tools/ that runs as a command, and NAME WORD for
    each subcommand its docstring shows (`python -m tools.encode decode ...`)."""
    commands = [[TRAINER.name]]
    for path in sorted((REPO / "tools").glob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__":' not in text:
            continue
        module = f"tools.{path.stem}"
        commands.append(["-m", module])
        words = re.findall(rf"^\s*python -m {re.escape(module)} ([a-z][a-z_]*)(?:\s|$)", text, re.M)
        commands += [["-m", module, word] for word in dict.fromkeys(words)]
    return commands


def required_options(help_text: str) -> set[str]:
    """The options the usage line shows outside brackets: argparse's required ones."""
    usage = help_text.split("\n\n", 1)[0]
    while True:
        bare = re.sub(r"\[[^\[\]]*\]", "", usage)
        if bare == usage:
            break
        usage = bare
    return set(re.findall(r"(?<!\S)(--?[A-Za-z][\w-]*)", usage.split(None, 2)[-1]))


def option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in argparse's help: its invocation and its help text, joined onto one line."""
    entries, current = {}, None
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            current = line.strip()
            entries[current] = current
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {invocation: text for invocation, text in entries.items()
            if not re.match(r"-h\b|--help\b", invocation)}


def default_problems(help_text: str) -> list[str]:
    """Options whose entry does not say its default exactly once (or, when required, "(required)" instead)."""
    required = required_options(help_text)
    problems = []
    for invocation, text in option_entries(help_text).items():
        names = set(re.findall(r"--?[A-Za-z][\w-]*", invocation.split("  ")[0]))
        defaults = len(re.findall(r"\bdefault:", text, re.I))
        if names & required:
            if "(required)" not in text or defaults:
                problems.append(f"{invocation!r} is required: its help must say (required) and no default: {text}")
        elif defaults != 1:
            problems.append(f"{invocation!r} says its default {defaults} times: {text}")
    return problems


def test_the_check_catches_a_missing_a_doubled_and_a_required_default():
    bad = argparse.ArgumentParser(prog="x", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bad.add_argument("--num_quantizers", type=int, help="keep the first q levels (default: all)")
    bad.add_argument("--split", default="train")
    bad.add_argument("--checkpoint", required=True, help="a checkpoint")
    problems = default_problems(bad.format_help())
    assert len(problems) == 3, problems
    assert "(default: all) (default: None)" in problems[0]  # as tools.encode --help printed it
    good = argparse.ArgumentParser(prog="x", formatter_class=FlagHelpFormatter)
    good.add_argument("--num_quantizers", type=int, help="keep the first q levels (default: all)")
    good.add_argument("--split", default="train", help="the split")
    good.add_argument("--checkpoint", required=True, help="a checkpoint")
    good.add_argument("--lengths", default=[64, 128], help="segment lengths")
    good.add_argument("--layer", type=int, help="a layer; none: the last")
    text = good.format_help()
    assert default_problems(text) == [], text
    assert "(default: 64,128)" in text and "(default: none)" in text and "(required)" in text


def test_the_check_reads_every_trainer_flag():
    from training.config import build_parser

    parser = build_parser()
    flags = {o for a in parser._actions if a.help != argparse.SUPPRESS and a.dest != "help" for o in a.option_strings}
    assert {invocation.split()[0] for invocation in option_entries(parser.format_help())} == flags


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_every_command_answers_help_with_each_options_default(command):
    r = help_output(*map(str, command))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:500]
    assert default_problems(r.stdout) == []


def test_docs_flags_page_is_what_the_code_generates():
    page = REPO / "docs" / "flags.md"
    assert page.read_text() == flags_doc.render(), f"docs/flags.md is out of date: run {flags_doc.COMMAND}"


def test_launcher_help_lists_presets_environment_and_examples_and_exits_0():
    results = [subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, env=launch_env())
               for command in (["bash", str(REPO / "run_nccl_optimized.sh"), "--help"],
                               [sys.executable, "-m", "tools.launch", "-h"])]
    for r in results:
        assert r.returncode == 0, r.stderr
    text = results[0].stdout
    assert results[1].stdout == text
    flat = " ".join(text.split())
    for name, preset in PRESETS.items():
        assert f"\n  {name} " in text and " ".join(preset.about.split()) in flat
        assert " ".join(preset.flags) in flat
        assert all(f"{k}={v}" in flat for k, v in preset.workarounds.items())
    for name, variable in LAUNCH_VARIABLES.items():
        assert f"\n  {name} " in text and f"{variable.what} (default: {variable.default})" in flat
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE=" in text
    for _, example in EXAMPLES:
        assert f"\n  {example}\n" in text


@pytest.mark.parametrize("example", [example for _, example in EXAMPLES])
def test_each_launcher_help_example_is_a_launch_that_works(example, tmp_path):
    """Run as DRY_RUN=1: the environment and the command print, exit 0, nothing starts."""
    words = shlex.split(example)
    at = words.index("bash")
    assignments = dict(word.split("=", 1) for word in words[:at])
    assignments.setdefault("OUTPUT_DIR", str(tmp_path / "run"))
    assignments["DRY_RUN"] = "1"
    script = REPO / words[at + 1]
    r = subprocess.run(["bash", str(script), *words[at + 2:]], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=launch_env(**assignments))
    assert r.returncode == 0, r.stderr
    assert "rvq_seamless_gpu_cache_nccl.py" in r.stdout.split("# command\n", 1)[1]


def test_doctor_help_explains_its_option_and_what_it_reads():
    r = subprocess.run(["bash", str(REPO / "run_nccl_optimized.sh"), "doctor", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=REPO, env=launch_env())
    assert r.returncode == 0, r.stderr
    flat = " ".join(r.stdout.split())
    assert "usage: python -m tools.doctor [-h] [--env]" in flat
    assert "--env print only the warnings about your NCCL_*/TORCH_* variables" in flat
    for name in ("NPROC_PER_NODE", "MASTER_ADDR", "RDZV_ENDPOINT", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert name in flat
    assert "exit codes: 0 nothing found that would stop a launch" in flat
    r = subprocess.run([sys.executable, "-m", "tools.doctor", "--envv"], capture_output=True, text=True, timeout=60,
                       cwd=REPO, env=launch_env())
    assert r.returncode == 2 and "unrecognized arguments: --envv" in r.stderr


def test_help_lists_every_flag():
    from training.config import build_parser

    r = trainer_in_process(["--help"])  # `python rvq_seamless_gpu_cache_nccl.py --help` itself: tests/test_help.py
    assert r.returncode == 0, r.stderr[-2000:]
    flags = [o for a in build_parser()._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
    assert len(flags) > 50 and all(f in r.stdout for f in flags), [f for f in flags if f not in r.stdout]
    assert "2% of training utterances are held out" in " ".join(r.stdout.split())  # a % shows as it is


def test_a_flag_is_taken_by_its_full_name_only(capsys):
    """The launcher reads the trainer's flags by their full names (tools/launch.py): an abbreviation it could not
    see (--output_d) would put the run in one folder and its flight recorder's dumps in another."""
    from training.config import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--output_d", "elsewhere"])
    assert e.value.code == 2 and "unrecognized arguments: --output_d" in capsys.readouterr().err
    assert build_parser().parse_args(["--output_dir", "x"]).output_dir == "x"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tool", ["check", "doctor", "encode", "evaluate", "export", "extract", "report", "tokenize"])
def test_a_tool_run_as_a_file_from_another_folder_says_how_to_run_it(tool, tmp_path):
    """`python /checkout/tools/encode.py` from another folder, no PYTHONPATH: exit 2 with the command that works,
    not a traceback (tools/tokenize.py would shadow the standard library's tokenize)."""
    environ = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(REPO / "tools" / f"{tool}.py"), "--help"], capture_output=True, text=True,
                       timeout=50, cwd=tmp_path, env=environ)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"run it there as python -m tools.{tool}" in r.stderr and f"PYTHONPATH={REPO}" in r.stderr
    assert "Traceback" not in r.stderr
