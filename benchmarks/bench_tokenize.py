"""Steady-state speed of audio -> w2v-BERT features -> codes: `tools.extract` and `tools.tokenize` end to end, and
the model alone on the same batches (the pipeline's ceiling), in audio seconds per second and MFU.

For each length mix (generated speech-like tones and chirps at 16, 22.05 and 44.1 kHz, wav, flac and ogg, some
stereo: benchmarks/bench_extract.py's corpus) and each tree (--repo: this one, or a copy such as the committed
HEAD unpacked with `git archive HEAD | tar -x -C /tmp/before`, so that before and after run side by side):

- extract: `python -m tools.extract SOURCE train 1 0 OUT --feature w2v-bert --checkpoint MODEL --layer L`, run in
  a process of its own from that tree;
- tokenize: `python -m tools.tokenize SOURCE train 1 0 OUT --checkpoint CODEC`, an untrained default-sized codec
  that records the features of a short extraction by the same tree (the speed does not depend on the weights);
- model: the w2v-BERT forward passes the extraction made, replayed on the same module with the same inputs,
  already on the device (no decoding, no front-end, no copy back, no writing): the ceiling. The pipeline's
  share of it (model time / pipeline time over the same passes) is the figure to watch;
- loop: what a user writes in 20 lines, the user's alternative: transformers' own Wav2Vec2BertModel (its attention
  module, SDPA), truncated to layer L, in a plain loop over fixed batches of LOOP_ROWS inputs of LOOP_SECONDS
  already on the device, no padding, no I/O (it does not depend on the tree or the mix: one run a round).

Steady state: the clock starts at the shard's first commit (data/resumable_shard.py ShardWriter.commit, the end
of the first window: the model's load, the first window's decoding and passes and any compile are before it)
and stops at its last; the audio counted is that of the files committed in between, the FLOPs and the model
alone those of those files' windows' passes (each pass tagged with the window it computes). --work_seconds stops a run
once it has that much steady-state work behind it (a run on a GPU: the corpus lists its files again and again,
so that any speed has enough audio), so the windows must be several (--commit_seconds).

FLOPs: the matmuls of the truncated encoder up to layer L as a function of its config and each chunk's real
length (`encoder_flops`): the feature projection; per conformer layer the two half-step FFNs, the q/k/v/out
projections, QK^T and AV at the chunk's length, the relative-position bias as q against the left + right + 1
distance embeddings (what the bias needs; a T x T table of them is waste, not counted), the conv module's two
pointwise and its depthwise convolution. Padding is not counted: MFU is useful work over the device's peak
(--peak_tflops, or PEAK_TFLOPS for known GPUs); on a CPU, achieved GFLOP/s and no MFU unless --peak_tflops.
Padding: padded frames / real frames - 1 over every pass the run made.

    python benchmarks/bench_tokenize.py [--device cpu] [--model small] [--layer 4] [--mixes 5s,30s,2-20s]
        [--modes extract,model,tokenize] [--audio_minutes 10] [--repeats 3] [--repo /tmp/before --repo .]
        [--work_seconds S] [--commit_seconds S] [--out benchmarks/results/bench_tokenize.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent
SAMPLE_RATE, FRAME_RATE = 16_000, 50

# Wav2Vec2BertConfig overrides; the rest (relative_key positions, left 64, right 8, kernel 31, 160-d input) are
# transformers' defaults, which are w2v-BERT 2.0's
MODELS = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                  output_hidden_size=256),
    "w2v-bert-2.0": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                         output_hidden_size=1024),
}
DEFAULT_LAYER = {"small": 4, "w2v-bert-2.0": 17}
# dense peak TFLOP/s by compute dtype, for GPU names containing the key (first match wins)
PEAK_TFLOPS = {
    "H100 PCIe": {"bfloat16": 756, "float32": 51},
    "H100": {"bfloat16": 989, "float32": 67},
    "H200": {"bfloat16": 989, "float32": 67},
    "A100": {"bfloat16": 312, "float32": 19.5},
    "L40S": {"bfloat16": 362, "float32": 91.6},
}
# length mixes: name -> (description, a function of (rng, n) drawing n durations in seconds)
MIXES = {
    "5s": ("5-s files", lambda rng, n: np.full(n, 5.0)),
    "30s": ("30-s files", lambda rng, n: np.full(n, 30.0)),
    "2-20s": ("uniform 2-20 s", lambda rng, n: rng.uniform(2, 20, n)),
    "librispeech": ("lognormal around 12 s, 1-35 s (LibriSpeech-like)",
                    lambda rng, n: np.clip(rng.lognormal(math.log(12), 0.5, n), 1, 35)),
    "long": ("long files, 2-5 min", lambda rng, n: rng.uniform(120, 300, n)),
}


# ---- FLOPs from the config


def layer_flops(cfg: dict, t: int) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of one conformer layer over a chunk of t frames, by part."""
    h, i, k = cfg["hidden_size"], cfg["intermediate_size"], cfg["conv_depthwise_kernel_size"]
    parts = {"ffn (two half-step)": 2 * 2 * 2 * t * h * i, "q/k/v/out": 4 * 2 * t * h * h,
             "QK^T and AV": 2 * 2 * t * t * h, "conv module": 2 * t * h * 2 * h + 2 * t * h * k + 2 * t * h * h}
    if cfg.get("position_embeddings_type") == "relative_key":
        distances = cfg["left_max_position_embeddings"] + cfg["right_max_position_embeddings"] + 1
        parts["relative-position bias"] = 2 * t * distances * h
    return parts


