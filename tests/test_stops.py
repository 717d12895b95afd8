"""A stop signal is honoured in every phase within seconds: delivered inside the refit, the k-means init, and the
teardown, to real trainer processes whose stderr goes to a file (where no log line may be glued to a bar's)."""
import re
import signal
import sys
import time

import pytest
import torch

from tests.helpers import (Ranks, TINY, TRAINER, env, events, newest_checkpoint, run_flags, run_python,
                           run_trainer, signal_while_importing, start_python, trainer_in_process, write_dump)

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

SLOW_REFIT = ["--refit_iters", "20000"]  # minutes of Lloyd steps: a stop must cut it short
LOG_LINE = re.compile(r"\d\d:\d\d:\d\d \[rank\d\] (INFO|WARNING|ERROR) ")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("data"), train=40, valid=4, seed=11)


def flags(data, out, *extra):
    return run_flags(data, out, "--eval_every", "100", *extra)


class Run:
    """One trainer process, its stdout and stderr in a file, as a cluster job's log."""

    def __init__(self, args, log):
        self.log = log
        log.write_text("")
        self.proc = start_python([TRAINER, *args], stdout=log, env=env())

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, text, timeout=120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)

    def signal_after(self, text, sig, delay=0.0, timeout=30) -> tuple[int, float]:
        """`sig` once `text` is in the log and `delay` seconds more: the exit code and the seconds from the signal to
        the exit."""
        try:
            self.wait_for(text)
            time.sleep(delay)
            sent = time.monotonic()
            self.proc.send_signal(sig)
            code = self.proc.wait(timeout=timeout)
            return code, time.monotonic() - sent
        finally:
            self.kill()

    def signal_until_exit(self, sig, every=0.01, timeout=60) -> int:
        """Send `sig` again and again until the process ends (a teardown's every moment gets one); its exit code."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                break
            time.sleep(every)
        return self.proc.wait(timeout=5)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def assert_not_glued(text: str) -> None:
    """Each log line starts a line of the file, or follows the carriage return of a bar cleared before it."""
    for line in text.split("\n"):
        for match in LOG_LINE.finditer(line):
            assert match.start() == 0 or line[match.start() - 1] == "\r", repr(line[:300])


@pytest.mark.timeout(240)
def test_sigterm_during_the_refit_saves_the_trained_weights_and_a_resume_does_the_refit(tmp_path, data):
    straight = tmp_path / "straight"
    r = run_trainer(flags(data, straight, "--max_steps", 6), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp_path / "split"
    run = Run(flags(data, out, "--max_steps", 6, *SLOW_REFIT), tmp_path / "split.log")
    try:
        run.wait_for("codebooks: refit of")
        sent = time.time()
        run.proc.send_signal(signal.SIGTERM)
        run.wait_for("INFO checkpoint: ", timeout=30)
        # more SIGTERMs through the teardown, until the process is gone: the outcome is saved, exit 0 stays
        code = run.signal_until_exit(signal.SIGTERM)
        ended = time.time()
    finally:
        run.kill()
    assert code == 0, run.text()[-3000:]
    saved = (out / "checkpoints" / "step_00000006.pt").stat().st_mtime - sent
    print(f"SIGTERM in the refit: checkpoint {saved:.1f} s after the signal, exit after {ended - sent:.1f} s")
    assert saved < 10 and ended - sent < 15
    assert "stopped during the refit: the codebooks are put back as training left them" in run.text()
    assert events(out, "stop")[-1]["reason"] == "signal SIGTERM during the refit"
    assert not events(out, "refit")
    assert newest_checkpoint(out)["end_of_schedule"] == []  # the trained weights: a resume does the refit
    assert_not_glued(run.text())

    r = run_trainer(flags(data, out, "--max_steps", 6), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "at step 6" in r.stderr
    assert "codebooks: refit of" in r.stderr and "final eval at step 6: " in r.stderr  # each says so as it starts
    assert [e["step"] for e in events(out, "refit")] == [6]
    assert events(out, "eval")[-1]["beam_size"] == 4 and events(out, "stop")[-1]["reason"] == "max_steps"
    a, b = newest_checkpoint(straight), newest_checkpoint(out)
    assert a["end_of_schedule"] == b["end_of_schedule"] == ["refit", "final eval"]
    for key in a["model"]:  # a refit from the trained weights, as if never stopped
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0, msg=key)


@pytest.mark.timeout(180)
def test_sigint_during_the_kmeans_init_stops_within_seconds_with_nothing_trained(tmp_path, data):
    out = tmp_path / "run"
    run = Run(flags(data, out, "--max_steps", 4, "--kmeans_init_frames", 400000), tmp_path / "run.log")
    code, took = run.signal_after("k-means init:", signal.SIGINT)  # its bar: the sample is read, the iterations begin
    print(f"SIGINT in the k-means init: exit {took:.1f} s after the signal")
    assert code == 0 and took < 10, run.text()[-3000:]
    assert "codebooks: k-means init of 2 levels x 32 codes" in run.text()  # it says so when it starts
    assert "stopped during the k-means init, before the first step: nothing trained, no checkpoint" in run.text()
    assert events(out, "stop") == [{**events(out, "stop")[0], "step": 0,
                                    "reason": "signal SIGINT during the k-means init"}]
    assert not events(out, "train") and not list((out / "checkpoints").iterdir())
    assert_not_glued(run.text())


@pytest.mark.timeout(240)
def test_sigint_in_the_default_codecs_kmeans_init_on_200k_frames_ends_the_run_within_5_s(tmp_path, data):
    """The default codec (8 levels x 1024 codes) on a sample of 200,000 frames: each of the library's passes over the
    whole sample takes seconds on 2 CPU cores, and a stop does not wait for one. Nothing is timed or shown after it
    (no GEMM timed for MFU, no training bar)."""
    out = tmp_path / "run"
    run = Run(["--data_dir", data, "--output_dir", out, "--max_steps", 4, "--eval_every", 100, "--compile", "off",
               "--kmeans_init_frames", 200000], tmp_path / "run.log")
    code, took = run.signal_after("k-means init:", signal.SIGINT, delay=1, timeout=60)  # in the library's passes
    print(f"SIGINT in the default codec's k-means init on 200k frames: exit {took:.1f} s after the signal")
    text = run.text()
    assert code == 0 and took < 5, (took, text[-3000:])
    assert "codebooks: k-means init of 8 levels x 1024 codes (10 iterations each) on about 200000 frames" in text
    assert "SIGINT received during the k-means init: it is abandoned" in text
    assert [e["reason"] for e in events(out, "stop")] == ["signal SIGINT during the k-means init"]
    assert "MFU:" not in text and "step/s" not in text and "compile:" not in text, text[-3000:]  # step/s: the bar's
    assert not list((out / "checkpoints").iterdir())
    assert_not_glued(text)


@pytest.mark.timeout(180)
def test_sighup_to_one_rank_during_the_refit_stops_every_rank_with_the_trained_weights(tmp_path, data):
    out = tmp_path / "run"
    job = Ranks(flags(data, out, "--max_steps", 8, "--sync_check_every", 4, *SLOW_REFIT), log_dir=tmp_path / "logs")
    try:
        job.wait_for(0, "codebooks: refit of", timeout=120)
        sent = time.time()
        job.procs[1].send_signal(signal.SIGHUP)  # a closed terminal, an ssh connection dropped
        codes = job.wait(timeout=30)
        ended = time.time()
    finally:
        job.close()
    assert codes == [0, 0], job.output(0) + job.output(1)
    saved = (out / "checkpoints" / "step_00000008.pt").stat().st_mtime - sent
    print(f"SIGHUP to rank 1 in the refit: checkpoint {saved:.1f} s after the signal, exit after "
          f"{ended - sent:.1f} s")
    assert saved < 10
    assert "SIGHUP received" in job.output(1)
    assert events(out, "stop")[-1]["reason"] == "signal on rank(s) [1] during the refit"
    assert newest_checkpoint(out)["step"] == 8 and newest_checkpoint(out)["end_of_schedule"] == []


PEER_STOP = r"""
import os, time, torch, torch.distributed as dist
from data.training_data import DataConfig, open_training_data
from models.codec import CodecConfig, RVQCodec
from training.codebooks import refit
from training.distributed import DistContext
from training.evaluate import evaluate
from training.faults import FaultInjector
from training.metrics_log import MetricsLog
from training.progress import Progress
from training.signals import Stopped, StopRequest
from training.watchdog import PeerWatchdog

