"""Checkpoints under passing faults, on real processes and files: an OS error or MemoryError while reading ends
the run with exit 1 and keeps every file; a well-formed file without a checkpoint's content is set aside and the
one before resumes; a write that fails (disk full) removes its temporary file, logs a `stop` event and leaves the
previous checkpoint the newest.

The faults are injected by a `sitecustomize.py` on the subprocess's PYTHONPATH (as tests/exit_probe does), which
patches torch.load, or makes the disk fill up while one checkpoint's temporary file is written (its writes refused
with ENOSPC past its first 4 KiB), at start-up: the trainer's code runs unchanged."""
import shutil

import pytest
import torch

from tests.helpers import (REPO, Ranks, TINY, events, newest_checkpoint, run_flags, run_trainer, trainer_in_process,
                           write_dump)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("data"), train=40, valid=4, seed=7)


def flags(data, out, *extra):
    return run_flags(data, out, "--eval_every", "100", "--refit_iters", "0", *extra)


@pytest.fixture(scope="module")
def checkpointed(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpointed")
    r = run_trainer(flags(data, out, "--max_steps", 8, "--save_every", 4), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def patched(tmp_path, code: str) -> dict:
    """extra_env for a subprocess that runs `code` at start-up."""
    folder = tmp_path / "patch"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": f"{REPO}:{folder}"}


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


LOAD_FAILS = """
import errno, os, torch
def load(*args, **kwargs):
    if os.environ.get("RANK", "0") == "0":
        raise {error}
    return LOAD(*args, **kwargs)
LOAD, torch.load = torch.load, load
"""


def test_memory_exhausted_while_reading_a_checkpoint_exits_1_and_keeps_every_file(tmp_path, checkpointed, data):
    """The allocator fails under memory pressure: the checkpoints are good, and none may be set aside for it."""
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    before, metrics = files(out / "checkpoints"), (out / "metrics.jsonl").read_bytes()
    r = run_trainer(flags(data, out, "--max_steps", 10), timeout=120,
                    extra_env=patched(tmp_path, LOAD_FAILS.format(error="MemoryError()")))
    assert r.returncode == 1, r.stderr[-3000:]
    assert (f"reading checkpoint {out}/checkpoints/step_00000008.pt failed (MemoryError: ); every checkpoint is "
            "kept") in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "moved aside" not in r.stderr
    assert files(out / "checkpoints") == before and (out / "metrics.jsonl").read_bytes() == metrics


def test_an_io_error_while_rank_0_reads_a_checkpoint_ends_every_rank_with_exit_1(tmp_path, checkpointed, data):
    """An NFS hiccup on rank 0: it sends the outcome, so rank 1 exits 1 too rather than wait for a choice."""
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    before = files(out / "checkpoints")
    job = Ranks(flags(data, out, "--max_steps", 10),
                extra_env=patched(tmp_path, LOAD_FAILS.format(error='OSError(errno.EIO, "Input/output error")')),
                log_dir=tmp_path / "logs")
    try:
        assert job.wait(timeout=120) == [1, 1], job.output(0) + job.output(1)
    finally:
        job.close()
    for rank in (0, 1):
        assert "step_00000008.pt failed (OSError: [Errno 5] Input/output error); every checkpoint is kept" \
            in job.output(rank), job.output(rank)[-3000:]
        assert "Traceback" not in job.output(rank)
    assert "rank 0: reading checkpoint" in job.output(1)
    assert files(out / "checkpoints") == before


def test_a_torch_file_without_a_checkpoints_content_is_set_aside_and_the_one_before_resumes(tmp_path, checkpointed,
                                                                                            data):
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    foreign = out / "checkpoints" / "step_00000012.pt"
    torch.save({"step": 12}, foreign)
    written = foreign.read_bytes()
    r = run_trainer(flags(data, out, "--max_steps", 10), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("step_00000012.pt is unreadable (a torch file without a checkpoint's content (no 'model', 'codec', "
            "'optimizer', 'samples_seen', 'rng')); moved aside to step_00000012.pt.unreadable") in r.stderr
    assert "resumed from" in r.stderr and "at step 8" in r.stderr
    assert (out / "checkpoints" / "step_00000012.pt.unreadable").read_bytes() == written
    assert events(out, "stop")[-1] == {**events(out, "stop")[-1], "step": 10, "reason": "max_steps"}


DISK_FULL = """
import builtins, errno, io
class Full(io.FileIO):  # a disk with 4 KiB free: the first writes land, a short one, then ENOSPC
    def write(self, b):
        room = 4096 - self.tell()
        if room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(bytes(memoryview(b)[:room]))
def full(file, mode="r", *args, **kwargs):  # the disk fills up while this checkpoint is written
    if str(file).endswith("{name}.tmp") and mode == "wb":
        return io.BufferedWriter(Full(file, "w"))
    return OPEN(file, mode, *args, **kwargs)
OPEN, builtins.open = builtins.open, full
"""


def test_a_checkpoint_write_that_fails_removes_its_tmp_logs_a_stop_and_keeps_the_one_before(tmp_path, data):
    """The disk fills up halfway through the write. torch's zip writer, given the file, would replace the ENOSPC
    with a RuntimeError ("unexpected pos"): a traceback, the .tmp left on the full disk, and no stop event."""
    out = tmp_path / "run"
    r = run_trainer(flags(data, out, "--max_steps", 12, "--save_every", 4), timeout=120,
                    extra_env=patched(tmp_path, DISK_FULL.format(name="step_00000008.pt")))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "unexpected pos" not in r.stderr, r.stderr[-3000:]
    assert f"writing checkpoint {out}/checkpoints/step_00000008.pt failed: [Errno 28] No space left on device" \
        in r.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004.pt"]
    assert [e["step"] for e in events(out, "checkpoint")] == [4]
    stop = events(out, "stop")
    assert len(stop) == 1 and stop[0]["step"] == 8 and "No space left on device" in stop[0]["reason"]
    assert [e["step"] for e in events(out, "train")][-1] == 8  # no step after the failed write


def test_a_full_disk_under_rank_0s_checkpoint_ends_every_rank_with_exit_1_not_a_lost_rank(tmp_path, data):
    out = tmp_path / "run"
    job = Ranks(flags(data, out, "--max_steps", 12, "--save_every", 4),
                extra_env=patched(tmp_path, DISK_FULL.format(name="step_00000008.pt")), log_dir=tmp_path / "logs")
    try:
        assert job.wait(timeout=150) == [1, 1], job.output(0)[-3000:] + job.output(1)[-3000:]
    finally:
        job.close()
    for rank in (0, 1):
        assert "step_00000008.pt failed: [Errno 28] No space left on device" in job.output(rank), job.output(rank)
        assert "Traceback" not in job.output(rank) and "lost" not in job.output(rank), job.output(rank)[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004.pt"]


def test_a_failed_write_before_a_compile_ends_the_run_with_that_step_not_taken(tmp_path, data):
    """Step 1 runs eager (the k-means init in its forward); step 2 compiles, after a checkpoint of step 1. That
    write fails: exit 1 before any compile, step 2 not taken, no checkpoint."""
    out = tmp_path / "run"
    r = run_trainer(flags(data, out, "--max_steps", 4, "--kmeans_init_frames", 0, "--compile", "on",
                          "--refit_iters", 0), timeout=120,
                    extra_env=patched(tmp_path, DISK_FULL.format(name="step_00000001.pt")))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "compile: saving step 1 first" in r.stderr
    assert "compile: compiling the training step" not in r.stderr
    assert "step_00000001.pt failed: [Errno 28] No space left on device" in r.stderr
    assert not list((out / "checkpoints").iterdir())
    stop = events(out, "stop")
    assert len(stop) == 1 and stop[0]["step"] == 1 and "No space left on device" in stop[0]["reason"]


def test_truncated_checkpoint_falls_back_to_the_previous(tmp_path, small_data):
    out = tmp_path / "run"
    common = ["--data_dir", small_data, *TINY, "--eval_every", "100", "--save_every", "4", "--output_dir", out]
    assert trainer_in_process([*common, "--max_steps", "8"]).returncode == 0
    newest = out / "checkpoints" / "step_00000008.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    r = trainer_in_process([*common, "--max_steps", "10"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unreadable" in r.stderr and "at step 4" in r.stderr


def test_a_run_that_would_start_behind_the_checkpoints_in_its_output_dir_exits_2_and_keeps_them(tmp_path, small_data):
    """--resume none in a run dir, or an older --resume path: the new run's checkpoints would be the oldest there,
    pruned first under --keep_checkpoints, and a later --resume auto would pick the old run's."""
    out = tmp_path / "run"
    common = ["--data_dir", small_data, *TINY, "--eval_every", "100", "--refit_iters", "0", "--output_dir", out]
    assert trainer_in_process([*common, "--max_steps", "12", "--save_every", "4"]).returncode == 0
    folder = out / "checkpoints"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for resume, start in (("none", 0), (str(folder / "step_00000004.pt"), 4)):
        r = trainer_in_process([*common, "--max_steps", "14", "--save_every", "2", "--resume", resume])
        assert r.returncode == 2, r.stderr[-3000:]
        assert (f"holds checkpoints of another run, up to step_00000012.pt, ahead of step {start} where this run "
                f"starts (--resume {resume})") in r.stderr
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    r = trainer_in_process([*common, "--max_steps", "14", "--save_every", "2", "--resume",
                            str(folder / "step_00000012.pt")])
    assert r.returncode == 0 and "at step 12" in r.stderr, r.stderr[-3000:]  # the newest: nothing ahead of it


def test_unreadable_checkpoints_are_moved_aside_and_never_push_new_ones_out(tmp_path, small_data):
    """Every checkpoint truncated: the run starts at step 0, and the retention window holds its own checkpoints,
    not the unreadable ones (which sort newer); those are kept, renamed, and never overwritten."""
    out = tmp_path / "run"
    common = ["--data_dir", small_data, *TINY, "--eval_every", "100", "--refit_iters", "0", "--output_dir", out]
    assert trainer_in_process([*common, "--max_steps", "12", "--save_every", "4"]).returncode == 0
    folder = out / "checkpoints"
    cut = {}
    for step in (4, 8, 12):
        path = folder / f"step_{step:08d}.pt"
        cut[step] = path.read_bytes()[:path.stat().st_size // 2]
        path.write_bytes(cut[step])
    r = trainer_in_process([*common, "--max_steps", "10", "--save_every", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("is unreadable (RuntimeError: PytorchStreamReader failed") == 3
    assert r.stderr.count("moved aside") == 3 and "resumed from" not in r.stderr
    assert [e["step"] for e in events(out, "checkpoint")[-5:]] == [2, 4, 6, 8, 10]
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_00000004.pt.unreadable", "step_00000006.pt", "step_00000008.pt", "step_00000008.pt.unreadable",
        "step_00000010.pt", "step_00000012.pt.unreadable"]
    assert all((folder / f"step_{step:08d}.pt.unreadable").read_bytes() == cut[step] for step in cut)
    assert newest_checkpoint(out)["step"] == 10  # the newest readable one is what --resume auto continues from

    r = trainer_in_process([*common, "--max_steps", "12", "--save_every", "2"])  # moved aside once: no warning again
    assert r.returncode == 0 and "is unreadable" not in r.stderr and "at step 10" in r.stderr, r.stderr[-3000:]


def test_an_empty_or_truncated_checkpoint_is_reported_with_the_reason(tmp_path, caplog):
    from training.checkpoint import load_latest, save_checkpoint

    good = {"step": 2, "model": {}, "codec": {}}
    save_checkpoint(tmp_path, 2, good, keep=4)
    (tmp_path / "step_00000004.pt").write_bytes(b"")
    (tmp_path / "step_00000006.pt").write_bytes(b"not a checkpoint")
    save_checkpoint(tmp_path, 8, {"step": 8}, keep=4)  # a well-formed torch file, but no checkpoint
    path, state = load_latest(tmp_path)
    assert path.name == "step_00000002.pt" and state == good
    assert "step_00000004.pt is unreadable (empty file)" in caplog.text
    assert "step_00000006.pt is unreadable (not a torch checkpoint, or one holding objects other than tensors" \
        in caplog.text
    assert "step_00000008.pt is unreadable (a torch file without a checkpoint's content (no 'model', 'codec'))" \
        in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir())[-1] == "step_00000008.pt"  # load_latest only reads


def test_a_checkpoint_resumes_into_its_own_codec_and_a_field_it_predates_counts_at_its_default(tmp_path):
    import dataclasses

    from errors import BadInputError
    from models.codec import CodecConfig
    from training.resume import check_codec

    codec = CodecConfig(feature_dim=16)
    older = {k: v for k, v in codec.to_dict().items() if k != "beam_size"}  # saved before --beam_size existed
    check_codec(tmp_path / "a.pt", {"codec": older}, codec)
    for other in (dataclasses.replace(codec, beam_size=1), dataclasses.replace(codec, codebook_size=512)):
        with pytest.raises(BadInputError, match="differs from this run's flags"):
            check_codec(tmp_path / "a.pt", {"codec": older}, other)
