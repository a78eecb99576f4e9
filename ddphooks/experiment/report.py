"""``ddphooks report`` and ``ddphooks detect``: figures, summaries and alerts from experiment run files.

Run files are read as JSON lines only (no pickle, no eval). A truncated last line, as left by a
run killed mid-write, is skipped with a warning; any other malformed line is an error that names
the file and line. The figures need matplotlib (``pip install 'ddphooks[plot]'``); without it they
are skipped with a warning and the summaries are still written.

Runs of one setting and world size that differ only in their seed are treated as repeats: the
report gives the mean over seeds with a 95% confidence interval, and for the desynchronised
settings the difference to their synchronised baseline with the minimum detectable effect, so
"no effect" is a measured statement. The t distribution is computed here (regularised incomplete
beta by continued fraction, quantiles by bisection), so no scipy is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import warnings
from pathlib import Path

from ddphooks.identity import RankTable

SIGNALS = (
    ("loss_mean", "global mean loss"),
    ("loss_std", "loss dispersion (std over ranks)"),
    ("grad_norm_std", "grad-norm dispersion (std over ranks)"),
    ("mean_cosine", "mean inter-rank cosine (sketched)"),
)
TABLE_KEYS = ("loss_mean", "loss_std", "loss_range", "grad_norm_std", "grad_norm_cv", "mean_cosine", "weighted_mean_cosine")
NUMBER_KEYS = TABLE_KEYS + ("loss_cv", "grad_norm_mean")
#: (setting, its synchronised baseline): compared over seeds at the same world size.
COMPARISONS = (("desync-shuffle", "sync"), ("desync-all", "sync"), ("group-desync", "group-sync"))
#: Confidence of the intervals and power of the minimum detectable effect.
CONFIDENCE, POWER = 0.95, 0.80
#: Config fields that may differ between runs counted as seeds of one setting.
SEED_FREE_FIELDS = ("seed", "out", "progress", "device")


class Run:
    """One run file: its header and its per-step records."""

    def __init__(self, path: Path, header: dict, records: list[dict]) -> None:
        self.path = path
        self.header = header
        self.records = records
        self.label: str | None = None
        """Set by the report where two runs would otherwise share a name (the seed is added)."""

    @property
    def setting(self) -> str:
        """The setting, with the fault kind where it is not ``labels`` (``fault-sdc``)."""
        setting = self.header.get("setting") or self.path.stem
        kind = self.header.get("fault_kind")
        return f"{setting}-{kind}" if setting == "fault" and kind not in (None, "labels") else setting

    @property
    def world(self) -> int | str:
        return self.header.get("world_size") or (self.records[0].get("world_size") if self.records else None) or "?"

    @property
    def seed(self) -> int | None:
        seed = self.header.get("config", {}).get("seed")
        return seed if isinstance(seed, int) else None

    @property
    def name(self) -> str:
        return self.label or f"{self.setting} x{self.world}"

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
    for key in ("losses", "grad_norms", "cosine_to_others", "cosine_loo", "cosine_previous"):
        values = record.get(key)
        if values is not None and not (isinstance(values, list) and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values)):
            raise ValueError(f"{path}:{number}: '{key}' must be a list of numbers (or nulls), or null")
    cosine = record.get("cosine")
    if cosine is not None and not (isinstance(cosine, list) and all(isinstance(row, list) for row in cosine)):
        raise ValueError(f"{path}:{number}: 'cosine' must be a list of rows or null")
    hosts = record.get("cosine_hosts")
    if hosts is not None and not (isinstance(hosts, dict) and isinstance(hosts.get("hundredths"), list) and isinstance(hosts.get("hosts"), list)):
        raise ValueError(f"{path}:{number}: 'cosine_hosts' must be an object with 'hosts' and 'hundredths' lists, or null")
    alerts = record.get("alerts")
    if alerts is not None and not (isinstance(alerts, list) and all(isinstance(alert, dict) for alert in alerts)):
        raise ValueError(f"{path}:{number}: 'alerts' must be a list of objects or null")
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


# -- alerts ----------------------------------------------------------------------------------------
def recorded_alerts(run: Run) -> list[dict] | None:
    """The alerts the online detector wrote into the records during training (each with its
    record's ``step`` where it has none), or None when the records carry no ``alerts`` key (the
    run was made without the detector, or before it existed).

    Example::

        alerts = recorded_alerts(read_run("runs/run-fault-w2.jsonl")) or []
    """
    if not any("alerts" in record for record in run.records):
        return None
    return [{"step": record["step"], **alert} for record in run.records for alert in record.get("alerts") or []]


def detect_alerts(run: Run, config=None) -> list[dict]:
    """The alerts of ``ddphooks.detect`` run offline over the records (with ``config``, a
    ``DetectorConfig``; None: the defaults); ``ValueError`` naming the file where the records lack
    what the detector needs (e.g. sketches)."""
    from ddphooks.detect import detect_run

    try:
        return detect_run(run.records, config)
    except ValueError as error:
        raise ValueError(f"{run.path}: {error}") from None


def run_alerts(run: Run, offline: bool = False) -> tuple[list[dict], str]:
    """A run's alerts and where they come from: the records' own (``recorded``), else the offline
    detector (``detected offline``), else none (``not available: <why>``). With ``offline``, the
    detector runs even where the records carry alerts (a run made with older thresholds)."""
    recorded = None if offline else recorded_alerts(run)
    if recorded is not None:
        return recorded, "recorded during training"
    try:
        return detect_alerts(run), "detected offline"
    except ValueError as error:
        return [], f"not available ({str(error).removeprefix(f'{run.path}: ')})"


def _cell(value: object) -> str:
    """A table cell: one line, no column separator, ``-`` for a missing value."""
    return str(value).replace("|", "/").replace("\n", " ") if value is not None else "-"


def alert_table(alerts: list[dict], parameters: int = 2) -> list[str]:
    """Aligned text lines: one header and one line per alert (step, rank, kind, since, score,
    the ``parameters`` most suspicious parameters, message).

    Example::

        print("\n".join(alert_table(detect_run(read_run("run-fault-w2.jsonl").records))))
    """
    heads = ("step", "rank", "kind", "since", "score", "parameters", "message")
    rows = []
    for alert in alerts:
        score = alert.get("score")
        names = alert.get("parameters") or []
        top = ", ".join(names[:parameters]) + (f" (+{len(names) - parameters})" if len(names) > parameters else "")
        score_text = f"{score:.2f}" if isinstance(score, (int, float)) and math.isfinite(score) else "-"
        rows.append([_cell(alert.get(key)) for key in ("step", "rank", "kind", "since")] + [score_text, top or "-", _cell(alert.get("message"))])
    widths = [max([len(head)] + [len(row[i]) for row in rows]) for i, head in enumerate(heads)]
    right = {0, 1, 3, 4}  # numbers

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(heads)] + [line(row) for row in rows]


# -- statistics over seeds -------------------------------------------------------------------------
def _incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b), by its continued fraction (modified Lentz method,
    as in Numerical Recipes' ``betai``); accurate to ~1e-14 for the t distribution's arguments."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast only below this point
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)), -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * result


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (Welch's df need not be
    whole), by bisection on :func:`t_cdf` to 1e-12 relative; NaN for df not > 0.

    Example::

        >>> round(t_quantile(0.975, 2), 4)
        4.3027
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p} must be in (0, 1)")
    if not df > 0:
        return math.nan
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2.0 * high
    while high - low > 1e-12 * high:
        middle = 0.5 * (low + high)
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return 0.5 * (low + high)


def _sample(values: list[float]) -> tuple[int, float, float]:
    """n, mean and sample variance (ddof 1; NaN below 2) of the finite values."""
    finite = [v for v in values if math.isfinite(v)]
    n = len(finite)
    mean = sum(finite) / n if n else math.nan
    variance = sum((v - mean) ** 2 for v in finite) / (n - 1) if n >= 2 else math.nan
    return n, mean, variance


def seed_interval(values: list[float]) -> dict:
    """Mean over seeds of per-run means, its 95% t interval (n - 1 df) and the seed-to-seed sd.

    Example::

        >>> seed_interval([0.20, 0.22, 0.21])["half_width"]  # t_{0.975,2} * 0.01 / sqrt(3)
        0.0248...
    """
    n, mean, variance = _sample(values)
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * math.sqrt(variance / n) if n >= 2 else math.nan
    return {"n": n, "mean": mean, "sd": math.sqrt(variance) if n >= 2 else math.nan, "half_width": half, "ci_low": mean - half, "ci_high": mean + half}


def compare_seeds(values: list[float], baseline: list[float]) -> dict:
    """Difference of two groups of per-seed values (``values`` minus ``baseline``), Welch's t test
    and the minimum detectable effect at 95% confidence and 80% power.

    ``se = sqrt(s_a^2 / n_a + s_b^2 / n_b)``, Welch-Satterthwaite ``df``, ``MDE = (t_{0.975,df} +
    t_{0.80,df}) * se``: a true difference of that size would be declared significant (two-sided,
    5%) in 80% of repeats of the experiment with these many seeds and this seed-to-seed spread; an
    observed difference below it is "no effect larger than the MDE", not "no effect". Needs two
    seeds per group (NaN otherwise).

    Example::

        >>> result = compare_seeds([0.25, 0.28, 0.31], [0.20, 0.23, 0.26])
        >>> round(result["difference"], 3), round(result["df"], 1), round(result["mde"], 4)
        (0.05, 4.0, 0.0911)
    """
    n_a, mean_a, var_a = _sample(values)
    n_b, mean_b, var_b = _sample(baseline)
    result = {"n": n_a, "n_baseline": n_b, "difference": mean_a - mean_b}
    se = math.sqrt(var_a / n_a + var_b / n_b) if n_a >= 2 and n_b >= 2 else math.nan
    if se > 0:
        df = se**4 / ((var_a / n_a) ** 2 / (n_a - 1) + (var_b / n_b) ** 2 / (n_b - 1))
        t_confidence, t_power = t_quantile(0.5 + CONFIDENCE / 2, df), t_quantile(POWER, df)
        t = result["difference"] / se
        result.update(
            se=se, df=df, ci_low=result["difference"] - t_confidence * se, ci_high=result["difference"] + t_confidence * se,
            p_value=2.0 * (1.0 - t_cdf(abs(t), df)), mde=(t_confidence + t_power) * se,
        )  # fmt: skip
    else:  # fewer than two seeds on a side, or no spread at all: nothing to measure against
        result.update(se=se, df=math.nan, ci_low=math.nan, ci_high=math.nan, p_value=math.nan, mde=math.nan)
    return result


def seed_groups(runs: list[Run], skip: float) -> list[dict]:
    """Runs of the same setting and world size, as repeats over seeds: per span (fault runs:
    before and after the fault), each signal's per-run means and :func:`seed_interval` of them.
    ``differs`` lists config fields other than the seed that are not the same in every run.

    Example::

        groups = seed_groups([read_run(p) for p in paths], skip=0.1)
        groups[0]["signals"]["loss_std"]  # {"n": 3, "mean": ..., "ci_low": ..., "ci_high": ..., ...}
    """
    grouped: dict[tuple, list[Run]] = {}
    for run in runs:
        grouped.setdefault((run.setting, run.world), []).append(run)
    groups = []
    for (setting, world), members in grouped.items():
        configs = [run.header.get("config", {}) for run in members]
        fields = sorted({key for config in configs for key in config} - set(SEED_FREE_FIELDS))
        differs = [key for key in fields if len({json.dumps(config.get(key), sort_keys=True) for config in configs}) > 1]
        per_run = [summary_rows(run, skip) for run in members]
        for span in dict.fromkeys(row["steps"] for rows in per_run for row in rows):
            values = {key: [row[key] for rows in per_run for row in rows if row["steps"] == span] for key in TABLE_KEYS}
            groups.append({
                "setting": setting, "world_size": world, "steps": span, "runs": len(members), "seeds": [run.seed for run in members],
                "differs": differs, "values": values, "signals": {key: seed_interval(values[key]) for key in TABLE_KEYS},
            })  # fmt: skip
    return groups


def seed_comparisons(groups: list[dict]) -> list[dict]:
    """:func:`compare_seeds` of each setting of COMPARISONS against its baseline, per world size
    (the ``all`` span of :func:`seed_groups`' groups).

    Example::

        comparisons = seed_comparisons(seed_groups(runs, skip=0.1))
    """
    by_key = {(g["setting"], g["world_size"]): g for g in groups if g["steps"] == "all"}
    comparisons = []
    for setting, baseline in COMPARISONS:
        for (name, world), group in by_key.items():
            base = by_key.get((baseline, world))
            if name != setting or base is None:
                continue
            signals = {key: compare_seeds(group["values"][key], base["values"][key]) for key in TABLE_KEYS}
            comparisons.append({"setting": setting, "baseline": baseline, "world_size": world, "runs": group["runs"], "baseline_runs": base["runs"], "signals": signals})
    return comparisons


def _pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_signals(plt, runs: list[Run], out: Path, window: int, alerts: list[list[dict]]) -> Path:
    """One panel per signal, a line per run; ``alerts[i]`` (run i's) are triangles along the foot of
    the mean-cosine panel, in the run's colour, one per step with an alert."""
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
            steps_alerted = sorted({a["step"] for a in alerts[index] if isinstance(a.get("step"), int)})
            if key == "mean_cosine" and steps_alerted:
                # x in steps, y in axes units: the markers stay in view whatever the signal's range;
                # each run on its own row so that runs alerting at the same step stay apart.
                height = 0.05 + 0.07 * (index % 8)
                axis.scatter(steps_alerted, [height] * len(steps_alerted), transform=axis.get_xaxis_transform(), marker="^", s=28, color=color, zorder=3, clip_on=False)
        if math.isfinite(low) and high > low:
            margin = 0.15 * (high - low)
            axis.set_ylim(low - margin, high + margin)  # raw values may leave the frame; the trend may not
        axis.set_ylabel(title, fontsize=8)
        axis.grid(alpha=0.3)
    marked = "; triangles: alerts" if any(alerts) else ""
    axes[-1].set_xlabel(f"step (thick: mean of the last {window} steps; faint: every step; dotted: fault{marked})")
    figure.suptitle("Global mean loss (top) and the worker-level signals of silent inconsistency (below)", fontsize=10, y=0.99)
    figure.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=min(len(runs), 4), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.92))
    path = out / "signals.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