dist.init_process_group("gloo")
rank = dist.get_rank()
ctx = DistContext(rank, 2, rank, torch.device("cpu"), control=dist.group.WORLD)
data = open_training_data(DataConfig(data_dir=DATA, segment_length=32), rank=rank, world_size=2, seed=0,
                          multiple_of=1, device_type="cpu")
torch.manual_seed(0)
model = RVQCodec(CodecConfig(feature_dim=16, latent_dim=32, num_quantizers=2, codebook_size=32))
model.init_codebooks(torch.randn(8, 16, 16), batch_frames=64)
stop = StopRequest()
watchdog = PeerWatchdog(rank, 2, timeout_s=60, slow_timeout_s=60, progress=Progress(), interval_s=0.5,
                        stop=stop).start()
encoded, asked = [], []

def hook(*_):
    encoded.append(time.time())
    if rank == 1 and len(encoded) == 2:  # rank 1 is asked to stop inside its pass, between two of its encodes
        asked.append(time.time())
        stop.request("SIGTERM")
    if rank == 0:
        time.sleep(0.5)  # rank 0's share takes half a second an encode

model.encoder.register_forward_hook(hook)
try:
    if PHASE == "refit":  # one encode an utterance in the first pass
        total = len(data.shard)
        refit(model, data.shard, ctx, iters=3, frames=10**9, batch_frames=64, seed=0, step=8,
              metrics=MetricsLog(None), stop=stop)
    else:  # one window a batch
        total = len(data.eval.utterances)
        evaluate(model, data.eval, ctx, amp_dtype=None, batch_frames=32, step=8, metrics=MetricsLog(None),
                 faults=FaultInjector(rank, ""), stop=stop)
