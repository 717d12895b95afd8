"""A checkpoint written by an earlier trainer resumes, and the run goes on as that trainer's own would have.

tests/data/checkpoint_c2e2232/ was written by the trainer of commit c2e2232 on the `small_data` dump (conftest.py),
with TINY and `--max_steps 8 --save_every 4 --eval_every 100 --refit_iters 0`: its checkpoint at step 4, and the
model weights of its step 8 (that run unbroken, the refit and the final eval done). Its learning rate was that
trainer's default, 2e-3 decaying to 10%, since changed: a resumed run keeps its checkpoint's schedule unless a flag
says otherwise."""
import math

import torch

from tests.helpers import REPO, TINY, events, newest_checkpoint, trainer_in_process

EARLIER = REPO / "tests" / "data" / "checkpoint_c2e2232"
RESUME_TO_8 = ["--max_steps", "8", "--save_every", "4", "--eval_every", "100", "--refit_iters", "0",
               "--resume", EARLIER / "step_00000004.pt"]


def test_a_checkpoint_of_an_earlier_trainer_resumes_to_the_weights_of_its_unbroken_run(tmp_path, small_data):
    config = torch.load(EARLIER / "step_00000004.pt", weights_only=False, map_location="cpu")["config"]
    assert (config["lr"], config["min_lr_ratio"]) == (2e-3, 0.1)  # not today's defaults (training/config.py)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", small_data, "--output_dir", out, *TINY, *RESUME_TO_8])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "at step 4" in r.stderr
    assert "resumed run: --lr 0.002, the checkpoint's run's (this version's default: 0.003)" in r.stderr
    assert "resumed run: --min_lr_ratio 0.1, the checkpoint's run's" in r.stderr
    assert events(out, "stop")[-1]["step"] == 8 and events(out, "stop")[-1]["reason"] == "max_steps"
    state = newest_checkpoint(out)
    assert state["step"] == 8 and state["end_of_schedule"] == ["refit", "final eval"]
    unbroken = torch.load(EARLIER / "model_step_00000008.pt", weights_only=True)
    assert unbroken.keys() == state["model"].keys()
    for key, value in unbroken.items():  # bit for bit on the machine that wrote them; kernels elsewhere may differ in
        torch.testing.assert_close(state["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)  # the last bits
    assert (state["config"]["lr"], state["config"]["min_lr_ratio"]) == (2e-3, 0.1)  # and a later resume keeps them


def test_a_flag_given_on_resume_wins_over_the_checkpoints_schedule(tmp_path, small_data):
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", small_data, "--output_dir", out, *TINY, *RESUME_TO_8,
                            "--lr", "3e-3", "--weight_decay", "0.5"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed run: --lr 0.003 as given (the checkpoint's run trained with 0.002)" in r.stderr
    assert "resumed run: --weight_decay 0.5 as given (the checkpoint's run trained with 0)" in r.stderr
    state = newest_checkpoint(out)
    assert state["step"] == 8
    assert (state["config"]["lr"], state["config"]["min_lr_ratio"], state["config"]["weight_decay"]) == (3e-3, 0.1, 0.5)
    assert {group["weight_decay"] for group in state["optimizer"]["param_groups"]} == {0.5}  # not the state dict's
    last = events(out, "train")[-1]  # step 8's update, at step 7 of the cosine from step 2 (TINY's warmup) to 8
    assert last["step"] == 8 and math.isclose(last["lr"], 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 6))))


def test_an_earlier_checkpoint_counts_its_time_budget_spent_only_if_the_clock_ended_its_schedule():
    from training.checkpoint import time_spent

    state = torch.load(EARLIER / "step_00000004.pt", weights_only=True)
    assert "time_spent" not in state and time_spent(state) == 0.0  # --max_steps: no time budget
    timed = {**state, "config": {**state["config"], "max_steps": None, "max_minutes": 2.0}}
    assert time_spent({**timed, "schedule_fraction": 0.4}) == 0.0  # stopped mid-budget: not known, a whole budget
    assert time_spent({**timed, "schedule_fraction": 1.0}) == 120.0  # the decay done: a relaunch trains no more