def encoder_flops(cfg: dict, layers: int, lengths) -> float:
    """FLOPs of the encoder truncated after `layers` layers over chunks of these real lengths (frames)."""
    total = 0.0
    for t in lengths:
        t = int(t)
        total += 2 * t * cfg["feature_projection_input_dim"] * cfg["hidden_size"]
        total += layers * sum(layer_flops(cfg, t).values())
    return total


def flops_per_audio_second(cfg: dict, layers: int, chunk_seconds: float) -> float:
    t = int(chunk_seconds * FRAME_RATE)
    return encoder_flops(cfg, layers, [t]) / (t / FRAME_RATE)


def file_frames(samples: int) -> int:
    """Feature frames of `samples` at 16 kHz: 25 ms windows every 10 ms, stacked by two (data/audio/features.py)."""
    return max(0, (1 + (samples - 400) // 160) // 2) if samples >= 400 else 0


def chunk_lengths(frames: int, max_chunk: int) -> list[int]:
    """np.array_split's lengths: equal chunks of at most max_chunk frames (W2vBertLayer.chunks)."""
    n = max(1, math.ceil(frames / max_chunk))
    return [frames // n + (1 if j < frames % n else 0) for j in range(n)]


def peak_tflops(device_name: str, dtype: str) -> float | None:
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            return peaks.get(dtype)
    return None


# ---- the corpus


def write_mix(folder: Path, mix: str, audio_minutes: float, base_minutes: float, seed: int = 0) -> dict:
    """Distinct files of `mix` (bench_extract's voices, chirps, rates and formats) adding up to `base_minutes` (at
    most `audio_minutes`), listed again and again in a fairseq manifest until it holds `audio_minutes`. Returns
    {manifest, seconds (per entry), samples (per entry, at 16 kHz)}."""
    import soundfile as sf

    from tests.audio_helpers import chirp, voice_like

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    base, total = [], 0.0
    while total < min(base_minutes, audio_minutes) * 60:
        d = float(MIXES[mix][1](rng, 1)[0])
        k = len(base)
        rate, suffix, channels = ((16000, ".wav", 1), (22050, ".flac", 1), (44100, ".ogg", 2))[k % 3]
        x = chirp(d, rate) if k % 4 == 3 else voice_like(d, rate, seed=k)
        if channels == 2:
            x = np.stack([x, 0.6 * x[::-1]], axis=1)
        rel = f"{mix}_{k:04d}{suffix}"
        sf.write(folder / rel, x, rate, subtype="PCM_16" if suffix == ".wav" else None)
        samples = len(x) if rate == SAMPLE_RATE else round(len(x) * SAMPLE_RATE / rate)
        base.append((rel, len(x) / rate, samples))
        total += len(x) / rate
    entries, listed = [], 0.0
    while listed < audio_minutes * 60:
        for entry in base:
            entries.append(entry)
            listed += entry[1]
            if listed >= audio_minutes * 60:
                break
    manifest = folder / f"{mix}.tsv"
    manifest.write_text(f"{folder}\n" + "".join(f"{rel}\t{samples}\n" for rel, _, samples in entries))
    return {"manifest": str(manifest), "seconds": [e[1] for e in entries], "samples": [e[2] for e in entries],
            "distinct_files": len(base)}


def save_model(folder: Path, model: str, seed: int = 0) -> dict:
    """A random Wav2Vec2BertModel of `model`'s config saved with save_pretrained; returns its config."""
    import torch
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    torch.manual_seed(seed)
    Wav2Vec2BertModel(Wav2Vec2BertConfig(**MODELS[model])).eval().save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


# ---- the child: one run of one tool from one tree, timed from inside


class EnoughWork(BaseException):
    """--work_seconds of steady state are behind the run: it stops here (not an error)."""


def tree_module(*names: str):
    """The first of `names` that the tree being run has: a module by its name in this tree, then in earlier ones
    (data/audio/ was data/ before the audio path had a room of its own)."""
    import importlib

    for name in names[:-1]:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not name.startswith(e.name or "\0"):
                raise
    return importlib.import_module(names[-1])


def child(spec_path: str) -> int:
    """Run spec['mode'] (extract or tokenize) from spec['repo'] with the commits timed and the w2v-BERT passes
    recorded; with spec['model'], replay the steady-state passes on the same module; write spec['result']."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["mode"] == "loop":
        return stock_loop(spec)
    repo = spec["repo"]
    sys.path.insert(0, repo)
    os.chdir(repo)
    import importlib

    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from data import resumable_shard

    extract = importlib.import_module("tools.extract")
    tool = importlib.import_module(f"tools.{spec['mode']}")
    device = torch.device(spec["device"])
    if spec["mode"] == "tokenize":
        spec["argv"] += ["--checkpoint", make_codec(spec, extract)]

    commits, passes, modules = [], [], []
    main_thread = threading.main_thread()
    # each pass is tagged with the window it computes (the shard's `done` once that window is committed), not with
    # the commits made so far: the writer thread commits a window while the next one's passes run
    windows_class = tree_module("data.audio.pipeline", "data.audio_pipeline").FeatureWindows
    compute, computing = windows_class._compute, threading.local()

    # --profile_tool N: N windows after the timed steady state, the tool itself under torch.profiler (started and
    # stopped on the model's thread, which the writer's commits ask to)
    tool_profile = {"from": None, "profiler": None, "began": None, "wall": None}

    def start_tool_profile():
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        tool_profile["profiler"] = profiler(activities=activities)
        tool_profile["profiler"].start()
        tool_profile["began"] = time.perf_counter()

    def tagged_compute(self, window, *args, **kwargs):
        if tool_profile["from"] is not None and tool_profile["profiler"] is None:
            start_tool_profile()
        computing.end = window.end
        try:
            return compute(self, window, *args, **kwargs)
        finally:
            computing.end = None

    windows_class._compute = tagged_compute
    pipelines, snapshots = [], []  # the tool's FeatureWindows; its stages' seconds at each commit
    windows_init = windows_class.__init__

    def kept_init(self, *args, **kwargs):
        windows_init(self, *args, **kwargs)
        pipelines.append(self)

    windows_class.__init__ = kept_init

    def stop_here(*_):
        raise EnoughWork

    signal.signal(signal.SIGUSR2, stop_here)
    commit = resumable_shard.ShardWriter.commit

    def timed_commit(self, done):
        commit(self, done)  # what it commits was computed and copied back: no device sync needed
        commits.append((time.perf_counter(), done))
        snapshots.append(dict(getattr(pipelines[-1], "stages", {})) if pipelines else {})
        work, profiled = spec.get("work_seconds"), spec.get("profile_tool", 0)
        if tool_profile["from"] is None and work and len(commits) > 1 and commits[-1][0] - commits[0][0] >= work:
            tool_profile["from"] = len(commits)  # the timed steady state ends here
        if tool_profile["from"] is not None and len(commits) >= tool_profile["from"] + (
                profiled + 1 if profiled else 0):  # the first profiled window may have begun before the request
            if threading.current_thread() is main_thread:
                raise EnoughWork
            signal.pthread_kill(main_thread.ident, signal.SIGUSR2)  # a writer thread's commit: stop the tool

    resumable_shard.ShardWriter.commit = timed_commit
    layer_class = (getattr(tool, "W2vBertLayer", None)
                   or tree_module("data.audio.features", "data.audio_features").W2vBertLayer)
    init = layer_class.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)

        def record(module, call_args, call_kwargs):
            if not getattr(computing, "graphing", False):  # graph mode: its passes are recorded as replayed
                passes.append((getattr(computing, "end", None), call_args, call_kwargs))

        self.model.register_forward_pre_hook(record, with_kwargs=True)
        modules.append(self.model)

    layer_class.__init__ = recording_init
    try:  # graph mode (this tree's --graphs on): a pass is a replay, the model's calls are warm-ups and captures
        graphs_class = tree_module("data.audio.w2v_graphs", "data.w2v_graphs").GraphedPasses
    except ImportError:
        graphs_class = None
    if graphs_class is not None:
        graphed_call = graphs_class.__call__

        def recorded_call(self, x, mask):
            passes.append((getattr(computing, "end", None), (), {"input_features": x, "attention_mask": mask}))
            computing.graphing = True
            try:
                return graphed_call(self, x, mask)
            finally:
                computing.graphing = False

        graphs_class.__call__ = recorded_call
    import logging

    warnings = []  # the tool's warnings (a kernel given up, say), for the result

    class Recorder(logging.Handler):
        def emit(self, record):
            warnings.append(f"{record.name}: {record.getMessage()}"[:2000])

    logging.getLogger().addHandler(Recorder(logging.WARNING))
    began = time.perf_counter()
    stopped = False
    try:
        code = tool.main(spec["argv"])
    except EnoughWork:
        code, stopped = 0, True
    tool_summary = None
    if tool_profile["profiler"] is not None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tool_profile["profiler"].stop()
        wall = time.perf_counter() - tool_profile["began"]
        tool_summary = {**profile_summary(tool_profile["profiler"].key_averages(), device.type == "cuda", wall,
                                          passes=len(commits) - tool_profile["from"]),
                        "host_syncs": host_sync_calls(tool_profile["profiler"].key_averages())}
    if tool_profile["from"] is not None:  # the figures are the timed steady state's, before any profiling
        commits, snapshots = commits[: tool_profile["from"]], snapshots[: tool_profile["from"]]
    result = {"rc": code, "stopped": stopped, "seconds_total": time.perf_counter() - began,
              "commits": [(t - began, done) for t, done in commits],
              "passes": [(end, *pass_shape(a, kw)) for end, a, kw in passes], "warnings": warnings}
    if len(commits) > 1:  # the tool's own account of the steady state (tools/audio_shard.py time_account)
        steady = commits[-1][0] - commits[0][0]
        result["stages"] = {name: (seconds - snapshots[0].get(name, 0.0)) / steady
                            for name, seconds in snapshots[-1].items()} if steady > 0 else {}
    if tool_summary is not None:
        result["tool_profile"] = tool_summary
    if spec.get("model") and modules and code == 0 and len(commits) > 1:
        result["model"] = replay(modules[0], [(a, kw) for end, a, kw in passes
                                              if steady_window(end, commits[0][1], commits[-1][1])], device,
                                 spec.get("profile", 0))
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


LOOP_ROWS, LOOP_SECONDS = 64, 10.0  # the stock loop's fixed batches: about the tools' 600-s passes on a GPU
LOOP_WARMUP = 3  # passes before the clock starts


def stock_loop(spec: dict) -> int:
    """The user's alternative (module doc, `loop`): transformers' model as loaded, truncated to spec['layer'], run
    on fixed [LOOP_ROWS, LOOP_SECONDS] batches already on the device until spec['work_seconds'] (default 10 s) of
    timed passes; writes the seconds and the passes."""
    import torch
    from transformers import Wav2Vec2BertModel

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec["precision"]]
    model = Wav2Vec2BertModel.from_pretrained(spec["checkpoint"], local_files_only=True)
    model.encoder.layers = model.encoder.layers[: spec["layer"]]
    model = model.to(device, dtype).eval()
    torch.manual_seed(0)
    rows = spec.get("rows", LOOP_ROWS)
    x = torch.randn(rows, int(LOOP_SECONDS * FRAME_RATE), 160, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    work = spec.get("work_seconds") or 10.0
    with torch.inference_mode():
        for _ in range(LOOP_WARMUP):
            model(input_features=x, output_hidden_states=True).hidden_states[spec["layer"]]
        sync()
        began, passes = time.perf_counter(), 0
        while passes == 0 or time.perf_counter() - began < work:
            model(input_features=x, output_hidden_states=True).hidden_states[spec["layer"]]
            passes += 1
            if passes % 8 == 0 or device.type != "cuda":
                sync()
        sync()
        seconds = time.perf_counter() - began
    Path(spec["result"]).write_text(json.dumps({"rc": 0, "seconds": seconds, "passes": passes, "rows": rows,
                                                "frames": int(LOOP_SECONDS * FRAME_RATE)}))
    return 0


def loop_figures(result: dict, cfg: dict, layers: int, peak: float | None) -> dict:
    """The stock loop's audio s/s, GFLOP/s and MFU (its inputs are all audio: no padding)."""
    audio = result["passes"] * result["rows"] * LOOP_SECONDS
    flops = result["passes"] * result["rows"] * encoder_flops(cfg, layers, [result["frames"]])
    out = {"audio_s_per_s": audio / result["seconds"], "gflop_per_s": flops / result["seconds"] / 1e9,
           "seconds": result["seconds"], "passes": result["passes"], "rows": result["rows"],
           "input_seconds": LOOP_SECONDS}
    if peak:
        out["mfu"] = flops / result["seconds"] / (peak * 1e12)
    return out


def steady_window(end: int | None, first_done: int, last_done: int) -> bool:
    """Whether a pass of the window ending at file `end` is steady-state work: a window committed after the first
    commit (`first_done` files done), up to the last (`last_done`), the audio the figures count."""
    return end is not None and first_done < end <= last_done


def pass_shape(args, kwargs) -> tuple[int, int, list[int]]:
    """(rows, padded frames, each row's real frames) of one forward call of the w2v-BERT model."""
    x = kwargs.get("input_features", args[0] if args else None)
    rows, frames = int(x.shape[0]), int(x.shape[1])
    mask = kwargs.get("attention_mask")
    real = mask.sum(dim=1).tolist() if mask is not None else [frames] * rows
    return rows, frames, [int(n) for n in real]


def replay(module, calls: list, device, profile: int = 0) -> dict | None:
    """The model alone: `calls` (args, kwargs) made again on `module`, inputs as the pipeline left them on the
    device; the first untimed (warm-up), the others timed; then, with `profile`, that many of them again under
    torch.profiler (`profile_summary`)."""
    import torch

    if not calls:
        return None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        module(*calls[0][0], **calls[0][1])
        sync()
        began = time.perf_counter()
        for args, kwargs in calls:
            module(*args, **kwargs)
        sync()
        out = {"seconds": time.perf_counter() - began, "passes": len(calls)}
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profiler(activities=activities) as prof:
                began = time.perf_counter()
                for args, kwargs in calls[:profile]:
                    module(*args, **kwargs)
                sync()
                wall = time.perf_counter() - began
            out["profile"] = profile_summary(prof.key_averages(), device.type == "cuda", wall,
                                             len(calls[:profile]))
    return out


# what a kernel (on a GPU) or an aten op (on a CPU) of the w2v-BERT forward is, by its name; the first match wins
KERNEL_KINDS = (
    ("attention", r"flex|attention|attn|fmha|flash|softmax"),
    ("matmul", r"gemm|xmma|cutlass|cublas|nvjet|matmul|aten::mm$|aten::bmm$|aten::addmm$|aten::baddbmm$"),
    ("convolution", r"conv|depthwise|cudnn"),
    ("normalization", r"norm"),
    ("copy", r"copy|memcpy|memset|aten::cat$|aten::contiguous$|aten::clone$|transpose|permute"),
)


def kernel_kind(name: str) -> str:
    import re

    low = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, low)), "other")