#: Up to this many ranks a rank-by-rank heatmap labels every rank; above it, the hosts.
RANK_TICKS = 16
#: Most tick labels on a heatmap axis (hosts beyond it: every n-th labelled).
MAX_TICK_LABELS = 32


def _hosts_by_rank(run: Run, world: int) -> list[str] | None:
    """Each rank's host from the run's identity table (the first record that carries one of
    ``world`` ranks), None where the records carry none."""
    for record in run.records:
        table = RankTable.from_record(record)
        if table is not None and len(table.identities) == world:
            return table.hosts()
    return None


def _host_order(hosts: list[str] | None, world: int) -> tuple[list[int], list[tuple[str, int, int]]]:
    """The ranks ordered by host (hosts in the order of their first rank, ranks in order within
    each) and the hosts' spans ``(host, first, end)`` along that order; one span without hosts."""
    if not hosts:
        return list(range(world)), [("", 0, world)]
    names = list(dict.fromkeys(hosts))
    order = sorted(range(world), key=lambda rank: (names.index(hosts[rank]), rank))
    spans, begin = [], 0
    for name in names:
        size = sum(1 for host in hosts if host == name)
        spans.append((name, begin, begin + size))
        begin += size
    return order, spans


def _label_axes(axis, labels: list[tuple[float, str]], spans: list[tuple[str, int, int]] | None, size: int) -> None:
    """Tick labels at ``labels`` (position, text), every n-th where there are too many to read,
    and thin lines between the hosts' ``spans``."""
    step = max(1, math.ceil(len(labels) / MAX_TICK_LABELS))
    shown = labels[::step]
    fontsize = 7 if len(shown) <= 16 else 5
    axis.set_xticks([p for p, _ in shown])
    axis.set_xticklabels([t for _, t in shown], rotation=90, fontsize=fontsize)
    axis.set_yticks([p for p, _ in shown])
    axis.set_yticklabels([t for _, t in shown], fontsize=fontsize)
    if spans and 1 < len(spans) <= 64:
        for _, begin, _ in spans[1:]:
            axis.axhline(begin - 0.5, color="black", lw=0.4, alpha=0.5)
            axis.axvline(begin - 0.5, color="black", lw=0.4, alpha=0.5)
    axis.set_xlim(-0.5, size - 0.5)
    axis.set_ylim(size - 0.5, -0.5)


