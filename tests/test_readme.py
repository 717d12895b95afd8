"""The README's two set-up commands are the ones CI runs."""
import re

from tests.helpers import REPO


def readme_commands():
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quick start\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_two_commands_and_ci_runs_them_verbatim():
    commands = readme_commands()
    assert len(commands) == 2
    assert "run_nccl_optimized.sh conservative" in commands[0] and "pytest" in commands[1]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci


def test_the_suite_s_process_count_is_said_where_it_is_set():
    """pytest.ini sets the suite's pytest processes; requirements-dev.txt and the README say the same number."""
    processes = re.search(r"addopts = .*-n (\d+)", (REPO / "pytest.ini").read_text()).group(1)
    dev = (REPO / "requirements-dev.txt").read_text()
    assert re.search(r"pytest-xdist.*# pytest\.ini runs the suite on (\d+) processes", dev).group(1) == processes
    assert f"({processes} pytest processes;" in (REPO / "README.md").read_text()


def test_a_shorter_run_of_the_preset_is_shown_with_its_own_output_dir():
    """The README's 3-minute run names the folder it goes to: the preset's own holds the finished run, which a run
    of another budget would find finished (or refuse)."""
    text = (REPO / "README.md").read_text()
    shown = re.search(r"`(OUTPUT_DIR=\S+ bash run_nccl_optimized\.sh conservative --max_minutes 3)`", text)
    assert shown and "runs/conservative" not in shown.group(1)