def profile_summary(events, on_gpu: bool, wall: float, passes: int, top: int = 15) -> dict:
    """Where the model alone's time goes, from torch.profiler's averages: on a GPU the kernels' own device time
    (their sum against the wall clock: the share the device was busy, the rest the host's), on a CPU the ops'
    own CPU time; by kind (KERNEL_KINDS) and the `top` largest."""
    from torch.autograd import DeviceType

    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    # on a GPU the kernels (and copies) alone: an op on the host counts its kernels' device time as its own too
    rows = [(e.key, int(e.count), getattr(e, key) / 1e6) for e in events
            if getattr(e, key) > 0 and (e.device_type != DeviceType.CPU) == on_gpu]
    busy = sum(seconds for _, _, seconds in rows)
    kinds: dict[str, float] = {}
    for name, _, seconds in rows:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + seconds
    rows.sort(key=lambda r: -r[2])
    return {"passes": passes, "wall_s": wall, "busy_s": busy, "busy_share": busy / wall if wall else None,
            "time": "device (kernels)" if on_gpu else "CPU (ops)",
            "kinds": {k: round(v / busy, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])} if busy else {},
            "top": [{"name": name[:160], "calls": calls, "seconds": round(seconds, 6),
                     "share": round(seconds / busy, 4), "kind": kernel_kind(name)}
                    for name, calls, seconds in rows[:top]]}


