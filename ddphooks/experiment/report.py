"""``ddphooks report``: figures and a summary table from experiment run files.

Run files are read as JSON lines only (no pickle, no eval). A truncated last line, as left by a
run killed mid-write, is skipped with a warning; any other malformed line is an error that names
the file and line. The figures need matplotlib (``pip install 'ddphooks[plot]'``); without it they
are skipped with a warning and the summaries are still written.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

SIGNALS = (
    ("loss_mean", "global mean loss"),
    ("loss_std", "loss dispersion (std over ranks)"),
    ("grad_norm_std", "grad-norm dispersion (std over ranks)"),
    ("mean_cosine", "mean inter-rank cosine (sketched)"),
)
TABLE_KEYS = ("loss_mean", "loss_std", "loss_range", "grad_norm_std", "grad_norm_cv", "mean_cosine", "weighted_mean_cosine")
NUMBER_KEYS = TABLE_KEYS + ("loss_cv", "grad_norm_mean")


class Run:
    """One run file: its header and its per-step records."""

    def __init__(self, path: Path, header: dict, records: list[dict]) -> None:
        self.path = path
        self.header = header
        self.records = records

    @property
    def name(self) -> str:
        setting = self.header.get("setting") or self.path.stem
        world = self.header.get("world_size") or (self.records[0]["world_size"] if self.records else "?")
        return f"{setting} x{world}"

    @property
    def fault_step(self) -> int | None:
        step = self.header.get("fault_step")
        return step if isinstance(step, int) else None


def _check_record(path: Path, number: int, record: object) -> dict:
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError(f"{path}:{number}: expected a step record (an object with an integer 'step')")
    for key in NUMBER_KEYS:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{path}:{number}: '{key}' must be a number or null, got {value!r}")
    for key in ("losses", "grad_norms", "cosine_to_others"):
        values = record.get(key)
        if values is not None and not (isinstance(values, list) and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values)):
            raise ValueError(f"{path}:{number}: '{key}' must be a list of numbers (or nulls), or null")
    cosine = record.get("cosine")
    if cosine is not None and not (isinstance(cosine, list) and all(isinstance(row, list) for row in cosine)):
        raise ValueError(f"{path}:{number}: 'cosine' must be a list of rows or null")
    return record


def read_run(path: str | Path) -> Run:
    """Parse a run file written by ``ddphooks experiment`` (or any JsonlSink)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); a run file is JSON lines, as written by ddphooks experiment or a JsonlSink") from None
    while lines and not lines[-1].strip():
        lines.pop()
    header: dict = {}
    records: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: skipping a truncated last line (the run was probably interrupted)", stacklevel=2)
                break
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if isinstance(obj, dict) and "header" in obj and not records:
            if not isinstance(obj["header"], dict):
                raise ValueError(f"{path}:{number}: 'header' must be an object")
            header = obj["header"]
            continue
        records.append(_check_record(path, number, obj))
    if not records:
        raise ValueError(f"{path}: no step records")
    return Run(path, header, records)


