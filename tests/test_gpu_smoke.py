"""The GPU smoke command's CPU-runnable steps pass on a CPU, and every CUDA step says SKIP with a reason."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.gpu_smoke import STEPS

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_cpu_only_smoke_passes_its_cpu_steps_and_names_each_skip(tmp_path):
    out = tmp_path / "smoke.json"
    job = subprocess.run(["bash", "benchmarks/gpu_smoke.sh", "--cpu-only", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=230)
    lines = {m.group(2): (m.group(1), m.group(3)) for m in
             re.finditer(r"^(PASS|FAIL|SKIP) ([\w -]+): (.*)$", job.stdout, re.MULTILINE)}
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    for name, _, cpu_ok in STEPS:
        status, figure = lines[name]
        assert status == ("PASS" if cpu_ok else "SKIP"), (name, figure)
        assert figure.strip()  # a figure, or the reason for the skip
    saved = json.loads(out.read_text())["steps"]
    assert {name: s["status"] for name, s in saved.items()} == {n: lines[n][0] for n in lines}