# the CUDA runtime calls by which the host waits for the device (torch.profiler's names for them)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def host_sync_calls(events) -> dict[str, int]:
    """How often the host waited for the device, by runtime call (none on a CPU); a plain cudaMemcpy (not Async)
    waits for the copy and everything queued before it."""
    counts = {}
    for e in events:
        name = e.key if e.key.endswith(" ") else e.key + " "
        if any(name.startswith(call) for call in SYNC_CALLS):
            counts[e.key] = counts.get(e.key, 0) + int(e.count)
    return counts


def make_codec(spec: dict, extract) -> str:
    """An untrained default-sized codec recording the features of a short extraction of the first files by this
    tree (so that tools.tokenize computes those features)."""
    import torch

    from data.feature_settings import dump_feature_settings
    from models.codec import CodecConfig, RVQCodec

    scratch = Path(spec["scratch"])
    lines = Path(spec["argv"][0]).read_text().split("\n")
    short = scratch / "short.tsv"
    short.write_text("\n".join(lines[:3]) + "\n")
    flags = [a for a in spec["extract_flags"] if a != "--overwrite"]
    if extract.main([short, "train", 1, 0, scratch / "short_feats", *flags]) != 0:
        raise SystemExit("the short extraction for the codec failed")
    settings = dump_feature_settings(scratch / "short_feats", "train")
    torch.manual_seed(0)
    codec = RVQCodec(CodecConfig(feature_dim=int(settings["dim"]), kmeans_init=False))
    path = scratch / "codec.pt"
    torch.save({"model": codec.state_dict(), "codec": codec.config.to_dict(), "step": 0,
                "config": {"features": settings}}, path)
    return str(path)


