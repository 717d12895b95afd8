"""What the README's main job must leave: config, metrics with evals, a checkpoint, and a codec that learned."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.metrics_log import run_events  # noqa: E402
from training.run_folder import RunFolder  # noqa: E402

run = RunFolder(sys.argv[1])
evals = run_events(run.root, "eval")
problems = []
if not run.config.is_file():
    problems.append("no config.json")
if not list(run.checkpoints.glob("step_*.pt")):
    problems.append("no checkpoint")
if len(evals) < 2:
    problems.append(f"{len(evals)} eval events, expected at least 2")
else:
    first, last = evals[0], evals[-1]
    print(f"rel_mse {first['rel_mse']:.4f} at step {first['step']} -> {last['rel_mse']:.4f} at step {last['step']}; "
          f"code usage per level {last['code_usage']}")
    if last["rel_mse"] > 0.5 * first["rel_mse"]:
        problems.append("eval rel_mse did not fall by half from the first eval to the last")
    if min(last["code_usage"]) < 0.5:
        problems.append("a level uses less than half of its codes")
if problems:
    sys.exit("demo run check failed: " + "; ".join(problems))
print("demo run check passed")
