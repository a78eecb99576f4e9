"""How much a fault run's records could tell: the per-step separation d' of the detector's best
score and the delay bound it allows, so that a missed fault says whether any detector could have
named it (the report's "At a glance", ``ddphooks.experiment.report.glance_rows``).

From a fault run's records (fault on ``rank`` from ``fault_step``):

1. replay them through ``Detector(keep_scores=True)``: every step's score of every CUSUM, rank and
   part (a signal's rise or fall, a parameter), as the detector accumulates them;
2. per CUSUM and part, ``d' = (mean of the faulty rank's scores over the steps from the fault -
   mean of every rank's before it) / their standard deviation before it`` (at W = 2, after the
   fault the other rank's scores mirror the faulty one's, so the reference is the steps before);
3. the best d' over every CUSUM and part, and the Lorden bound ``ln(ARL0) / (d'^2 / 2)`` steps:
   no detector with one false alarm per ``ARL0`` healthy steps (30,000, the project's goal) names a
   lasting shift of that separation faster on average.

Example::

    >>> info = separation(records, fault_step=40, rank=1)
    >>> info["dprime"], info["bound"], info["key"]
    (1.1, 17.0, 'combined (own)')
"""

from __future__ import annotations

import math

import numpy as np

from ddphooks.detect import Detector, DetectorConfig, Observation

#: Healthy steps per false alarm that the delay bound is taken at: the project's goal.
ARL0 = 30_000
#: Steps after the fault that d' is measured over (fewer where the run ends sooner).
STEPS_AFTER = 80


def bound(dprime: float, arl0: float = ARL0) -> float:
    """``ln(arl0) / (d'^2 / 2)``: the fewest steps on average a detector with one false alarm per
    ``arl0`` steps needs for a lasting shift of ``dprime`` standard deviations (inf at d' <= 0)."""
    return math.log(arl0) / (dprime * dprime / 2) if dprime > 0 else math.inf


def separation(records: list[dict], fault_step: int, rank: int, config: DetectorConfig | None = None, steps_after: int = STEPS_AFTER) -> dict | None:
    """The best d' of any of the detector's scores of ``rank`` from ``fault_step`` on (see the module
    docstring): ``{"dprime", "bound", "key", "steps_after"}``, ``key`` the CUSUM it came from, e.g.
    ``"combined (own)"``; None where the records give no scores before and after the fault."""
    detector = Detector(config, keep_scores=True)
    before: dict[tuple, list[np.ndarray]] = {}
    after: dict[tuple, list[np.ndarray]] = {}
    seen_after = 0
    for record in records:
        detector.update(Observation.from_record(record))
        step = record.get("step")
        if not isinstance(step, int) or not detector.step_scores:
            continue
        if step < fault_step:
            target = before
        elif step < fault_step + steps_after and rank < (detector.world or 0):
            target = after
            seen_after = max(seen_after, step - fault_step + 1)
        else:
            continue
        for key, z in detector.step_scores.items():
            if key[1] == "layer":
                continue  # per parameter: W x P parts of heavy-tailed noise, their best d' is the noise's
            z = np.asarray(z, dtype=float)
            for part in range(z.shape[1]):
                if target is before:
                    before.setdefault((key, part), []).append(z[:, part])
                else:
                    after.setdefault((key, part), []).append(z[rank : rank + 1, part])
    best = None
    for (key, part), rows in after.items():
        reference = np.concatenate(before.get((key, part), []) or [np.array([])])
        reference = reference[np.isfinite(reference)]
        faulty = np.concatenate(rows)
        faulty = faulty[np.isfinite(faulty)]
        if len(reference) < 2 or not len(faulty) or reference.std() == 0:
            continue
        d = float((faulty.mean() - reference.mean()) / reference.std())
        if best is None or d > best[0]:
            best = (d, key)
    if best is None:
        return None
    d, (kind, name) = best
    return {"dprime": d, "bound": bound(d), "key": f"{name} ({kind})", "steps_after": seen_after}


def missed_reason(info: dict | None) -> str:
    """The verdict of a fault run with no alert on its faulty rank, from ``separation``'s reading."""
    if info is None:
        return "not named (too few steps to measure what the records could tell)"
    d, steps = info["dprime"], info["steps_after"]
    limit = info["bound"]
    need = "no detector could have" if limit > steps else "a detector could have"
    shown = f"{limit:.0f}" if math.isfinite(limit) else "no finite number of"
    return (
        f"not named: its best score ({info['key']}) separated the faulty rank by d' = {d:.2f} a step, so a detector with one false "
        f"alarm per {ARL0:,} steps needs {shown} steps on average (ln({ARL0:,}) / (d'^2 / 2)); the run had {steps} after the fault: "
        f"{need} named it in them"
    )