# ---- the parent: corpora, runs side by side, figures


def run_child(spec: dict, timeout: float) -> dict:
    """One child process from spec['repo']; its result, or {'error': ...}."""
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_", dir=spec.get("scratch_root")) as scratch:
        spec = {**spec, "scratch": scratch, "result": str(Path(scratch) / "result.json")}
        if "argv" in spec:
            spec["argv"] = [str(a) for a in spec["argv"]] + ["--overwrite"]
            spec["argv"][4] = str(Path(scratch) / "out")
        Path(spec["result"] + ".spec").write_text(json.dumps(spec))
        paths = [spec["repo"], *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
        if spec.get("threads"):
            env.update(OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
        try:
            job = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec["result"] + ".spec"],
                                 cwd=spec["repo"], env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        result_path = Path(spec["result"])
        if job.returncode or not result_path.is_file():
            return {"error": f"exit {job.returncode}: {job.stderr[-3000:]}"}
        result = json.loads(result_path.read_text())
        if result["rc"]:
            return {"error": f"{spec['mode']} exit {result['rc']}: {job.stderr[-3000:]}"}
        return result


def figures(result: dict, corpus: dict, cfg: dict, layers: int, max_chunk: int, peak: float | None) -> dict:
    """Steady-state audio s/s, GFLOP/s and MFU of the run (and of the model alone), padding of its passes."""
    commits = result["commits"]
    if len(commits) < 2:
        return {"error": f"{len(commits)} commit(s): too few windows for a steady state (lower --commit_seconds)"}
    (t0, done0), (t1, done1) = commits[0], commits[-1]
    seconds = t1 - t0
    audio = float(sum(corpus["seconds"][done0:done1]))
    steady = [lengths for end, _, _, lengths in result["passes"] if steady_window(end, done0, done1)]
    if steady:
        lengths = [n for row in steady for n in row]
    else:  # no pass seen (the model was called some other way): chunks from the files' lengths
        lengths = [n for s in corpus["samples"][done0:done1] for n in chunk_lengths(file_frames(s), max_chunk)]
    flops = encoder_flops(cfg, layers, lengths)
    padded = sum(rows * frames for _, rows, frames, _ in result["passes"])
    real = sum(sum(lengths) for *_, lengths in result["passes"])
    out = {"audio_s_per_s": audio / seconds, "gflop_per_s": flops / seconds / 1e9, "steady_audio_s": audio,
           "steady_s": seconds, "startup_s": t0, "commits": len(commits), "stopped_early": result["stopped"],
           "passes": len(result["passes"]), "padding": padded / real - 1 if real else None,
           "warnings": result.get("warnings", []),
           "stages": result.get("stages", {}),  # each stage's share of the steady state (FeatureWindows.stages)
           **({"tool_profile": result["tool_profile"]} if "tool_profile" in result else {}),
           "gflop_per_audio_s": flops / audio / 1e9 if audio else None}
    if peak:
        out["mfu"] = flops / seconds / (peak * 1e12)
    model = result.get("model")
    if model:
        out["model"] = {"audio_s_per_s": audio / model["seconds"], "gflop_per_s": flops / model["seconds"] / 1e9,
                        "seconds": model["seconds"], "passes": model["passes"],
                        "pipeline_share": model["seconds"] / seconds}
        if peak:
            out["model"]["mfu"] = flops / model["seconds"] / (peak * 1e12)
        if model.get("profile"):
            out["model"]["profile"] = model["profile"]
    return out


def parse_repos(values: list[str] | None) -> dict[str, str]:
    """--repo PATH or LABEL=PATH (repeatable) -> {label: absolute path}; default: this tree."""
    repos = {}
    for value in values or [str(HERE)]:
        label, _, path = value.rpartition("=") if "=" in value else (None, None, value)
        path = str(Path(path).resolve())
        label = label or ("this tree" if path == str(HERE) else path)
        repos[label] = path
    return repos


def run_benchmark(*, device: str = "cpu", model: str = "small", layer: int | None = None, precision: str | None = None,
                  mixes=("5s", "30s", "2-20s"), modes=("extract", "model"), audio_minutes: float = 10.0,
                  base_minutes: float = 10.0, repeats: int = 3, repos: dict[str, str] | None = None,
                  work_seconds: float | None = None, commit_seconds: float | None = None,
                  batch_seconds: float | None = None, num_workers: int | None = None, threads: int | None = None,
                  peak: float | None = None, scratch_root: str | None = None, timeout: float = 1800,
                  tool_flags: dict[str, list[str]] | None = None, label_modes: dict[str, list[str]] | None = None,
                  profile: int = 0, profile_tool: int = 0, loop_rows: int = LOOP_ROWS, out: Path | None = None,
                  say=print) -> dict:
    """Every (repo, mix, mode) run `repeats` times, taking turns; each keeps its fastest steady state. Returns
    the figures, also written to `out` after every run (a run cut short keeps what it measured). tool_flags: more
    flags for the tools of a repo's label (e.g. two labels of one tree with --compile on and off); label_modes:
    a label's own modes instead of `modes` (e.g. an earlier tree's extraction alone); profile: that many passes
    of the model alone profiled after it is timed (`profile_summary`); profile_tool: that many windows of each tool
    run profiled after its timed steady state (with --work_seconds: the run then goes on for them), the host's waits
    for the device counted (`host_sync_calls`); `loop` among the modes: the stock loop once a round (its fastest
    kept), over batches of `loop_rows`."""
    import torch

    from benchmarks.demo_run import machine

    layer = layer if layer is not None else DEFAULT_LAYER[model]
    precision = precision or ("bf16" if device.startswith("cuda") else "fp32")
    threads = threads if threads is not None else (1 if device == "cpu" else None)
    if commit_seconds is None and device == "cpu":
        commit_seconds = 120.0  # several windows in minutes of audio; a GPU keeps the tools' default
    if num_workers is None and device == "cpu":
        num_workers = 0
    repos = repos or parse_repos(None)
    device_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision]
    peak = peak or (peak_tflops(device_name, dtype) if device.startswith("cuda") else None)
    info = {"machine": machine(), "device": device_name, "torch": torch.__version__, "model": model,
            "layer": layer, "precision": precision, "threads": threads, "num_workers": num_workers,
            "commit_seconds": commit_seconds, "batch_seconds": batch_seconds, "work_seconds": work_seconds,
            "audio_minutes": audio_minutes, "repeats": repeats, "peak_tflops": peak, "repos": repos,
            "tool_flags": tool_flags or {}, "label_modes": label_modes or {}, "profile": profile,
            "profile_tool": profile_tool,
            "load_average_before": [round(x, 2) for x in os.getloadavg()], "mixes": {}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_", dir=scratch_root) as tmp:
        tmp = Path(tmp)
        cfg = save_model(tmp / "w2v", model)
        info["config"] = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "intermediate_size", "position_embeddings_type",
                                              "left_max_position_embeddings", "right_max_position_embeddings",
                                              "conv_depthwise_kernel_size", "feature_projection_input_dim")}
        info["gflop_per_audio_s"] = {f"{s} s chunks": round(flops_per_audio_second(cfg, layer, s) / 1e9, 2)
                                     for s in (5, 30)}
        max_chunk = 30 * FRAME_RATE
        corpora = {}
        for mix in mixes:
            corpora[mix] = write_mix(tmp / "audio", mix, audio_minutes, base_minutes)
            info["mixes"][mix] = {"what": MIXES[mix][0], "files": len(corpora[mix]["seconds"]),
                                  "distinct_files": corpora[mix]["distinct_files"],
                                  "audio_s": round(sum(corpora[mix]["seconds"]), 1)}
        common = ["--device", device]
        for flag, value in (("--num_workers", num_workers), ("--commit_seconds", commit_seconds),
                            ("--batch_seconds", batch_seconds)):
            if value is not None:
                common += [flag, value]
        extract_flags = ["--feature", "w2v-bert", "--checkpoint", tmp / "w2v", "--layer", layer,
                         "--precision", precision, *common]
        best: dict[tuple, dict] = {}
        for r in range(repeats):
            if "loop" in modes:
                result = run_child({"mode": "loop", "repo": str(HERE), "device": device, "threads": threads,
                                    "precision": precision, "checkpoint": str(tmp / "w2v"), "layer": layer,
                                    "work_seconds": work_seconds, "rows": loop_rows,
                                    "scratch_root": scratch_root}, timeout)
                row = result if "error" in result else loop_figures(result, cfg, layer, peak)
                say(f"  round {r + 1}: the stock loop: " + (row["error"][-1500:] if "error" in row else
                                                            f"{row['audio_s_per_s']:,.1f} audio s/s"))
                if "stock_loop" not in info or "error" in info["stock_loop"] or (
                        "error" not in row and row["audio_s_per_s"] > info["stock_loop"]["audio_s_per_s"]):
                    info["stock_loop"] = rounded(row)
            for mix in mixes:
                for label, repo in repos.items():
                    wanted = (label_modes or {}).get(label, modes)
                    for mode in [m for m in ("extract", "tokenize") if m in wanted or (m == "extract" and
                                                                                      "model" in wanted)]:
                        argv = [corpora[mix]["manifest"], "train", 1, 0, "OUT",
                                *(extract_flags if mode == "extract" else common), *(tool_flags or {}).get(label, [])]
                        spec = {"repo": repo, "mode": mode, "argv": argv, "device": device, "threads": threads,
                                "work_seconds": work_seconds, "model": mode == "extract" and "model" in wanted,
                                "profile": profile, "profile_tool": profile_tool,
                                "extract_flags": [str(a) for a in extract_flags], "scratch_root": scratch_root}
                        result = run_child(spec, timeout)
                        row = result if "error" in result else figures(result, corpora[mix], cfg, layer, max_chunk,
                                                                       peak)
                        key = (label, mix, mode)
                        if "error" in row:
                            say(f"  round {r + 1}: {label} {mix} {mode}: {row['error'][-1500:]}")
                        else:
                            say(f"  round {r + 1}: {label} {mix} {mode}: {row['audio_s_per_s']:,.1f} audio s/s"
                                + (f", model alone {row['model']['audio_s_per_s']:,.1f}" if "model" in row else ""))
                        if key not in best or "error" in best[key] or (
                                "error" not in row and row["audio_s_per_s"] > best[key]["audio_s_per_s"]):
                            best[key] = row
                            info["runs"].setdefault(label, {}).setdefault(mix, {})[mode] = rounded(row)
                            info["ratios"] = ratios(info)
                            if out is not None:
                                write_json(out, info)
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return info


