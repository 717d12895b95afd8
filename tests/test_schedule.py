"""The training budget and learning-rate schedule (training/schedule.py), and the automatic crop length."""
import logging
import math

import numpy as np
import pytest

from data.training_data import DEFAULT_BATCH, DataConfig
from errors import BadInputError
from training.config import OptimConfig
from training.schedule import DEFAULT_STEPS, Schedule


def schedule(started_at=0.0, steps_per_epoch=40, frames_per_step=2048, **optim):
    return Schedule(OptimConfig(**{"warmup_steps": 10, **optim}), steps_per_epoch=steps_per_epoch,
                    frames_per_step=frames_per_step, world_size=1, codebook_size=1024, started_at=started_at)


def test_the_budget_each_flag_gives():
    assert schedule(max_steps=300).steps == 300 and schedule(max_steps=300).end == "max_steps"
    assert schedule(epochs=3).steps == 120 and schedule(epochs=3).end == "epochs"
    assert schedule(max_minutes=5).steps is None  # the clock decides
    # none given: a small corpus still gets enough steps, a large one trains a whole epoch
    assert schedule().steps == DEFAULT_STEPS
    assert schedule(steps_per_epoch=50_000).steps == 50_000
    both = schedule(max_steps=300, max_minutes=5)
    assert both.steps == 300 and both.deadline == 300.0
    assert "whichever ends first" in both.describe()


def test_a_short_schedule_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        schedule(max_steps=50)
    assert "pass --max_minutes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        schedule(max_steps=3000)
    assert caplog.text == ""


def test_a_time_budget_mostly_spent_on_set_up_is_warned_about_before_the_first_step(caplog):
    with caplog.at_level(logging.WARNING):
        schedule(max_minutes=1).check_setup(now=10.0)  # a sixth of the minute: fine
        schedule(max_steps=3000).check_setup(now=500.0)  # no time budget: nothing to say
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):
        schedule(max_minutes=1).check_setup(now=20.0)
    assert "set-up took 20 s, 33% of --max_minutes 1" in caplog.text and "pass --max_minutes 3 or more" in caplog.text