def _cosine_matrices(run: Run) -> tuple[str, list[dict], list, list, list | None] | None:
    """The run's cosine matrices for the heatmaps: ``("rank", records, matrices, labels, spans)``
    with the W x W matrices ordered by host (the identity table's), or ``("host", ...)`` with the
    host-by-host ones (detail records above ``detail_max_world``); None where there are none."""
    import numpy as np

    from ddphooks.hosts import matrix_from_record

    with_cosine = [r for r in run.records if r.get("cosine")]
    if with_cosine:
        world = len(with_cosine[0]["cosine"])
        with_cosine = [r for r in with_cosine if len(r["cosine"]) == world]
        order, spans = _host_order(_hosts_by_rank(run, world), world)
        matrices = [np.array([[np.nan if v is None else v for v in row] for row in r["cosine"]], dtype=float)[np.ix_(order, order)] for r in with_cosine]
        if world <= RANK_TICKS:
            labels = [(i, str(rank)) for i, rank in enumerate(order)]
        elif len(spans) > 1:
            labels = [((begin + end - 1) / 2, name) for name, begin, end in spans]
        else:
            labels = [(i, str(rank)) for i, rank in enumerate(order) if i % math.ceil(world / RANK_TICKS) == 0]
        return "rank", with_cosine, matrices, labels, spans
    with_hosts = [r for r in run.records if isinstance(r.get("cosine_hosts"), dict)]
    if not with_hosts:
        return None
    names = with_hosts[-1]["cosine_hosts"]["hosts"]
    with_hosts = [r for r in with_hosts if r["cosine_hosts"]["hosts"] == names]
    matrices = [matrix_from_record(r["cosine_hosts"]) for r in with_hosts]
    return "host", with_hosts, matrices, list(enumerate(names)), None