def write_json(path: Path, info: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1) + "\n")


def rounded(row):
    if isinstance(row, dict):
        return {k: rounded(v) for k, v in row.items()}
    if isinstance(row, float):
        return round(row, 4 if abs(row) < 10 else 1)
    return row


def ratios(info: dict) -> dict:
    """Per tree: extract's audio s/s on each mix over that on 5-s files (the issue's 30 s / 5 s and 2-20 s / 5 s)."""
    out = {}
    for label, mixes in info["runs"].items():
        base = mixes.get("5s", {}).get("extract", {}).get("audio_s_per_s")
        if base and len(mixes) > 1:
            out[label] = {f"{mix} / 5s": round(m["extract"]["audio_s_per_s"] / base, 3) for mix, m in mixes.items()
                          if mix != "5s" and "audio_s_per_s" in m.get("extract", {})}
    return out


def table(info: dict) -> str:
    mfu = info["peak_tflops"] is not None

    def speed(row):
        if not row or "error" in row:
            return "error" if row else "-", "-"
        flops = f"{row['mfu']:.1%}" if mfu else f"{row['gflop_per_s']:,.1f}"
        return f"{row['audio_s_per_s']:,.1f}", flops

    unit = "MFU" if mfu else "GFLOP/s"
    lines = [(f"| tree | mix | extract audio s/s | extract {unit} | tokenize audio s/s | tokenize {unit} | "
              f"model alone audio s/s | model alone {unit} | extract / model alone | padding | start-up (extract, "
              "tokenize) |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, mixes in info["runs"].items():
        for mix, modes in mixes.items():
            ex, tok = modes.get("extract"), modes.get("tokenize")
            model = (ex or {}).get("model")
            padding = (ex or tok or {}).get("padding")
            lines.append(f"| {label} | {mix} | {' | '.join(speed(ex))} | {' | '.join(speed(tok))} | "
                         f"{' | '.join(speed(model))} | "
                         f"{format(model['pipeline_share'], '.0%') if model else '-'} | "
                         f"{format(padding, '.1%') if padding is not None else '-'} | "
                         + ", ".join(f"{row['startup_s']:.1f} s" if row and "startup_s" in row else "-"
                                     for row in (ex, tok)) + " |")
    loop = info.get("stock_loop")
    if loop:
        what = (f"transformers' module in a plain loop over fixed batches of {loop.get('rows')} x "
                f"{loop.get('input_seconds', LOOP_SECONDS):g} s on the device")
        lines += ["", f"| the user's alternative | audio s/s | {unit} |", "|---|---:|---:|",
                  f"| {what} | {' | '.join(speed(loop))} |"]
    if info.get("ratios"):
        lines += ["", "| tree | extract audio s/s against 5-s files |", "|---|---|"]
        lines += [f"| {label} | {', '.join(f'{k}: {v:.2f}x' for k, v in r.items())} |"
                  for label, r in info["ratios"].items()]
    return "\n".join(lines)


def tool_figures(info: dict, key: str):
    """(label, mix, mode, figure) of each tool run of `info` that has the figure `key`."""
    for label, mixes in info["runs"].items():
        for mix, modes in mixes.items():
            for mode in ("extract", "tokenize"):
                figure = (modes.get(mode) or {}).get(key)
                if figure:
                    yield label, mix, mode, figure


def stages_table(info: dict) -> str:
    """Per run of a tool, where its steady state went: the shares of the model's thread and of the writer's
    (data/audio/pipeline.py STAGES, WRITER_STAGES)."""
    return "\n".join(f"- {label} {mix} {mode}: " + ", ".join(
        f"{name} {share:.0%}" for name, share in stages.items() if share >= 0.005)
        for label, mix, mode, stages in tool_figures(info, "stages"))


def profile_line(prof: dict) -> str:
    """A profile (profile_summary) in a line: the busy share, the time by kind, the largest."""
    busy = f", busy {prof['busy_share']:.0%} of the wall clock" if prof["busy_share"] is not None else ""
    kinds = ", ".join(f"{kind} {share:.0%}" for kind, share in prof["kinds"].items())
    return (f"{prof['time']} time{busy}: {kinds}; the largest: "
            + "; ".join(f"{t['name'][:70]} {t['share']:.0%}" for t in prof["top"][:4]))


def profile_table(info: dict) -> str:
    """The tools' profiles (--profile_tool), then the model alone's (--profile): per tree and mix, the busy share and
    the time by kind (and the tools' waits for the device)."""
    lines = []
    for label, mix, mode, prof in tool_figures(info, "tool_profile"):
        syncs = ", ".join(f"{name.strip()} x{n}" for name, n in prof["host_syncs"].items()) or "none"
        lines.append(f"- {label} {mix}, {mode} itself, {prof['passes']} window(s) profiled, {profile_line(prof)}; "
                     f"the host waited for the device: {syncs}")
    for label, mix, _, model in tool_figures(info, "model"):  # extract's replay of its passes
        prof = model.get("profile")
        if prof:
            passes = f"{prof['passes']} pass{'es' if prof['passes'] != 1 else ''}"
            lines.append(f"- {label} {mix}, the model alone, {passes} profiled, {profile_line(prof)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--model", choices=tuple(MODELS), default="small",
                   help="random weights: small (4 layers of 256) or w2v-bert-2.0 (24 layers of 1024)")
    p.add_argument("--layer", type=int, help="default: 4 for small, 17 for w2v-bert-2.0")
    p.add_argument("--mixes", default="5s,30s,2-20s", help=f"comma-separated, of {', '.join(MIXES)}")
    p.add_argument("--modes", default="extract,model",
                   help="comma-separated, of extract, model, tokenize, loop (the stock loop, once a round)")
    p.add_argument("--loop_rows", type=int, default=LOOP_ROWS, help="the stock loop's inputs per batch")
    p.add_argument("--audio_minutes", type=float, default=10.0, help="audio listed per mix")
    p.add_argument("--base_minutes", type=float, default=10.0,
                   help="distinct audio per mix; the manifest lists it again up to --audio_minutes")
    p.add_argument("--repeats", type=int, default=3, help="rounds of runs, the fastest of each kept")
    p.add_argument("--repo", action="append",
                   help="PATH or LABEL=PATH of a tree to run the tools from (repeatable; default: this tree)")
    p.add_argument("--work_seconds", type=float, help="stop each run after this much steady-state work")
    p.add_argument("--commit_seconds", type=float,
                   help="the tools' --commit_seconds (default: 120 on a CPU, so that minutes of audio make several "
                        "windows; the tools' own on a GPU)")
    p.add_argument("--batch_seconds", type=float, help="the tools' --batch_seconds (default: theirs)")
    p.add_argument("--num_workers", type=int, help="the tools' --num_workers (default: 0 on a CPU, theirs on a GPU)")
    p.add_argument("--threads", type=int, help="torch threads in the tools (default: 1 on a CPU)")
    p.add_argument("--peak_tflops", type=float, help="the device's peak for MFU (default: PEAK_TFLOPS for known GPUs)")
    p.add_argument("--scratch", help="folder for the corpus and the outputs (default: the system's temporary one)")
    p.add_argument("--tool_flags", action="append", metavar="LABEL=FLAGS",
                   help="more flags for the tools of --repo LABEL, e.g. 'compiled=--compile on' (repeatable)")
    p.add_argument("--label_modes", action="append", metavar="LABEL=MODES",
                   help="--modes for the tree of --repo LABEL alone, e.g. 'before=extract,model' (repeatable)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N passes of the model alone after timing it: where its time goes, by kind of "
                        "kernel (on a GPU, with the share the device was busy)")
    p.add_argument("--profile_tool", type=int, default=0, metavar="N",
                   help="with --work_seconds: N windows of each tool run profiled after its timed steady state (the "
                        "tool itself: the device's busy share, the kernels by kind, the host's waits for the device)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results" / "bench_tokenize.json")
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    sys.path.insert(0, str(HERE))
    repos = parse_repos(args.repo)
    tool_flags = {}
    for value in args.tool_flags or []:
        label, _, flags = value.partition("=")
        if label not in repos:
            p.error(f"--tool_flags {value!r}: no --repo is labelled {label!r} (labels: {', '.join(repos)})")
        tool_flags[label] = shlex.split(flags)
    label_modes = {}
    for value in args.label_modes or []:
        label, _, modes = value.partition("=")
        if label not in repos:
            p.error(f"--label_modes {value!r}: no --repo is labelled {label!r} (labels: {', '.join(repos)})")
        label_modes[label] = modes.split(",")
    info = run_benchmark(device=args.device, model=args.model, layer=args.layer, precision=args.precision,
                         mixes=args.mixes.split(","), modes=args.modes.split(","), audio_minutes=args.audio_minutes,
                         base_minutes=args.base_minutes, repeats=args.repeats, repos=repos, tool_flags=tool_flags,
                         label_modes=label_modes,
                         work_seconds=args.work_seconds, commit_seconds=args.commit_seconds,
                         batch_seconds=args.batch_seconds, num_workers=args.num_workers, threads=args.threads,
                         peak=args.peak_tflops, scratch_root=args.scratch, timeout=args.timeout,
                         profile=args.profile, profile_tool=args.profile_tool, loop_rows=args.loop_rows,
                         out=args.out)
    print(f"\n{info['machine']}; {info['device']}, {info['model']} w2v-BERT to layer {info['layer']}, "
          f"{info['precision']}, torch threads {info['threads']}, --num_workers {info['num_workers']}; "
          f"{info['gflop_per_audio_s']} GFLOP per audio second\n")
    print(table(info))
    stages = stages_table(info)
    if stages:
        print("\nwhere the tools' steady state went (the model's thread, then the writer's):\n" + stages)
    profiles = profile_table(info)
    if profiles:
        print("\n" + profiles)
    write_json(args.out, info)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
