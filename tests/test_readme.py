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