except Stopped as e:
    print(f"rank {rank} stopped: {e}; share {total}, encoded {len(encoded)}, at {time.time():.3f}, "
          f"asked {asked[0] if asked else ''}")
watchdog.stop()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["refit", "eval"])
def test_a_stop_on_one_rank_cuts_short_the_share_of_a_rank_with_no_signal(tmp_path, phase):
    """A stop requested on rank 1 inside the refit's first pass, or inside an eval: rank 0, which got no signal,
    learns of it from its watchdog (rank 1's published state) and leaves its share after an encode or two,
    rather than finish it (half a second an encode here) while rank 1 waits; both raise Stopped with rank 1's
    reason."""
    from tests.helpers import run_gloo_ranks, write_dump

    data = write_dump(tmp_path / "data", train=40, valid=40, seed=3)
    outs = run_gloo_ranks(f"DATA, PHASE = {str(data)!r}, {phase!r}\n" + PEER_STOP, timeout=100)
    found = [re.search(r"rank (\d) stopped: (.*); share (\d+), encoded (\d+), at ([\d.]+), asked ([\d.]*)", out)
             for out in outs]
    assert all(found), outs
    (_, reason0, share0, encoded0, at0, _), (_, reason1, _, _, at1, asked) = (m.groups() for m in found)
    print(f"{phase}: rank 0 encoded {encoded0} of {share0}; stopped {float(at0) - float(asked):.1f} s after rank "
          f"1's request")
    assert reason0 == reason1 == "signal on rank(s) [1]"
    assert int(share0) >= 15 and int(encoded0) <= 8, outs[0]  # its whole share would take 7.5 s or more
    assert float(at0) - float(asked) < 5 and float(at1) - float(asked) < 5