def _values(run: Run, key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in run.records:
        value = record.get(key)
        steps.append(record["step"])
        values.append(math.nan if value is None else float(value))
    return steps, values


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def summary_rows(run: Run, skip: float) -> list[dict]:
    """Mean of each signal over the run after the first ``skip`` fraction of steps; fault runs
    get separate rows before and after the fault."""
    last = run.records[-1]["step"]
    start = int(skip * (last + 1))
    spans = [("all", lambda step: step >= start)]
    if run.fault_step is not None:
        spans = [("before fault", lambda step: start <= step < run.fault_step), ("after fault", lambda step: step >= run.fault_step)]
    rows = []
    for label, keep in spans:
        chosen = [r for r in run.records if keep(r["step"])]
        row = {"run": run.name, "steps": label, "n": len(chosen)}
        for key in TABLE_KEYS:
            row[key] = _mean([math.nan if r.get(key) is None else float(r[key]) for r in chosen])
        rows.append(row)
    return rows


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps, ignoring missing values."""
    smoothed = []
    for i in range(len(values)):
        smoothed.append(_mean(values[max(0, i - window + 1) : i + 1]))
    return smoothed


def _cosine_to_others(record: dict, rank: int, world: int) -> float:
    """A rank's mean sketched cosine to the others: the record's ``cosine_to_others`` (every
    record since 0.2), else the row of its cosine matrix (detail records, older run files)."""
    per_rank = record.get("cosine_to_others")
    if isinstance(per_rank, list) and per_rank[rank] is not None:
        return float(per_rank[rank])
    matrix = record.get("cosine")
    if not matrix or world < 2 or any(matrix[rank][j] is None for j in range(world)):
        return math.nan
    return sum(matrix[rank][j] for j in range(world) if j != rank) / (world - 1)


def rank_rows(run: Run, skip: float) -> list[dict]:
    """Per rank: how far its loss sits from the step's mean, its gradient norm relative to the
    mean norm, and its mean cosine to the other ranks (after the fault, in fault runs). The rank
    that stands out is the one to look at."""
    last = run.records[-1]["step"]
    start = run.fault_step if run.fault_step is not None else int(skip * (last + 1))
    chosen = [r for r in run.records if r["step"] >= start and isinstance(r.get("grad_norms"), list)]
    world = len(chosen[0]["grad_norms"]) if chosen else 0
    rows = []
    for rank in range(world):
        loss_gap = [r["losses"][rank] - r["loss_mean"] for r in chosen if r.get("losses") and r["losses"][rank] is not None and r.get("loss_mean") is not None]
        norm_ratio = [r["grad_norms"][rank] / r["grad_norm_mean"] for r in chosen if r["grad_norms"][rank] is not None and r.get("grad_norm_mean")]
        cosines = [_cosine_to_others(r, rank, world) for r in chosen]
        rows.append({"run": run.name, "rank": rank, "loss_minus_mean": _mean(loss_gap), "norm_over_mean": _mean(norm_ratio), "cosine_to_others": _mean(cosines)})
    return rows


def _pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_signals(plt, runs: list[Run], out: Path, window: int) -> Path:
    figure, axes = plt.subplots(len(SIGNALS), 1, figsize=(9, 2.2 * len(SIGNALS) + 0.8), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (key, title) in zip(axes, SIGNALS):
        low, high = math.inf, -math.inf
        for index, run in enumerate(runs):
            color = colors[index % len(colors)]
            steps, values = _values(run, key)
            smoothed = _smooth(values, window)
            axis.plot(steps, values, color=color, lw=0.6, alpha=0.18)
            axis.plot(steps, smoothed, color=color, lw=1.8, label=run.name)
            finite = [v for v in smoothed[window:] if math.isfinite(v)] or [v for v in smoothed if math.isfinite(v)]
            if finite:
                low, high = min(low, min(finite)), max(high, max(finite))
            if run.fault_step is not None:
                axis.axvline(run.fault_step, color=color, ls=":", lw=1.2)
        if math.isfinite(low) and high > low:
            margin = 0.15 * (high - low)
            axis.set_ylim(low - margin, high + margin)  # raw values may leave the frame; the trend may not
        axis.set_ylabel(title, fontsize=8)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel(f"step (thick: mean of the last {window} steps; faint: every step; dotted: fault)")
    figure.suptitle("Global mean loss (top) and the worker-level signals of silent inconsistency (below)", fontsize=10, y=0.99)
    figure.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=min(len(runs), 4), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.92))
    path = out / "signals.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def _plot_cosines(plt, run: Run, out: Path, count: int, window: int) -> Path | None:
    """Rank x rank cosine matrices, each averaged over ``window`` steps ending at a chosen step
    (single steps are noisy). Fault runs show the window before the fault and windows after it."""
    import numpy as np

    with_cosine = [r for r in run.records if r.get("cosine")]
    if not with_cosine:
        return None
    steps = [r["step"] for r in with_cosine]
    if run.fault_step is not None and steps[0] < run.fault_step <= steps[-1]:
        ends = [run.fault_step - 1] + [steps[round(i * (len(steps) - 1) / max(count - 1, 1))] for i in range(1, count)]
        ends = [e for e in ends if e < run.fault_step] + [e for e in ends if e >= run.fault_step + window - 1] or ends
    else:
        ends = [steps[round(i * (len(steps) - 1) / max(count - 1, 1))] for i in range(count)]
    ends = sorted(set(ends))
    figure, axes = plt.subplots(1, len(ends), figsize=(2.7 * len(ends) + 0.8, 2.8), squeeze=False)
    for axis, end in zip(axes[0], ends):
        chosen = [r for r in with_cosine if end - window < r["step"] <= end]
        matrices = np.array([[[np.nan if v is None else v for v in row] for row in r["cosine"]] for r in chosen], dtype=float)
        image = axis.imshow(np.nanmean(matrices, axis=0), vmin=-1, vmax=1, cmap="RdBu_r")
        axis.set_title(f"steps {chosen[0]['step']}-{end}", fontsize=9)
        size = matrices.shape[1]
        axis.set_xticks(range(size))
        axis.set_yticks(range(size))
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fault = f", fault from step {run.fault_step}" if run.fault_step is not None else ""
    figure.suptitle(f"rank x rank gradient cosine (mean over each window), {run.name}{fault}", fontsize=9)
    path = out / f"cosine-{run.name.replace(' ', '-')}.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def _fmt(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.4f}"


def write_report(paths: list[str], out: str | Path, skip: float = 0.1, heatmaps: int = 3, window: int | None = None) -> Path:
    """Figures (PNG), ``summary.md`` and ``summary.json`` for the given run files.

    Args:
        paths: run files (JSON lines: an optional header line, then one record per step).
        out: folder for the outputs, created if missing (only once every run file has been read).
        skip: fraction of each run's first steps left out of the table means, in [0, 1).
        heatmaps: cosine heatmaps per run (0: none).
        window: steps in the trend lines and heatmap means (None: a 25th of the longest run).

    Returns the path of ``summary.md``. Without matplotlib the figures are skipped with a
    ``UserWarning`` naming the ``plot`` extra; the summaries are written all the same.

    Raises ``ValueError`` for a bad setting or a malformed run file, ``OSError`` for an unreadable one.

    Example::

        write_report(["runs/run-sync-w2.jsonl", "runs/run-fault-w2.jsonl"], "report")
    """
    if not 0 <= skip < 1:
        raise ValueError(f"--skip {skip} must be in [0, 1): the fraction of each run's first steps left out of the means")
    if heatmaps < 0:
        raise ValueError(f"--heatmaps {heatmaps} must be >= 0 (0: no heatmaps)")
    if window is not None and window < 1:
        raise ValueError(f"--window {window} must be >= 1 (or left out for a 25th of the run)")
    runs = [read_run(path) for path in paths]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    window = window or max(1, max(len(run.records) for run in runs) // 25)
    figures: list[Path] = []
    try:
        plt = _pyplot()
    except ImportError as error:
        skipped = f"matplotlib could not be imported ({error}); pip install 'ddphooks[plot]' to get them"
        warnings.warn(f"figures skipped: {skipped} (summary.md and summary.json are written)", stacklevel=2)
    else:
        skipped = ""
        figures.append(_plot_signals(plt, runs, out, window))
        if heatmaps:
            figures += [f for f in (_plot_cosines(plt, run, out, heatmaps, window) for run in runs) if f is not None]
    rows = [row for run in runs for row in summary_rows(run, skip)]
    lines = [
        "# ddphooks experiment report",
        "",
        f"Means over steps (the first {skip:.0%} of each run skipped; fault runs split at the fault step).",
        "",
        "| run | steps | n | " + " | ".join(TABLE_KEYS) + " |",
        "|---|---|---|" + "---|" * len(TABLE_KEYS),
    ]
    lines += [f"| {r['run']} | {r['steps']} | {r['n']} | " + " | ".join(_fmt(r[k]) for k in TABLE_KEYS) + " |" for r in rows]
    lines += [
        "",
        "## Per rank",
        "",
        "Means over the same steps (fault runs: from the fault on): loss minus the step's mean loss, gradient norm over the",
        "step's mean norm, and mean sketched cosine to the other ranks.",
        "",
        "| run | rank | loss - mean | norm / mean | cosine to others |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['run']} | {r['rank']} | {_fmt(r['loss_minus_mean'])} | {_fmt(r['norm_over_mean'])} | {_fmt(r['cosine_to_others'])} |"
        for run in runs
        for r in rank_rows(run, skip)
    ]
    lines += ["", "## Runs", ""]
    for run in runs:
        config = run.header.get("config", {})
        lines.append(
            f"- `{run.path.name}`: {run.name}, {len(run.records)} steps, model `{config.get('model', '?')}`, data `{config.get('data', '?')}`, "
            f"{run.header.get('parameters', '?')} parameters"
        )
    lines += ["", "## Figures", ""] + ([f"![{f.stem}]({f.name})" for f in figures] or [f"Skipped: {skipped}."])
    summary = out / "summary.md"
    summary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(rows, indent=1, allow_nan=True), encoding="utf-8")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run files (run-<setting>-w<W>.jsonl)")
    parser.add_argument("-o", "--out", required=True, help="folder for the figures and summary.md")
    parser.add_argument("--skip", type=float, default=0.1, help="fraction of initial steps left out of the table means")
    parser.add_argument("--heatmaps", type=int, default=3, help="cosine heatmaps per run (first, ..., last step)")
    parser.add_argument("--window", type=int, default=None, help="steps in the trend lines (default: a 25th of the run)")


def main(args: argparse.Namespace) -> int:
    summary = write_report(args.runs, args.out, args.skip, args.heatmaps, args.window)
    print(summary.read_text())
    print(f"report written to {summary.parent}")
    return 0
