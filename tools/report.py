"""A training run's report: plots and a markdown summary from its metrics.jsonl.

    python -m tools.report RUN_DIR [--out DIR]

Reads RUN_DIR/metrics.jsonl (and config.json when present) and writes, into
RUN_DIR/report/ unless --out says otherwise:

- loss.png: train loss, reconstruction and commitment terms, and the learning rate, over steps;
- eval.png: held-out relative MSE and cosine similarity over steps: the evals during training on fixed
  windows, the final eval on whole utterances (as tools.encode's codes give them), each labelled;
- codes.png: code usage and perplexity of each level over steps;
- speed.png: training frames per second (all ranks) over steps;
- phones.png, when final evals carry phone measures (the run's held-out split had its `{split}.phn`): PNMI,
  phone purity and cluster purity per level, a line per final eval;
- report.md: the numbers that matter, the command that gives the run's configuration, and the plots.

A resumed run logs the steps after its last checkpoint twice; the later line
wins. Lines that are not an event (not JSON, as a run killed mid-write leaves,
or with no finite whole step) are counted and skipped; a field that is not a
number where one is plotted counts as missing. A folder name that is not UTF-8
is shown with its undecodable bytes replaced.
Needs matplotlib (`pip install -r requirements-report.txt`). Exit codes: 0 done, 2 no
metrics.jsonl or nothing in it, or matplotlib missing.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import statistics
from pathlib import Path

from data.dump_writer import output_folder
from errors import EXIT_OK, BadInputError
from tools.cli import bad_input_exits_2, run
from training.config import command_line
from training.flag_help import FlagHelpFormatter
from training.metrics_log import read_metrics
from training.run_folder import RunFolder

log = logging.getLogger("report")

PLOTS = ("loss.png", "eval.png", "codes.png", "speed.png")  # always written
PHONE_PLOT = "phones.png"  # written when an eval carries phone measures
PHONE_MEASURES = (("pnmi", "PNMI", "I(phone; code) / H(phone)"),
                  ("phone_purity", "phone purity", "share of frames: their code's top phone"),
                  ("cluster_purity", "cluster purity", "share of frames: their phone's top code"))


def read_events(path: Path) -> tuple[dict[str, list[dict]], int]:
    """Events by kind, each sorted by step with one record per step (the last written); and the bad line count."""
    events, bad = read_metrics(path)
    by_kind: dict[str, dict[int, dict]] = {}
    for record in events:
        by_kind.setdefault(record["event"], {})[record["step"]] = record  # a resumed run re-logs steps: the last wins
    return {k: [v[s] for s in sorted(v)] for k, v in by_kind.items()}, bad


def number(value) -> float:
    """A plottable float; None (how metrics.jsonl writes NaN and Inf), non-numbers and infinities become NaN."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return math.nan
    try:
        value = float(value)
    except OverflowError:  # an integer past float's range
        return math.nan
    return value if math.isfinite(value) else math.nan


def shown(path: Path) -> str:
    """A path as text that can be written and drawn: undecodable bytes of its name replaced."""
    return os.fsencode(path).decode("utf-8", "replace")


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in rows if key in r]
    return [r["step"] for r in rows], [number(r[key]) for r in rows]


def per_level(rows: list[dict], key: str) -> tuple[list[int], list[list[float]]]:
    """Steps and, for each level, its value at each step (NaN where a record lacks that level)."""
    rows = [r for r in rows if isinstance(r.get(key), list)]
    levels = max((len(r[key]) for r in rows), default=0)
    values = [[number(r[key][q]) if q < len(r[key]) else math.nan for r in rows] for q in range(levels)]
    return [r["step"] for r in rows], values


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _finite(values) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _empty(text: str, *axes) -> None:
    """Each panel of `axes` says `text` in its middle, with no ticks."""
    for ax in axes:
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])