def test_a_stop_requested_during_an_eval_leaves_it_between_two_batches(tmp_path, data):
    """evaluate() looks at the stop request before each batch: the eval is left unfinished and writes nothing."""
    from data.training_data import DataConfig, open_training_data
    from models.codec import CodecConfig, RVQCodec
    from training.distributed import DistContext
    from training.evaluate import evaluate
    from training.faults import FaultInjector
    from training.metrics_log import MetricsLog
    from training.signals import Stopped, StopRequest

    held_out = open_training_data(DataConfig(data_dir=str(data), segment_length=32), rank=0, world_size=1, seed=0,
                                  multiple_of=1, device_type="cpu").eval
    model = RVQCodec(CodecConfig(feature_dim=16, latent_dim=32, num_quantizers=2, codebook_size=32))
    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    stop = StopRequest()
    batches = []
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    model.register_forward_hook(lambda *_: batches.append(stop.request("SIGTERM")))  # the signal in batch 1
    with pytest.raises(Stopped, match="^signal SIGTERM$"):
        evaluate(model, held_out, ctx, amp_dtype=None, batch_frames=64, step=4, metrics=metrics,
                 faults=FaultInjector(0, ""), stop=stop)
    metrics.close()
    assert len(batches) == 1 and model.training  # of 4 batches, one ran; the model is back in training mode
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_signal_during_an_eval_batch_leaves_the_eval_at_once(tmp_path, data):
    """A signal abandons this rank's share of an eval where it is, inside a batch (the share changes no state):
    the batch's forward does not finish, and the eval raises Stopped as a stop between batches does."""
    import os

    from data.training_data import DataConfig, open_training_data
    from models.codec import CodecConfig, RVQCodec
    from training.distributed import DistContext
    from training.evaluate import evaluate
    from training.faults import FaultInjector
    from training.metrics_log import MetricsLog
    from training.signals import Stopped, StopRequest

    held_out = open_training_data(DataConfig(data_dir=str(data), segment_length=32), rank=0, world_size=1, seed=0,
                                  multiple_of=1, device_type="cpu").eval
    model = RVQCodec(CodecConfig(feature_dim=16, latent_dim=32, num_quantizers=2, codebook_size=32))
    stop, decoded = StopRequest().install(), []
    model.encoder.register_forward_hook(lambda *_: os.kill(os.getpid(), signal.SIGTERM))  # the signal in batch 1
    model.decoder.register_forward_hook(lambda *_: decoded.append(1))
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    try:
        with pytest.raises(Stopped, match="^signal SIGTERM$"):
            evaluate(model, held_out, DistContext(0, 1, 0, torch.device("cpu")), amp_dtype=None, batch_frames=64,
                     step=4, metrics=metrics, faults=FaultInjector(0, ""), stop=stop)
    finally:
        stop.restore()
        metrics.close()
    assert not decoded and model.training and stop.interrupt is None
    assert (tmp_path / "metrics.jsonl").read_text() == ""


COMPILED = ["--compile", "on", "--refit_iters", "0"]