def test_steps_alone_warm_up_then_decay_to_the_floor():
    s = schedule(max_steps=110, lr=1e-3, min_lr_ratio=0.1)
    assert s.learning_rate(0) == pytest.approx(1e-4)
    assert s.learning_rate(9) == pytest.approx(1e-3)
    assert s.learning_rate(10) == pytest.approx(1e-3)
    assert s.learning_rate(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert s.learning_rate(110) == pytest.approx(1e-4)
    lrs = [s.learning_rate(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert s.stop_reason(109) is None and s.stop_reason(110) == "max_steps"


def test_time_alone_estimates_the_steps_that_fit_and_keeps_time_for_the_end():
    s = schedule(started_at=0.0, max_minutes=10, frames_per_step=1000)
    work = dict(refit_frames=10_000, refit_iters=2, eval_frames=2_000, beam_size=4)
    assert s.estimate(0, now=20.0, **work) is None  # the first call starts the clock (after the slower first step)
    assert s.estimate(1, now=21.0, **work) is None
    total = s.estimate(10, now=30.0, **work)  # 1 s a step, 1 ms a frame
    # the end, beam 4: 1.5 x 1 ms x (0.25 x 3 passes x 4 x 10,000 refit frames + 2.5 x 4 x 2,000 eval frames)
    # + 5 s for the checkpoint = 80 s
    assert s.end_work == pytest.approx(80.0)
    assert total == 10 + int(600 - 80 - 30)
    s.set_steps_in_time(total)
    assert s.total == total and s.stop_reason(total - 1) is None and s.stop_reason(total) == "max_minutes"
    assert s.learning_rate(total) == pytest.approx(s.optim.lr * s.optim.min_lr_ratio)
    assert not s.out_of_time(now=515.0) and s.out_of_time(now=520.0)  # the hard stop keeps the end's time


def test_under_a_time_budget_the_refit_reads_what_fits_in_its_share():
    s = schedule(started_at=0.0, max_minutes=10, frames_per_step=1000)
    # a large corpus's whole --refit_frames
    large = dict(refit_frames=262_144, refit_iters=2, eval_frames=2_000, beam_size=4)
    assert s.refit_frames(262_144, 2, 4) == 262_144  # not measured yet: as asked
    s.estimate(0, now=20.0, **large)
    s.estimate(10, now=30.0, **large)  # 1 ms a frame
    # a tenth of 600 s, over 3 passes x 4 sequences x 0.25 ms: 20,000 frames; a small corpus's shard stays whole
    assert s.refit_frames(262_144, 2, 4) == 20_000 and s.refit_frames(15_000, 2, 4) == 15_000
    assert s.refit_frames(262_144, 2, 1) == 80_000  # one sequence per frame: 4x the frames
    assert s.refit_frames(262_144, 0, 4) == 262_144  # no refit: nothing to bound
    assert s.end_work == pytest.approx(1.5 * 0.001 * 4 * (0.25 * 3 * 20_000 + 2.5 * 2_000) + 5)
    assert schedule(max_steps=100).refit_frames(262_144, 2, 4) == 262_144  # no deadline: as asked


def test_with_steps_and_time_the_smaller_total_decides():
    s = schedule(max_steps=100, max_minutes=10)
    s.set_steps_in_time(1000)
    assert s.total == 100
    s.set_steps_in_time(60)
    assert s.total == 60 and s.stop_reason(60) == "max_minutes"


def test_a_resumed_time_budget_decays_the_rest_of_the_schedule():
    s = Schedule(OptimConfig(warmup_steps=10, max_minutes=10), steps_per_epoch=40, frames_per_step=2048,
                 world_size=1, codebook_size=1024, started_at=0.0, start_step=500, start_fraction=0.6)
    s.set_steps_in_time(900)
    assert s.fraction(500) == pytest.approx(0.6)
    assert s.fraction(700) == pytest.approx(0.6 + 0.4 * 0.5)
    assert s.fraction(900) == pytest.approx(1.0)


def test_a_resumed_time_budget_has_what_is_left_of_it_and_none_once_the_clock_ended_it(caplog):
    def resumed(max_minutes, time_spent):
        return Schedule(OptimConfig(warmup_steps=10, max_minutes=max_minutes), steps_per_epoch=40,
                        frames_per_step=2048, world_size=1, codebook_size=1024, started_at=100.0, start_step=500,
                        start_fraction=1.0, time_spent=time_spent)

    stopped = resumed(10, 240.0)  # a signal after 4 of the 10 minutes: 6 are left, from this process's start
    assert stopped.deadline == 100.0 + 360 and stopped.stop_reason(500) is None
    assert stopped.spent(now=130.0) == pytest.approx(270.0)
    stopped.ran_out = True  # the clock then ends the schedule: all of the budget is spent
    assert stopped.spent(now=130.0) == 600.0
    # ended by the clock: the same --max_minutes has nothing left to train, a larger one the minutes added
    assert resumed(10, 600.0).stop_reason(500) == "max_minutes"
    assert resumed(5, 600.0).stop_reason(500) == "max_minutes" and resumed(5, 600.0).spent(now=101.0) == 601.0
    more = resumed(12, 600.0)
    assert more.stop_reason(500) is None and more.deadline == 100.0 + 120
    assert "spent before this resume" in more.describe()
    with caplog.at_level(logging.WARNING):
        resumed(10, 600.0).check_setup(now=200.0)  # nothing left to warn about: the end's work is all it does
        more.check_setup(now=110.0)  # 10 s of the 120 left
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):
        more.check_setup(now=140.0)
    assert "set-up took 40 s, 33% of --max_minutes 12 (the 120 s of it left to this resumed run)" in caplog.text
    assert "pass --max_minutes 14 or more" in caplog.text
    assert schedule(max_minutes=10).spent(now=30.0) == 30.0  # a fresh run: its own time


def test_a_resumed_step_budget_matches_the_unbroken_schedule_exactly():
    unbroken = schedule(max_steps=300)
    resumed = Schedule(OptimConfig(warmup_steps=10, max_steps=300), steps_per_epoch=40, frames_per_step=2048,
                       world_size=1, codebook_size=1024, started_at=0.0, start_step=150,
                       start_fraction=unbroken.fraction(150))
    assert all(resumed.learning_rate(i) == unbroken.learning_rate(i) for i in range(150, 301))


@pytest.mark.parametrize("lengths, expected", [
    (np.full(1000, 500), 128),  # long utterances: the base length
    (np.r_[np.full(30, 100), np.full(970, 500)], 128),  # 0.6% of the frames in utterances shorter than 128
    (np.r_[np.full(100, 100), np.full(900, 300)], 64),  # 3.6% of the frames shorter than 128: 64 fits them all
    (np.r_[np.full(100, 60), np.full(100, 100), np.full(300, 200)], 32),  # 7.5% under 64, 17.5% under 128
    (np.full(100, 20), 16),  # shorter than every candidate but the last
])
def test_the_automatic_crop_length_leaves_out_few_frames(lengths, expected):
    cfg = DataConfig(batch_size=16).fit_to(lengths, multiple_of=1, device_type="cpu")
    assert cfg.segment_length == expected
    assert cfg.frames_per_step == 16 * 128  # frames per step kept: more crops when they are shorter


def test_a_given_crop_length_is_kept_and_the_downsample_respected():
    lengths = np.full(100, 70)
    assert DataConfig(segment_length=96, batch_size=8).fit_to(lengths, 1, "cpu").segment_length == 96
    fitted = DataConfig(batch_size=8).fit_to(lengths, multiple_of=3, device_type="cpu")
    assert fitted.segment_length == 63 and fitted.segment_length % 3 == 0
    assert math.isclose(fitted.frames_per_step, 8 * 128, rel_tol=0.02)


def test_the_default_batch_depends_on_the_device_and_a_given_one_is_kept():
    lengths = np.full(100, 200)
    assert DataConfig().fit_to(lengths, 1, "cpu").frames_per_step == DEFAULT_BATCH["cpu"] * 128
    assert DataConfig().fit_to(lengths, 1, "cuda").frames_per_step == DEFAULT_BATCH["cuda"] * 128
    assert DEFAULT_BATCH["cpu"] < DEFAULT_BATCH["cuda"]
    given = DataConfig(batch_size=5, segment_length=32).fit_to(lengths, 1, "cuda")
    assert (given.batch_size, given.segment_length) == (5, 32)


def test_a_resumed_run_keeps_its_checkpoints_optimisation_settings_unless_their_flags_are_given():
    from training.config import parse_args, resumed_optim

    saved = {"lr": 2e-3, "min_lr_ratio": 0.1, "warmup_steps": 50, "seed": 7, "max_steps": 100}  # no weight_decay
    typed = parse_args(["--min_lr_ratio", "0.2", "--grad_clip", "0.5", "--max_steps", "300"])
    optim, said = resumed_optim(typed.optim, saved, typed.typed)
    assert (optim.lr, optim.min_lr_ratio, optim.warmup_steps, optim.grad_clip) == (2e-3, 0.2, 50, 0.5)
    assert optim.weight_decay == typed.optim.weight_decay  # a setting the checkpoint predates: this run's
    assert (optim.seed, optim.max_steps) == (typed.optim.seed, 300)  # not kept: the budget is the relaunch's
    assert optim.optimizer == "adamw"  # the optimizer whose state it resumes: runs from before the flag used AdamW
    assert said == ["--lr 0.002, the checkpoint's run's (this version's default: 0.003)",
                    "--min_lr_ratio 0.2 as given (the checkpoint's run trained with 0.1)"]


def test_a_resumed_run_trains_with_its_checkpoints_optimizer_and_refuses_another():
    from training.config import parse_args, resumed_optim

    for saved in ({"optimizer": "muon", "lr": 3e-3}, {"optimizer": "adamw", "lr": 3e-3}, {"lr": 3e-3}):
        plain = parse_args([])
        optim, said = resumed_optim(plain.optim, saved, plain.typed)
        assert optim.optimizer == saved.get("optimizer", "adamw")  # a checkpoint from before the flag: AdamW's
        assert said == ([] if optim.optimizer == plain.optim.optimizer else
                        [f"--optimizer {optim.optimizer}, the checkpoint's run's (this version's default: "
                         f"{plain.optim.optimizer})"])
    typed = parse_args(["--optimizer", "muon"])
    with pytest.raises(BadInputError, match=r"--optimizer muon: the checkpoint's run trained with --optimizer adamw, "
                                            r"whose state this run resumes; leave the flag out"):
        resumed_optim(typed.optim, {"lr": 3e-3}, typed.typed)  # a checkpoint from before the flag: AdamW's
    assert resumed_optim(typed.optim, {"optimizer": "muon"}, typed.typed)[0].optimizer == "muon"