def _save(plt, fig, path: Path, title: str | None = None) -> None:
    """Grid every panel, title the figure when asked, write the PNG and free the figure."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mark_events(ax, events: dict) -> None:
    """Skipped steps and failed evals as thin vertical lines, so a spike can be read against them."""
    for kind, color in (("skipped_step", "tab:red"), ("eval_failed", "tab:orange")):
        for k, r in enumerate(events.get(kind, [])):
            ax.axvline(r["step"], color=color, lw=0.8, ls=":", label=kind.replace("_", " ") if k == 0 else None)


def plot_loss(plt, events: dict, path: Path, title: str) -> None:
    train = events.get("train", [])
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    if train:
        for key, style in (("loss", "-"), ("recon", "--"), ("commit", ":")):  # commit before its --commitment_weight
            steps, values = series(train, key)
            if _finite(values):
                ax.plot(steps, values, style, lw=1.4, label=key)
        if all(v > 0 for v in _finite(series(train, "loss")[1] + series(train, "recon")[1])):
            ax.set_yscale("log")
        _mark_events(ax, events)
        ax.legend(loc="upper right")
        steps, lr = series(train, "lr")
        ax_lr.plot(steps, lr, color="tab:gray", lw=1.2)
        ax_lr.set_ylabel("learning rate")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    else:
        _empty("no train events", ax)
    ax.set_ylabel("train loss (standardised features)")
    ax.set_title(f"{title}: training loss")
    ax_lr.set_xlabel("step")
    _save(plt, fig, path)


def is_final(record: dict) -> bool:
    """An eval of whole utterances (the final eval), not of windows (the evals during training)."""
    return record.get("scored") == "whole utterances"


def plot_eval(plt, events: dict, path: Path, title: str) -> None:
    evals = events.get("eval", [])
    fig, (ax, ax_cos) = plt.subplots(1, 2, figsize=(11, 4.2))
    if evals:
        windows, finals = [r for r in evals if not is_final(r)], [r for r in evals if is_final(r)]
        label = f"held-out {windows[-1].get('scored', 'windows')}" if windows else None
        for records, style, name in ((windows, "o-", label), (finals, "*", "whole utterances (final eval)")):
            if records:
                ax.plot(*series(records, "rel_mse"), style, color="tab:blue", ms=4 if style == "o-" else 11,
                        label=name)
                ax_cos.plot(*series(records, "cosine"), style, color="tab:green", ms=4 if style == "o-" else 11,
                            label=name)
        if all(v > 0 for v in _finite(series(evals, "rel_mse")[1])):
            ax.set_yscale("log")
        _mark_events(ax, events)
        ax.legend(fontsize=8)
    else:
        _empty("no eval events", ax, ax_cos)
    ax.set(title="held-out relative MSE (lower is better)", xlabel="step", ylabel="sum|x - x̂|² / sum|x - mean|²")
    ax_cos.set(title="held-out cosine similarity", xlabel="step", ylabel="mean cosine(x, x̂)")
    _save(plt, fig, path, title)


def plot_codes(plt, events: dict, path: Path, title: str, codebook_size: int | None) -> None:
    evals = events.get("eval", [])
    fig, (ax_use, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4.2))
    steps, usage = per_level(evals, "code_usage")
    ppl_steps, perplexity = per_level(evals, "perplexity")  # the steps of each: a record may lack either
    if usage:
        colors = plt.get_cmap("viridis")([q / max(1, len(usage) - 1) * 0.9 for q in range(len(usage))])
        for q, values in enumerate(usage):
            ax_use.plot(steps, values, "o-", ms=3, color=colors[q], label=f"level {q}")
        for q, values in enumerate(perplexity):
            ax_ppl.plot(ppl_steps, values, "o-", ms=3, color=colors[q % len(colors)], label=f"level {q}")
        if codebook_size:
            ax_ppl.axhline(codebook_size, color="0.5", ls="--", lw=1, label=f"codebook size {codebook_size}")
        ax_use.set_ylim(0, 1.02)
        ax_ppl.set_ylim(bottom=0)
        ax_ppl.legend(fontsize=8, ncol=2 if len(usage) > 4 else 1, loc="lower right")
    else:
        _empty("no eval events", ax_use, ax_ppl)
    ax_use.set(title="code usage per level (share of codes used)", xlabel="step", ylabel="share of codebook")
    ax_ppl.set(title="perplexity per level (uniform use = codebook size)", xlabel="step", ylabel="perplexity")
    _save(plt, fig, path, title)


def phone_evals(events: dict) -> list[dict]:
    """The evals that carry phone measures (the final evals of a run whose held-out split has its .phn)."""
    return [r for r in events.get("eval", []) if isinstance(r.get("pnmi"), list) and r["pnmi"]]


def plot_phones(plt, events: dict, path: Path, title: str) -> None:
    """PNMI and the purities against the level (1: the first), one line per eval that carries them."""
    evals = phone_evals(events)
    fig, axes = plt.subplots(1, len(PHONE_MEASURES), figsize=(13, 4.2))
    colors = plt.get_cmap("plasma")([k / max(1, len(evals) - 1) * 0.8 for k in range(len(evals))])
    for ax, (key, name, meaning) in zip(axes, PHONE_MEASURES):
        for record, color in zip(evals, colors):
            values = [number(v) for v in _list(record.get(key))]
            ax.plot(range(1, len(values) + 1), values, "o-", ms=5, color=color,
                    label=f"step {record['step']} ({record.get('phones', '?')} phones)")
        levels = max((len(_list(r.get(key))) for r in evals), default=1)
        ax.set_xticks(range(1, levels + 1))
        ax.set_ylim(0, 1.02)
        ax.set(title=f"{name} per level", xlabel="level (1: the first)", ylabel=meaning)
    axes[0].legend(fontsize=8)
    _save(plt, fig, path, f"{title}: phone information of each level alone (final eval)")


def plot_speed(plt, events: dict, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    steps, fps = series(events.get("train", []), "frames_per_sec")
    if _finite(fps):
        ax.plot(steps, fps, color="tab:purple", lw=1.2)
        ax.axhline(statistics.median(_finite(fps)), color="0.5", ls="--", lw=1,
                   label=f"median {statistics.median(_finite(fps)):,.0f}")
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right")
    else:
        _empty("no frames_per_sec in train events", ax)
    ax.set(title=f"{title}: training speed", xlabel="step", ylabel="frames / s (all ranks)")
    _save(plt, fig, path)


def summary(run_dir: Path, events: dict, bad_lines: int, config: dict) -> str:
    train, evals = events.get("train", []), events.get("eval", [])
    stops, ckpts = events.get("stop", []), events.get("checkpoint", [])
    last_step = max((records[-1]["step"] for records in events.values() if records), default=0)
    ending = f"stopped: {stops[-1].get('reason')}" if stops else "no stop event: running, or killed"
    rows = [("last step", f"{last_step} ({ending})")]
    if train:
        losses = _finite(series(train, "loss")[1])
        if losses:
            rows.append(("train loss", f"{_fmt(losses[0])} at first log, {_fmt(losses[-1])} at last, "
                                       f"min {_fmt(min(losses))}"))
        fps = _finite(series(train, "frames_per_sec")[1])
        if fps:
            rows.append(("frames / s (all ranks)", f"median {statistics.median(fps):,.0f}, last {fps[-1]:,.0f}"))
    windows = [r for r in evals if not is_final(r)]
    if windows:
        first, last = windows[0], windows[-1]
        rel = [(number(r.get("rel_mse")), r["step"]) for r in windows if math.isfinite(number(r.get("rel_mse")))]
        best = min(rel) if rel else (math.nan, None)
        rows.append((f"eval rel_mse, {last.get('scored', 'windows')} (during training)",
                     f"{_fmt(number(first.get('rel_mse')))} at step {first['step']} -> "
                     f"{_fmt(number(last.get('rel_mse')))} at step {last['step']} (best {_fmt(best[0])} at "
                     f"step {best[1]})"))
    finals = [r for r in evals if is_final(r)]
    if finals:
        final = finals[-1]
        rows.append((f"final eval rel_mse, whole utterances (codes as tools.encode gives them, beam "
                     f"{final.get('beam_size', '?')})", f"{_fmt(number(final.get('rel_mse')))} at step {final['step']}"))
    if evals:
        last = evals[-1]
        rows += [
            ("eval cosine (last)", _fmt(number(last.get("cosine")))),
            ("bits per frame", _fmt(last.get("bits_per_frame"))),
            ("code usage per level (last)", ", ".join(_fmt(number(v), 3) for v in _list(last.get("code_usage")))),
            ("perplexity per level (last)", ", ".join(_fmt(number(v), 4) for v in _list(last.get("perplexity")))),
        ]
    else:
        rows.append(("eval", "no eval events yet"))
    phones = phone_evals(events)
    if phones:
        last = phones[-1]
        where = f"final eval at step {last['step']}, {last.get('phones', '?')} phones"
        rows += [(f"PNMI per level ({where})", ", ".join(_fmt(number(v), 3) for v in _list(last.get("pnmi")))),
                 ("phone purity per level (same)", ", ".join(_fmt(number(v), 3)
                                                             for v in _list(last.get("phone_purity")))),
                 ("cluster purity per level (same)", ", ".join(_fmt(number(v), 3)
                                                               for v in _list(last.get("cluster_purity"))))]
    rows.append(("checkpoints", f"{len(ckpts)}" + (f", last {ckpts[-1].get('path')}" if ckpts else "")))
    rows.append(("skipped steps (non-finite)", str(len(events.get("skipped_step", [])))))
    failed = events.get("eval_failed", [])
    rows.append(("failed evals", f"{len(failed)}" + (f" at steps {[r['step'] for r in failed]}" if failed else "")))
    if bad_lines:
        rows.append(("unreadable lines in metrics.jsonl", str(bad_lines)))
    lines = [f"# Training report: {shown(run_dir)}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if config:  # the flags that give this run's configuration (as given: the automatic ones chosen alike), to paste
        command = shlex.join(["python", "rvq_seamless_gpu_cache_nccl.py", *command_line(config)])
        lines += ["", "The run's configuration, as a command (in another --output_dir it trains the same run "
                      "afresh; in this one it resumes):", "", "```bash", command, "```"]
    lines += ["", "![training loss](loss.png)", "", "![held-out error](eval.png)", "",
              "![code usage and perplexity per level](codes.png)", "", "![training speed](speed.png)", ""]
    if phones:
        lines += [f"![PNMI and purities per level]({PHONE_PLOT})", ""]
    return "\n".join(lines)


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the plots and report.md; returns report.md's path."""
    folder = RunFolder(run_dir)
    metrics = folder.metrics
    if not metrics.is_file():
        raise BadInputError(f"{metrics} does not exist: give the --output_dir of a training run")
    events, bad = read_events(metrics)
    if not events:
        raise BadInputError(f"{metrics} holds no events ({bad} unreadable line(s)): nothing to report yet")
    try:
        import matplotlib
    except ImportError:
        raise BadInputError("the report needs matplotlib: pip install -r requirements-report.txt") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = {}
    if folder.config.is_file():
        try:
            config = json.loads(folder.config.read_text())
            if not isinstance(config, dict):
                raise ValueError("not an object")
        except ValueError:
            log.warning("%s/config.json is not JSON; the report leaves the flags out", run_dir)
    out_dir = out_dir or run_dir / "report"
    output_folder(out_dir, "--out")
    title = shown(Path(run_dir.resolve().name))
    plot_loss(plt, events, out_dir / "loss.png", title)
    plot_eval(plt, events, out_dir / "eval.png", title)
    plot_codes(plt, events, out_dir / "codes.png", title, config.get("codebook_size"))
    plot_speed(plt, events, out_dir / "speed.png", title)
    if phone_evals(events):
        plot_phones(plt, events, out_dir / PHONE_PLOT, title)
    report = out_dir / "report.md"
    # a path in an event may hold a name that is not UTF-8 too (JSON keeps it as a lone surrogate)
    report.write_text(summary(run_dir, events, bad, config), encoding="utf-8", errors="replace")
    if bad:
        log.warning("%d unreadable line(s) in %s were skipped", bad, metrics)
    return report


@bad_input_exits_2(log)
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.report", formatter_class=FlagHelpFormatter,
                                description="Plots and a markdown summary of a training run's metrics.jsonl.")
    p.add_argument("run_dir", type=Path, help="the trainer's --output_dir")
    p.add_argument("--out", type=Path, help="where to write (default: RUN_DIR/report)")
    args = p.parse_args(None if argv is None else [str(a) for a in argv])
    report = write_report(args.run_dir, args.out)
    plots = [*PLOTS, *([PHONE_PLOT] if "](phones.png)" in report.read_text(encoding="utf-8") else [])]
    log.info("wrote %s and %s in %s", report.name, ", ".join(plots), report.parent)
    return EXIT_OK


if __name__ == "__main__":
    run(main, "report")