@pytest.mark.timeout(240)
def test_a_compile_after_a_trained_step_saves_it_first_and_a_sigterm_in_it_ends_at_once(tmp_path, data):
    """The k-means init in the first forward: step 1 runs eager, step 2 is the first compiled. Step 1 is saved
    before that compile, as an eager run of one step leaves it; a SIGTERM in the compile then abandons it at
    once with nothing to save, the codebooks' updates of the forward that was compiling not applied."""
    one_step = tmp_path / "one_step"
    r = run_trainer(flags(data, one_step, "--max_steps", 1, "--kmeans_init_frames", 0, "--refit_iters", 0),
                    timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    run = Run(flags(data, out, "--max_steps", 6, "--kmeans_init_frames", 0, *COMPILED), tmp_path / "run.log")
    try:
        run.wait_for("compile: compiling the training step")
        time.sleep(1)  # inside the compile, which takes far longer
        sent = time.time()
        run.proc.send_signal(signal.SIGTERM)
        code = run.proc.wait(timeout=60)
        ended = time.time()
    finally:
        run.kill()
    print(f"SIGTERM in the compile: exit after {ended - sent:.1f} s")
    assert code == 0 and ended - sent < 20, run.text()[-3000:]
    text = run.text()
    assert text.index("compile: saving step 1 first") < text.index("compile: compiling the training step")
    assert ("stopped during the compile of step 2: nothing trained since the last checkpoint (step 1, written "
            "before the compile), so nothing to save; the compile is abandoned") in text
    assert [e["step"] for e in events(out, "checkpoint")] == [1]
    assert events(out, "stop")[-1] == {**events(out, "stop")[-1], "step": 1,
                                       "reason": "signal SIGTERM during the compile"}
    a, b = newest_checkpoint(one_step), newest_checkpoint(out)
    assert b["samples_seen"] == a["samples_seen"]
    for key in a["model"]:  # the quantizer's buffers (codebooks, EMA sums) among them
        torch.testing.assert_close(b["model"][key], a["model"][key], rtol=0, atol=0, msg=key)


def sigterm_to_rank_1_in(phase: str, tmp_path, data, *extra) -> tuple[list, float, str, str]:
    """Two ranks; SIGTERM to rank 1 a second after rank 0 logs `phase`: (exit codes, seconds from the signal to the
    last exit, rank 0's output, rank 1's)."""
    job = Ranks(flags(data, tmp_path / "run", "--sync_timeout", 10, *extra), log_dir=tmp_path / "logs")
    try:
        job.wait_for(0, phase, timeout=150)
        time.sleep(1)
        sent = time.monotonic()
        job.procs[1].send_signal(signal.SIGTERM)
        codes = job.wait(timeout=60)
        took = max(job.ended.values()) - sent
    finally:
        job.close()
    return codes, took, job.output(0), job.output(1)


def sigterm_to_rank_1_in_a_compile(tmp_path, data, *extra) -> tuple[list, float, str, str]:
    """Two ranks under --compile on; SIGTERM to rank 1 once rank 0 logs a compile."""
    return sigterm_to_rank_1_in("compile: compiling the training step", tmp_path, data, "--max_steps", 6, *extra,
                                *COMPILED)


@pytest.mark.timeout(240)
def test_sigterm_to_one_rank_in_the_kmeans_init_ends_every_rank_at_once_with_nothing_to_save(tmp_path, data):
    """Two ranks in the k-means init, whose passes hold the library's collectives: the signalled rank abandons it
    at once and leaves, and the other, inside a pass or waiting in its collective, finds it gone and stops too with
    exit 0 rather than report it lost."""
    out = tmp_path / "run"
    codes, took, rank0, rank1 = sigterm_to_rank_1_in("k-means init:", tmp_path, data, "--max_steps", 4,
                                                     "--kmeans_init_frames", 400000)
    print(f"SIGTERM to rank 1 in the k-means init: both ranks ended {took:.1f} s after the signal")
    assert codes == [0, 0] and took < 20, rank0 + rank1
    assert "SIGTERM received during the k-means init: it is abandoned" in rank1
    assert ("rank(s) [1] stopped on request at step 0, with nothing trained since the last checkpoint: this rank "
            "stops too, with nothing to save. Exit code 0") in rank0
    assert [e["step"] for e in events(out, "stop")] == [0]
    assert not list((out / "checkpoints").iterdir()) and "MFU:" not in rank0


@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_in_a_compile_after_trained_steps_ends_every_rank_at_once_step_saved(tmp_path, data):
    """Two ranks, step 1 eager, step 2 compiling: step 1 was saved before the compile, so the signalled rank
    leaves at once, and the other, in its compile or already waiting for its peer inside the compiled step's
    all-reduce, stops too with exit 0. What an agreed stop would have saved is on disk: step 1."""
    out = tmp_path / "run"
    codes, took, rank0, rank1 = sigterm_to_rank_1_in_a_compile(tmp_path, data, "--kmeans_init_frames", 0)
    print(f"SIGTERM to rank 1 in the compile of step 2: both ranks ended {took:.1f} s after the signal")
    assert codes == [0, 0] and took < 20, rank0 + rank1
    assert "compile: saving step 1 first" in rank0
    assert "stopped during the compile of step 2: nothing trained since the last checkpoint (step 1" in rank1
    assert ("rank(s) [1] stopped on request at step 1, with nothing trained since the last checkpoint: this rank "
            "stops too, with nothing to save. Exit code 0") in rank0
    assert [e["step"] for e in events(out, "checkpoint")] == [1]
    assert [e["step"] for e in events(out, "stop")] == [1]
    assert newest_checkpoint(out)["step"] == 1 and len(newest_checkpoint(out)["rng"]) == 2


@pytest.mark.timeout(240)
def test_sigterm_to_one_rank_in_the_first_compile_ends_every_rank_at_once_with_nothing_to_save(tmp_path, data):
    """Nothing trained: the signalled rank leaves at once, and the other, finding it gone, stops too with exit 0
    rather than report it lost."""
    out = tmp_path / "run"
    codes, took, rank0, rank1 = sigterm_to_rank_1_in_a_compile(tmp_path, data)
    print(f"SIGTERM to rank 1 in the compile: both ranks ended {took:.1f} s after the signal")
    assert codes == [0, 0] and took < 20, rank0 + rank1
    assert ("stopped during the compile of step 1: nothing trained since the last checkpoint, so nothing to save"
            in rank1)
    assert ("rank(s) [1] stopped on request at step 0, with nothing trained since the last checkpoint: this rank "
            "stops too, with nothing to save. Exit code 0") in rank0
    stops = events(out, "stop")  # rank 0 records it
    assert [e["step"] for e in stops] == [0] and stops[0]["reason"].startswith("rank(s) [1] stopped on request")
    assert not events(out, "train") and not list((out / "checkpoints").iterdir())


@pytest.mark.timeout(180)
def test_sigterm_during_the_imports_stops_before_the_first_step_and_a_relaunch_trains(tmp_path, data):
    """The trainer records a stop signal from its first lines, before torch is imported (seconds): a fresh
    interpreter, not a fork of the tests' zygote, which has imported torch already."""
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    code = signal_while_importing([sys.executable, TRAINER, *flags(data, out, "--max_steps", 2)], signal.SIGTERM,
                                  log=log, env=env())
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert ("stopped before the first step (signal SIGTERM): nothing trained, no checkpoint written; relaunch the "
            "same command to start the run") in text
    assert [e["reason"] for e in events(out, "stop")] == ["signal SIGTERM before the first step"]
    assert not events(out, "train") and not list((out / "checkpoints").iterdir())

    r = run_trainer(flags(data, out, "--max_steps", 2), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert events(out, "stop")[-1] == {**events(out, "stop")[-1], "step": 2, "reason": "max_steps"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_stop_and_resume_gives_identical_weights(tmp_path, small_data, optimizer):
    common = ["--data_dir", small_data, *TINY, "--max_steps", "24", "--eval_every", "8", "--save_every", "100",
              "--multi_length_training", "--segment_lengths", "16,32,64", "--quantize_dropout",
              "--optimizer", optimizer]
    straight = tmp_path / "straight"
    r = trainer_in_process([*common, "--output_dir", straight])
    assert r.returncode == 0, r.stderr[-3000:]

    split = tmp_path / "split"
    r = run_trainer([*common, "--output_dir", split], extra_env={"RVQ_FAULT": "signal:step=12:sig=TERM"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SIGTERM received" in r.stderr
    stops = events(split, "stop")  # the signal lands during step 13: the run stops when that step is done
    assert stops[-1]["step"] == 13 and "SIGTERM" in stops[-1]["reason"]
    assert [e["step"] for e in events(split, "checkpoint")] == [13]

    r = trainer_in_process([*common, "--output_dir", split])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "at step 13" in r.stderr

    a, b = newest_checkpoint(straight), newest_checkpoint(split)
    assert a["step"] == b["step"] == 24
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0, msg=key)

    trained = len(events(split, "train"))  # the same command once more: a finished run says so, and trains nothing
    r = trainer_in_process([*common, "--output_dir", split])
    assert r.returncode == 0 and "holds a finished run (step 24" in r.stderr, r.stderr[-3000:]
    assert "give another --output_dir" in r.stderr and len(events(split, "train")) == trained
    # nor does it read batches, time a GEMM, show a train bar or say it trains
    assert not [said for said in ("MFU:", "step/s", "training for", "compile:") if said in r.stderr], r.stderr[-3000:]
    # its optimizer's state is what it resumes: another is refused, with nothing written
    other = "muon" if optimizer == "adamw" else "adamw"
    r = trainer_in_process([*common, "--output_dir", split, "--max_steps", "30", "--optimizer", other])
    assert r.returncode == 2 and f"--optimizer {other}: the checkpoint's run trained with --optimizer {optimizer}" \
        in r.stderr, r.stderr[-3000:]
    assert newest_checkpoint(split)["step"] == 24 and len(events(split, "train")) == trained


def test_first_sigint_requests_a_stop_and_the_second_exits_at_once():
    script = (
        "import os, signal\n"
        "from training.signals import StopRequest\n"
        "stop = StopRequest().install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('stop requested:', stop.reason, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('still running', flush=True)\n"
    )
    r = run_python(["-c", script], env=env(), timeout=60)
    assert r.returncode == 130
    assert "stop requested: SIGINT" in r.stdout and "still running" not in r.stdout


def test_an_error_the_abandoned_work_raises_while_unwinding_from_the_signal_is_that_stop():
    """A signal inside work being abandoned raises Interrupted there; when that work's own clean-up then fails
    (dynamo's tracer popping a frame it never pushed, as seen in a compile), the stop is still a stop."""
    import os

    from training.signals import Interrupted, StopRequest

    stop = StopRequest().install()
    try:
        with pytest.raises(Interrupted, match="SIGTERM") as raised:
            with stop.abandoning("the compile"):
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # the handler raises here
                finally:
                    [].pop()  # the clean-up's own error, raised while Interrupted unwinds
        assert isinstance(raised.value.__cause__, IndexError)
        with pytest.raises(ValueError):  # an error with no signal behind it is that error
            with StopRequest().abandoning("the compile"):
                raise ValueError("not a stop")
    finally:
        stop.restore()


def test_a_stop_signal_handled_inside_a_finalizer_still_abandons_the_work_at_once():
    """The handler may run inside a finalizer (a weakref callback or a __del__ that the compiler's garbage sets off),
    where Python cannot raise: the Interrupted it raises there is swallowed. The stop is then delivered again and
    raised where the work goes on, rather than lost until the work's end (a compile's: tens of seconds on a CPU)."""
    import os
    import weakref

    from training.signals import Interrupted, StopRequest

    class Garbage:
        pass

    def finalizer():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on return, inside the finalizer

    stop = StopRequest().install()
    try:
        start = time.monotonic()
        with pytest.raises(Interrupted, match="SIGTERM"):
            with stop.abandoning("the compile"):
                garbage = Garbage()
                weakref.finalize(garbage, finalizer)
                del garbage  # the finalizer runs now
                for _ in range(100):  # the rest of the work: 10 s
                    time.sleep(0.1)
        assert time.monotonic() - start < 2
        assert stop.reason == "SIGTERM" and stop.interrupt is None
    finally:
        stop.restore()