def _plot_cosines(plt, run: Run, out: Path, count: int, window: int) -> Path | None:
    """Cosine matrices, each averaged over ``window`` steps ending at a chosen step (single steps
    are noisy). Fault runs show the window before the fault and windows after it. Rank by rank
    (up to ``detail_max_world`` ranks: the records' ``cosine``), the ranks ordered by host and
    labelled by host above 16 ranks; host by host above (``cosine_hosts``: the mean cosine
    between the ranks of each pair of hosts, the diagonal within a host)."""
    import numpy as np

    found = _cosine_matrices(run)
    if found is None:
        return None
    form, records, matrices, labels, spans = found
    steps = [r["step"] for r in records]
    if run.fault_step is not None and steps[0] < run.fault_step <= steps[-1]:
        ends = [run.fault_step - 1] + [steps[round(i * (len(steps) - 1) / max(count - 1, 1))] for i in range(1, count)]
        ends = [e for e in ends if e < run.fault_step] + [e for e in ends if e >= run.fault_step + window - 1] or ends
    else:
        ends = [steps[round(i * (len(steps) - 1) / max(count - 1, 1))] for i in range(count)]
    ends = sorted(set(ends))
    size = matrices[0].shape[0]
    panel = 2.7 if size <= RANK_TICKS else 5.0
    figure, axes = plt.subplots(1, len(ends), figsize=(panel * len(ends) + 0.8, panel + 0.3), squeeze=False)
    for axis, end in zip(axes[0], ends):
        chosen = [m for r, m in zip(records, matrices) if end - window < r["step"] <= end]
        first = next(r["step"] for r in records if end - window < r["step"] <= end)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a cell null on every step of the window
            mean = np.nanmean(np.array(chosen), axis=0)
        image = axis.imshow(mean, vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
        axis.set_title(f"steps {first}-{end}", fontsize=9)
        _label_axes(axis, labels, spans, size)
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fault = f", fault from step {run.fault_step}" if run.fault_step is not None else ""
    if form == "rank":
        by_host = " (ranks ordered by host)" if spans and len(spans) > 1 else ""
        title = f"rank x rank gradient cosine{by_host}\n(mean over each window) {run.name}{fault}"
    else:
        title = f"host x host gradient cosine, {size} hosts\n(mean over their ranks' pairs and each window)\n{run.name}{fault}"
    figure.suptitle(title, fontsize=9)
    path = out / f"cosine-{run.name.replace(' ', '-')}.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def _plot_alerted_parameter(plt, run: Run, alerts: list[dict], out: Path) -> Path | None:
    """The first alerted parameter's gradient norm per rank, step by step, with the fault (dotted)
    and the alert (solid, the named rank's colour): where a fault hit one layer, the run-wide
    signals barely move, and this is where it shows. None without such an alert, or without the
    per-parameter norms (detail records) of that parameter."""
    first = next((a for a in alerts if a.get("parameters") and isinstance(a.get("rank"), int) and isinstance(a.get("step"), int)), None)
    if first is None:
        return None
    name = first["parameters"][0]
    steps, norms = [], []
    for record in run.records:
        entry = next((p for p in record.get("parameters") or [] if p.get("name") == name and p.get("grad_norms")), None)
        if entry is not None:
            steps.append(record["step"])
            norms.append([math.nan if v is None else v for v in entry["grad_norms"]])
    if not steps:
        return None
    figure, axis = plt.subplots(figsize=(9, 3.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for rank in range(len(norms[0])):
        named = rank == first["rank"]
        axis.plot(steps, [row[rank] for row in norms], color=colors[rank % len(colors)], lw=1.8 if named else 0.9, label=f"rank {rank}" + (" (named)" if named else ""))
    if run.fault_step is not None:
        axis.axvline(run.fault_step, color="black", ls=":", lw=1.2, label=f"fault (step {run.fault_step})")
    axis.axvline(first["step"], color=colors[first["rank"] % len(colors)], lw=1.2, label=f"alert (step {first['step']}, {first.get('kind')})")
    axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.set_ylabel("local gradient norm", fontsize=8)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, ncol=4, loc="upper left")
    axis.set_title(f"{run.name}: gradient norm of {name}, the parameter the first alert named", fontsize=9)
    figure.tight_layout()
    path = out / f"alert-{run.name.replace(' ', '-')}.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def _fmt(value: float, digits: int = 4) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.{digits}f}"


def _label_runs(runs: list[Run]) -> None:
    """Give runs that would share a name (one setting, several seeds) their seed, or their file."""
    names: dict[str, list[Run]] = {}
    for run in runs:
        names.setdefault(run.name, []).append(run)
    for same in names.values():
        if len(same) > 1:
            seeds = [run.seed for run in same]
            for run in same:
                run.label = f"{run.name} seed {run.seed}" if len(set(seeds)) == len(seeds) else f"{run.name} ({run.path.stem})"


def _strict(value: object) -> object:
    """``value`` with non-finite floats as None, so summary.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _markdown_alerts(runs: list[Run], alerts: list[list[dict]], sources: list[str]) -> list[str]:
    lines = ["", "## Alerts", "", "Source per run: the records' own `alerts` (the detector ran during training) or `ddphooks.detect` run on the records now.", ""]
    lines += [f"- {run.name}: {len(found)} alert{'' if len(found) == 1 else 's'}, {source}" for run, found, source in zip(runs, alerts, sources)]
    rows = [(run, alert) for run, found in zip(runs, alerts) for alert in found]
    if rows:
        lines += ["", "| run | step | rank | global rank | host | device | kind | message |", "|---|---|---|---|---|---|---|---|"]
        lines += [
            f"| {run.name} | {_cell(a.get('step'))} | {_cell(a.get('rank'))} | {_cell(a.get('global_rank'))} | {_cell(a.get('host'))} | "
            f"{_cell(a.get('device'))} | {_cell(a.get('kind'))} | {_cell(a.get('message'))} |"
            for run, a in rows
        ]
    return lines


def _markdown_identities(runs: list[Run], most: int = 64) -> list[str]:
    """Where each rank of each run ran (the ``identity`` table its records carry), for the first
    ``most`` ranks of a run; nothing for runs whose records carry none (older ddphooks)."""
    lines = []
    for run in runs:
        table = next((t for record in run.records if (t := RankTable.from_record(record)) is not None), None)
        if table is None:
            continue
        shown = table.identities[:most]
        lines += ["", f"{run.name}: {len(table.identities)} ranks on {len({i.host for i in table.identities})} host(s)", ""]
        lines += ["| rank | global rank | host | local rank | pid | device | device UUID |", "|---|---|---|---|---|---|---|"]
        lines += [
            f"| {i.group_rank} | {i.global_rank} | {_cell(i.host)} | {_cell(i.local_rank)} | {i.pid} | {_cell(i.device)} | {_cell(i.device_uuid)} |"
            for i in shown
        ]
        if len(table.identities) > most:
            lines.append(f"| ... | {len(table.identities) - most} more ranks in the records' `identity` | | | | | |")
    return ["", "## Where the ranks ran", *lines] if lines else []


def glance_rows(runs: list[Run], alerts: list[list[dict]]) -> list[dict]:
    """Per run (healthy runs first), what a reader wants first: healthy or which fault, how many
    alerts, and for a fault run the first alert that names the faulty rank at or after the fault step (its step, the delay
    in steps, its kind and first parameter) with the parameter the fault hit where it was one; a
    fault not named says the best d' of the detector's scores and the delay bound it allows
    (``ddphooks.experiment.information``): whether any detector could have named it.

    Example::

        glance_rows([read_run("runs/run-fault-sdc-w2.jsonl")], [recorded_alerts(run)])
    """
    rows = []
    for run, found in zip(runs, alerts):
        fault_step = run.fault_step
        row = {"run": run.name, "fault": None, "alerts": len(found), "named_step": None, "delay": None, "kind": None, "parameter": None, "hit": None}
        if fault_step is None:
            row["verdict"] = "healthy: no alert" if not found else f"healthy: {len(found)} false alarm{'s' * (len(found) > 1)}"
            rows.append(row)
            continue
        rank = run.header.get("fault_rank", run.header.get("config", {}).get("fault_rank"))
        row["fault"] = f"{run.header.get('fault_kind') or 'labels'} on rank {rank} from step {fault_step}"
        row["hit"] = run.header.get("fault_parameter")
        named = [a for a in found if a.get("rank") == rank and isinstance(a.get("step"), int) and a["step"] >= fault_step]
        if named:
            first = min(named, key=lambda a: a["step"])
            row.update(named_step=first["step"], delay=first["step"] - fault_step, kind=first.get("kind"), parameter=(first.get("parameters") or [None])[0])
            row["verdict"] = f"named rank {rank} after {row['delay']} step{'s' * (row['delay'] != 1)}"
        else:
            # Whether any detector could have named it: the records' best d' and its delay bound.
            from .information import missed_reason, separation

            row["verdict"] = missed_reason(separation(run.records, fault_step, rank) if isinstance(rank, int) else None)
        rows.append(row)
    return sorted(rows, key=lambda row: row["fault"] is not None)  # healthy runs first, each group in the given order


def _markdown_glance(rows: list[dict]) -> list[str]:
    lines = [
        "## At a glance",
        "",
        "Each run, healthy or with an injected fault, and what the online detector said: for a fault run, the first alert",
        "naming the faulty rank, how many steps after the fault it came, and the parameter it named first.",
        "",
        "| run | injected fault | alerts | verdict | first alert on the faulty rank | parameter named (hit) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        alert = "-" if r["named_step"] is None else f"step {r['named_step']} ({r['kind']})"
        parameter = "-" if r["parameter"] is None and r["hit"] is None else f"{_cell(r['parameter'])}" + (f" ({r['hit']})" if r["hit"] else "")
        lines.append(f"| {r['run']} | {_cell(r['fault']) if r['fault'] else 'none (healthy)'} | {r['alerts']} | {r['verdict']} | {alert} | {parameter} |")
    return lines + [""]


def _interval(entry: dict) -> str:
    return "n/a" if not math.isfinite(entry["ci_low"]) else f"[{entry['ci_low']:.4f}, {entry['ci_high']:.4f}]"


def _markdown_seeds(groups: list[dict], comparisons: list[dict]) -> list[str]:
    level = f"{CONFIDENCE:.0%}"
    lines = [
        "", "## Over seeds", "",
        "Runs of one setting and world size with different seeds are repeats: per signal, the mean over seeds of each run's mean (the",
        f"steps of the tables above), its {level} confidence interval (t distribution, n - 1 degrees of freedom; n/a below 2 seeds) and the",
        "seed-to-seed standard deviation (signals no run recorded are left out).",
    ]  # fmt: skip
    for group in groups:
        seeds = ", ".join("?" if seed is None else str(seed) for seed in group["seeds"])
        differs = f"; configs also differ in {', '.join(group['differs'])}" if group["differs"] else ""
        lines += ["", f"### {group['setting']} x{group['world_size']}, {group['steps']} (seeds {seeds}{differs})", ""]
        lines += [f"| signal | n | mean | {level} CI | sd |", "|---|---|---|---|---|"]
        lines += [f"| {key} | {e['n']} | {_fmt(e['mean'])} | {_interval(e)} | {_fmt(e['sd'])} |" for key, e in group["signals"].items() if e["n"]]
    if comparisons:
        lines += [
            "", "### Against the synchronised baseline", "",
            f"Difference of the seed means (setting minus baseline) with its {level} CI and p-value (Welch's t test), and the minimum detectable",
            f"effect MDE = (t_{{0.975,df}} + t_{{0.80,df}}) x SE: a true difference of that size is found ({level} confidence, two-sided) in",
            f"{POWER:.0%} of repeats with these seeds. |difference| < MDE reads \"no effect larger than the MDE\", not \"no effect\".",
        ]  # fmt: skip
        for comparison in comparisons:
            lines += ["", f"#### {comparison['setting']} - {comparison['baseline']}, x{comparison['world_size']} ({comparison['runs']} and {comparison['baseline_runs']} seeds)", ""]
            lines += [f"| signal | difference | {level} CI | p | MDE | df |", "|---|---|---|---|---|---|"]
            lines += [
                f"| {key} | {_fmt(e['difference'])} | {_interval(e)} | {_fmt(e['p_value'])} | {_fmt(e['mde'])} | {_fmt(e['df'], 1)} |"
                for key, e in comparison["signals"].items()
                if e["n"] and e["n_baseline"]
            ]
    return lines


def write_report(paths: list[str], out: str | Path, skip: float = 0.1, heatmaps: int = 3, window: int | None = None, alert_source: str = "recorded") -> Path:
    """Figures (PNG), ``summary.md`` and ``summary.json`` for the given run files.

    ``summary.md`` has the per-run means, the per-rank table, the alerts (the records' own, else
    ``ddphooks.detect`` run offline) and, where a setting was run with several seeds, the mean over
    seeds with its confidence interval and the comparison of each desynchronised setting with its
    baseline (difference and minimum detectable effect). ``summary.json`` holds the same numbers
    (strict JSON: null where a value is undefined): ``{"glance": [...], "runs": [...], "ranks":
    [...], "alerts": [...], "seeds": [...], "comparisons": [...]}``. ``summary.md`` opens with the
    glance: which runs were healthy, which had a fault, and whether and when the fault was named.

    Args:
        paths: run files (JSON lines: an optional header line, then one record per step).
        out: folder for the outputs, created if missing (only once every run file has been read).
        skip: fraction of each run's first steps left out of the table means, in [0, 1).
        heatmaps: cosine heatmaps per run (0: none).
        window: steps in the trend lines and heatmap means (None: a 25th of the longest run).
        alert_source: ``"recorded"``: the records' own alerts, else the detector run offline;
            ``"offline"``: always the detector of this ddphooks run offline (to compare runs made
            with other thresholds or versions).

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
    if alert_source not in ("recorded", "offline"):
        raise ValueError(f"--alerts {alert_source!r} must be 'recorded' (the records' own, else detected offline) or 'offline' (always detected now)")
    runs = [read_run(path) for path in paths]
    _label_runs(runs)
    alerts, sources = zip(*(run_alerts(run, offline=alert_source == "offline") for run in runs))
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
        figures.append(_plot_signals(plt, runs, out, window, list(alerts)))
        figures += [f for f in (_plot_alerted_parameter(plt, run, found, out) for run, found in zip(runs, alerts)) if f is not None]
        if heatmaps:
            figures += [f for f in (_plot_cosines(plt, run, out, heatmaps, window) for run in runs) if f is not None]
    rows = [row for run in runs for row in summary_rows(run, skip)]
    ranks = [row for run in runs for row in rank_rows(run, skip)]
    groups = seed_groups(runs, skip)
    repeated = any(group["runs"] > 1 for group in groups)
    comparisons = seed_comparisons(groups) if repeated else []
    glance = glance_rows(runs, list(alerts))
    lines = [
        "# ddphooks experiment report",
        "",
        *_markdown_glance(glance),
        "## Signals",
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
    lines += [f"| {r['run']} | {r['rank']} | {_fmt(r['loss_minus_mean'])} | {_fmt(r['norm_over_mean'])} | {_fmt(r['cosine_to_others'])} |" for r in ranks]
    lines += _markdown_alerts(runs, list(alerts), list(sources))
    lines += _markdown_identities(runs)
    if repeated:
        lines += _markdown_seeds(groups, comparisons)
    lines += ["", "## Runs", ""]
    for run in runs:
        config = run.header.get("config", {})
        fault = f", fault {run.header.get('fault_kind') or 'labels'} on rank {run.header.get('fault_rank', '?')} from step {run.fault_step}" if run.fault_step is not None else ""
        lines.append(
            f"- `{run.path.name}`: {run.name}, {len(run.records)} steps, model `{config.get('model', '?')}`, data `{config.get('data', '?')}`, "
            f"seed {config.get('seed', '?')}, {run.header.get('parameters', '?')} parameters{fault}"
        )
    lines += ["", "## Figures", ""] + ([f"![{f.stem}]({f.name})" for f in figures] or [f"Skipped: {skipped}."])
    summary = out / "summary.md"
    summary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    document = {
        "glance": glance,
        "runs": rows,
        "ranks": ranks,
        "alerts": [{"run": run.name, "source": source, "alerts": found} for run, found, source in zip(runs, alerts, sources)],
        "seeds": groups if repeated else [],
        "comparisons": comparisons,
    }
    (out / "summary.json").write_text(json.dumps(_strict(document), indent=1), encoding="utf-8")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run files (run-<setting>-w<W>.jsonl)")
    parser.add_argument("-o", "--out", required=True, help="folder for the figures and summary.md")
    parser.add_argument("--skip", type=float, default=0.1, help="fraction of initial steps left out of the table means")
    parser.add_argument("--heatmaps", type=int, default=3, help="cosine heatmaps per run (first, ..., last step)")
    parser.add_argument("--window", type=int, default=None, help="steps in the trend lines (default: a 25th of the run)")
    parser.add_argument(
        "--alerts", choices=("recorded", "offline"), default="recorded",
        help="'recorded': the alerts the records carry, else the detector run now; 'offline': always the detector run now",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    summary = write_report(args.runs, args.out, args.skip, args.heatmaps, args.window, args.alerts)
    print(summary.read_text())
    print(f"report written to {summary.parent}")
    return 0


# -- ddphooks detect -------------------------------------------------------------------------------
def add_detect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run files (run-<setting>-w<W>.jsonl, or any JsonlSink file with sketches)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE",
        help="one DetectorConfig field other than its default (repeatable), e.g. --set threshold=25: what a run would have raised with it",
    )  # fmt: skip
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every run's alerts to FILE as JSON (for scripts watching many runs)")
    parser.add_argument(
        "--exit-code", action="store_true",
        help="exit with status 1 if any run raised an alert (0 if none), as git diff --exit-code: for schedulers and CI",
    )  # fmt: skip


def detect_main(args: argparse.Namespace) -> int:
    """``ddphooks detect RUN.jsonl ...``: the alerts of ``ddphooks.detect`` run offline on each
    run's records (the detector the hook runs online with ``detect=True``), as a table per run,
    then the total. Every file is read and checked before anything is printed.

    Example::

        $ ddphooks detect runs/run-fault-w2.jsonl
        runs/run-fault-w2.jsonl: fault x2, 120 steps, 1 alert (1 recorded during training)
        step  rank  kind  since  score  parameters  message
          42     1  loss     40   9.31  -           rank 1: loss 0.52 above the others since step 40
        1 alert in 1 run
        $ ddphooks detect runs/run-fault-w2.jsonl --set threshold=40
        runs/run-fault-w2.jsonl: fault x2, 120 steps, no alerts (1 recorded during training)
        0 alerts in 1 run (DetectorConfig with threshold=40)
        $ ddphooks detect runs/*/stats.jsonl --json alerts.json --exit-code || page_someone alerts.json
    """
    from ddphooks.detect import DetectorConfig

    config = DetectorConfig.from_overrides(args.set)  # a bad --set fails before any file is read
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise SystemExit(f"--json {args.json}: the folder {Path(args.json).resolve().parent} does not exist")
    runs = [read_run(path) for path in args.runs]
    _label_runs(runs)
    found = [detect_alerts(run, config) for run in runs]
    for run, alerts in zip(runs, found):
        recorded = recorded_alerts(run)
        online = "" if recorded is None else f" ({len(recorded)} recorded during training)"
        plural = "" if len(alerts) == 1 else "s"
        print(f"{run.path}: {run.name}, {len(run.records)} steps, {len(alerts) or 'no'} alert{plural}{online}")
        if alerts:
            print("\n".join("  " + line for line in alert_table(alerts)))
    total = sum(len(alerts) for alerts in found)
    settings = f" (DetectorConfig with {', '.join(args.set)})" if args.set else ""
    print(f"{total} alert{'' if total == 1 else 's'} in {len(runs)} run{'' if len(runs) == 1 else 's'}{settings}")
    if args.json:
        document = {
            "detector": dataclasses.asdict(config),  # every setting the alerts were found with
            "alerts": total,
            "runs": [{"path": str(run.path), "name": run.name, "steps": len(run.records), "alerts": alerts} for run, alerts in zip(runs, found)],
        }
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 1 if args.exit_code and total else 0
