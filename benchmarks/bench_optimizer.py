"""What --optimizer costs a training step: the optimizer's step (training/optimizer.py build_optimizer, as the
trainer builds it) beside the forward and backward of the same codec, on this machine's CPU or GPU.

For each codec (the defaults at 50 Hz, and 25 Hz: `--downsample 2`) and the trainer's default batch on the device
(data/training_data.py DEFAULT_BATCH crops of AUTO_LENGTHS[0], 128 frames), one forward and backward gives the
gradients; then the forward and backward, the AdamW step and the Muon step are timed in turns, `--repeats` rounds of
`--steps` calls each, and the median of the rounds is kept. The share is the optimizer's time over a whole step
(forward, backward and that optimizer). Each optimizer's step is also counted as the host issues it
(benchmarks/host_syncs.py's dispatch counter): its ops, those of them that move data (on a GPU each a kernel
launch; the rest are views) and its host syncs, the same on any device.

    python benchmarks/bench_optimizer.py --threads 2 --out benchmarks/results/bench_optimizer.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import command_line, machine  # noqa: E402
from benchmarks.host_syncs import count_host_syncs  # noqa: E402
from data.training_data import AUTO_LENGTHS, DEFAULT_BATCH  # noqa: E402
from models.codec import CodecConfig, RVQCodec  # noqa: E402
from training.optimizer import OPTIMIZERS, build_optimizer  # noqa: E402

CODECS = {"50 Hz x 8 (defaults)": {}, "25 Hz x 8": {"downsample": 2}}


def timed(fn, steps: int, device: torch.device) -> float:
    """Seconds per call of `fn`, over `steps` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def bench_codec(name: str, flags: dict, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=160, kmeans_init=False, **flags)).to(device)
    x = torch.randn(args.crops, args.frames, 160, device=device)
    params = list(model.parameters())

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(x).loss.backward()

    forward_backward()
    grads = [p.grad.clone() for p in params]
    optimizers = {name: build_optimizer(name, params, lr=1e-6, weight_decay=0.0, device=device)
                  for name in OPTIMIZERS}

    def stepper(optimizer):
        def step():
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
        return step

    calls = {"forward and backward": forward_backward, **{o: stepper(opt) for o, opt in optimizers.items()}}
    for fn in calls.values():  # warm-up: the first call of each allocates its state
        fn()
    counted = {}
    for o in OPTIMIZERS:
        with count_host_syncs(count_ops=True) as counter:
            calls[o]()
        counted[o] = (sum(counter.ops_by_owner.values()), counter.data_ops, counter.total)
    rounds = {k: [] for k in calls}
    for _ in range(args.repeats):  # in turns, so that a busy neighbour weighs on each alike
        for key, fn in calls.items():
            rounds[key].append(timed(fn, args.steps, device))
    ms = {k: round(1e3 * statistics.median(v), 2) for k, v in rounds.items()}
    row = {"codec": name, "forward_backward_ms": ms["forward and backward"]}
    for o in OPTIMIZERS:
        row[f"{o}_step_ms"] = ms[o]
        row[f"{o}_share_of_step"] = round(ms[o] / (ms["forward and backward"] + ms[o]), 3)
        row[f"{o}_ops_per_step"], row[f"{o}_ops_moving_data_per_step"], row[f"{o}_host_syncs_per_step"] = counted[o]
    row["muon_step_time_vs_adamw"] = round((ms["forward and backward"] + ms["muon"])
                                           / (ms["forward and backward"] + ms["adamw"]), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--crops", type=int, default=None, help="crops a step (default: the trainer's on the device)")
    parser.add_argument("--frames", type=int, default=AUTO_LENGTHS[0], help="frames a crop")
    parser.add_argument("--steps", type=int, default=10, help="calls per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the median is kept")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.crops = args.crops or DEFAULT_BATCH[device.type]
    rows = [bench_codec(name, flags, args, device) for name, flags in CODECS.items()]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        report = {"machine": machine(), "threads": torch.get_num_threads(), "device": str(device),
                  "batch": f"{args.crops} x {args.frames} frames", "command": command_line(), "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"written {args.out}")


if __name__ == "__main__":
    main()
