"""Online detection: which rank went wrong, since when, in which signal and which layers.

Numpy only (no ``torch.distributed``), so the same detector runs inside training (``SilentState(...,
detect=True)``) and offline on a finished run file (``ddphooks detect RUN.jsonl``). It is fed one
step at a time (``Detector.update``) and returns the alerts that step raises.

One rule makes every statistical alert: robust z-scores, each counted only in its suspicious
direction and capped, accumulate in one-sided CUSUMs ``S <- max(0, S + min(z, cap) - allowance)``,
and a CUSUM past ``threshold * alert_level`` names its rank. The CUSUMs differ only in what they
pool (defaults; thresholds at level 1, times 1.25 at the default level):

=====================  =======================  ============================================  =========  =====  =========
CUSUM                  one per                  score of a step                               allowance  cap    threshold
=====================  =======================  ============================================  =========  =====  =========
own, per signal        rank, signal, direction  change against the rank's own history,        3          16     20
                                                less the other ranks'
cross, per signal      rank, signal, direction  distance from the median rank (W >= 3)        3          16     20
combined               rank                     the signals' scores in the pattern of wrong   3 (W>=3),  4 a    20
                                                data, summed (cross at W >= 3, own at W = 2)  2 (W=2)    term
repeat                 rank                     cosine to the previous step rising, plus the  2 (W>=3),  5 + 3  14
                                                loss falling below the others' (W >= 3)       0.5 (W=2)
layer                  rank, parameter          the parameter's share of the gradient norm    2.25       5      12
                                                rising against its own average
level                  rank, direction          the log gradient norm minus the median        1          3      20
                                                rank's, against its own median (learned       (signed)
                                                only while this CUSUM is at zero); a fall
                                                counts against a rise (W = 2: one split,
                                                given to a rank as it alerts)
=====================  =======================  ============================================  =========  =====  =========

What follows is how each score is made; ``benchmarks/detection.py --ablations`` measures what each
pooling and setting buys, on held-out runs (benchmarks/README.md).

Per rank ``i`` and step ``t`` it scores, as robust z-scores against baselines learned from the run
itself:

1. **against the other ranks** (W >= 3), each as the distance from the median over all ranks
   (robust to the one rank that is off); at W = 2 the two distances are opposite, and only
   ``cosine_previous``, where a rise alone is suspicious, says which rank it is:
   - ``loss``: ``log loss_i - median_j log loss_j`` (``loss_scale``: the log while every loss seen
     is positive, relative changes as for the gradient norm; the loss itself from the first loss
     <= 0 on),
   - ``grad_norm``: ``log|g_i| - median_j log|g_j|``,
   - ``cosine``: the leave-one-out cosine ``cos(s_i, sum_{j != i} s_j)`` minus the median of
     those (only a drop counts: the rank disagrees with the rest);
   - ``cosine_previous``: the rank's sketched cosine to its own gradient of the previous step,
     ``cos(s_i(t), s_i(t-1))``, minus the median of those (only a rise counts: a rank that keeps
     training on the same batch, a stuck data loader, produces nearly the same gradient again,
     while healthy ranks draw a new batch every step); at W >= 3, on a step where it rose, its
     score also counts how far the rank's loss fell below the median rank's (capped at
     ``repeat_loss_cap``): a rank that keeps training on one batch memorises it, so its loss
     falls below the others' as its gradient repeats;
2. **against its own history** (every W, the only way to tell which of two ranks changed): the
   rank's loss (only a rise counts), its log gradient norm (either way), its leave-one-out
   cosine (only a drop counts) and its cosine to its previous step (only a rise counts), each
   against the rank's trailing median; the
   score that counts is the rank's change minus the largest (W = 2) or the median (W >= 3) change
   of the other ranks, so a change every rank shares (the training trend, a learning-rate step)
   scores nothing. At W = 2 a loss relative to the step's mean rises on one rank as much as it
   falls on the other, so a rank's loss rise counts only if its own loss moved more than the
   other rank's against their trailing medians (a rank given easier data, or a stuck rank
   memorising its batch, whose loss falls, does not get the other rank named);
3. **several signals at once**: the sum of the rank's scores, each in one direction (loss and
   gradient norm rising, cosine to the others falling, cosine to the previous step rising: a rank
   training on wrong data) and capped at ``combined_cap``, in a CUSUM of its own: at W >= 3 its
   cross-rank scores (allowance ``combined_drift``), at W = 2, with no majority, its own-history
   scores (allowance ``pair_combined_drift``). A rank a little off in its loss *and* its gradient norm
   *and* its cosine (shuffled labels: every signal moves by one or two standard deviations, none
   enough alone) is found far sooner than by any one of them; one direction per signal keeps the
   healthy ranks' noise out of the sum, and the cap keeps one wild signal from passing for several;
4. **per layer**: ``d_{i,p} = log|g_{i,p}| - median_j log|g_{j,p}|`` for every parameter ``p``,
   less the rank's common factor ``median_q d_{i,q}`` (a batch that makes one rank's whole
   gradient larger moves all its parameters alike, and one corrupted parameter cannot move a
   median over many: with it removed, the corrupted weights of the embedded model's ``sdc`` runs
   rose 9.9 standard deviations a step instead of 5.9, medians), against its exponential
   average, in standard deviations; only a rise counts (a corrupted gradient carries more
   energy: that direction also tells which of two ranks it is),
   accumulated in one CUSUM per rank and parameter (allowance ``layer_drift``, threshold
   ``layer_threshold``; a step counts up to ``layer_cap``, near a corrupted layer's steady rise,
   because healthy parameters have heavy tails and there are W x P of these CUSUMs: one
   parameter needs five steps at the cap to alert at level 1, however wild, while a corrupted
   layer's steady rise of a few standard deviations loses little to the cap), so that a lasting
   change in one layer is not lost among the hundreds of parameters that did not change; the
   rank's level is its largest. A zero norm is unknown, as a non-finite one: a parameter the
   rank's batch did not use (an expert or a task head under conditional computation,
   ``find_unused_parameters=True``) has no local gradient to compare. The scale of a parameter's rises is learned on every step,
   pooled over ranks (an exponential average of their median absolute rise, which the one rank
   that is off cannot move; W >= 3). A scale learned only on calm steps would be too small by
   the steps it skips, and healthy runs would raise per-parameter alerts. At W = 2, with no
   majority, each rank's scale is its own average absolute rise, learned on the steps when its
   evidence on that parameter is not accumulating.

Baselines are the median and a standard deviation of the last ``window`` steps: the larger of
the scaled median absolute deviation (``1.4826 * MAD``) and the shoulders of the noise, the median
rank's ``scale_quantile`` (0.9) of its absolute deviations over a normal's (``_shoulders``; the
smaller of the two ranks' at W = 2). The two agree for normal noise; for noise with a second mode
(ranks whose batches come from different domains) or heavy shoulders (a loss with outlier batches)
the quantile's is the larger, so what is routine in the run scores as routine. Both are learned
never including the steps of a rank with a CUSUM past half its threshold or
that is under alert (a lasting fault does not become the new normal before it is reported), with
floors so that a constant signal does not divide by zero; a baseline of fewer than
``MIN_BASELINE_STEPS`` (8) steps scores nothing (a rank kept out of its own for a whole window is
not scored until it has learned 8 steps again; the level's baseline, read against the median
rank, is held instead: see ``DetectorConfig.level_drift``). A scale grows with the spread of the
last ``recent`` steps: in the first steps of training the ranks' losses are close together and
then spread out, and a baseline that still remembers the calm steps would take the new normal for
a fault. The growth is measured on each step's MAD across ranks, which the one rank that is off
cannot move, so that rank does not raise its own bar (W >= 3; at W = 2 there is no majority, and
the scales are the window's). The combined CUSUM's terms grow with a power of it
(``combined_growth``, the square root): a ratio of noisy medians over a few steps, floored at 1,
also inflates the scales by chance, and the combined CUSUM would divide all of its terms by it.
A cosine scale never goes below the sketch's own noise, ``cosine_noise = 1/sqrt(sketch_dim)``, and
a cosine deviation below ``cosine_floor`` times that noise scores zero: a cosine change inside the
sketch's noise never raises an alert.

Each score feeds a one-sided CUSUM per (rank, signal): ``S <- max(0, S + z - drift)``; an alert is
raised when ``S > threshold``, after ``warmup`` steps. A signal suspicious either way keeps two, one
for its rises and one for its falls: a gradient norm that dips on one step and spikes on the next
is no lasting shift (on a healthy length-grouped run, one CUSUM of its size alerted on exactly
that). The threshold is ``threshold * alert_level`` (25 at the defaults: 20 times 1.25). With
drift 3 and threshold 20 (level 1) a lasting shift of 10 standard deviations alerts on its 3rd
step, one of 6 on its 7th, and shifts under 3 never do; at the default level, on its 4th and 9th.
A step's score counts up to ``step_cap`` (16): a single outlier step, however large, never alerts
alone (one odd batch is not a rank that diverged); one signal alerts on the
2nd step of a rank that stays off at the earliest. The combined CUSUM at W >= 3 (drift 3, the same
threshold) alerts on the 4th step (5th at the default level) of a rank 3 standard deviations off in three of
its four signals; one
signal alone, capped at 4, adds at most 1 a step, what the same shift adds to its own
CUSUM. The cross-rank ``cosine_previous`` CUSUM has its own settings (allowance 2, or 0.5 at
W = 2, where the same rise scores about half as much and there is no loss term; the cosine's
score capped at 5 a step, the loss fall's at 3; threshold 14, times the alert level): the
cosine's score has light tails
in healthy runs (Fisher's scale, a scale pooled over ranks), while a stuck rank's cosine to its
previous step rises a few standard deviations on most steps but falls back on some (it overshoots
on the batch it keeps seeing), so a small allowance lets the raised steps add up; the caps keep
one wild step from alerting alone (6 at most a step at W >= 3: the 3rd raised step at the
earliest, the 5th with the cosine alone; the 6th at the default level). The level CUSUM adds a
step's score signed, ``S <- max(0, S + clip(z, -cap, cap) - allowance)``, the textbook CUSUM of
a shift in the mean: with its allowance of 1, counting only the rises (each step's z floored at
0) took a spread that widened around the same level for a shift. An alert names the rank,
its strongest signal (the CUSUM furthest up its own threshold), every signal over half its threshold, since
which step the CUSUM has been rising, and the parameters that deviate most on that rank: per
parameter, the evidence of its CUSUM, and where there is none, how far the rank's gradient
norm, against the median rank's, rose above its own recent level. One alert per episode: a rank's episode ends after
``quiet_steps`` steps with every score below threshold. At W = 2 every score reads a rank against the other,
so while one rank's episode lasts the other rank's evidence is taken for its mirror and emptied, not alerted
on, unless the pair says that rank changed itself (a layer whose pair mean rose against its trend:
``Detector._changed_itself``).

Replica divergence (records' ``replicas`` key, from parameter fingerprints) alerts at once, with
no warm-up: bitwise-identical replicas are never flagged, so there is nothing to learn.

Non-finite values (records' ``nonfinite`` key) need no baseline either: a rank whose loss or local
gradient went NaN or Inf on a step where the other ranks' were finite is named (kind ``nonfinite``,
``since`` that step, the parameters whose gradients were not finite, ``score`` how many of them a
record lists) on the next step if its values are still not finite there, or on its third step
non-finite alone within ``quiet_steps`` (a failing unit that corrupts some steps and not others),
with no warm-up. Without a
loss scaler the averaged gradient carries the NaN to every replica, and from the next step on every
rank is non-finite: the alert says which rank it came from. With one (fp16 ``GradScaler``) an
overflow on one rank makes every rank skip that step and the next step is finite again: that is the
scaler's routine and raises nothing (the scale is halved each time, so the same rank does not
overflow three times within a few steps). Every rank non-finite from the same step (a learning rate that
blows up everywhere) names no rank and raises nothing; the records show it. Non-finite values score
nothing in the other signals (they are unknown there), online as offline, where a record holds them
as null.

Duplicate data (kind ``duplicate_data``) needs no baseline either, and works from step 0 and at
W = 2: ranks that train on the same batches (no ``DistributedSampler``, or one given the same rank
on every rank; one data seed on every rank) compute the same loss and the same gradient, to
rounding, and W - 1 of them add nothing to the average. Two ranks are duplicates on a step when
their losses and their gradient norms agree to ``duplicate_tolerance`` (relative), and, with a
sketch, their leave-one-out cosines to ``duplicate_cosine_tolerance`` (the same gradient has the
same sum of the others: ``S - s_i = S - s_j``); a group of every rank must also have every
leave-one-out cosine >= ``1 - duplicate_cosine_tolerance``. Groups are found in O(W log W): sort by
loss, cut where neighbours' losses differ beyond the tolerance, sort each piece by gradient norm
and link neighbours that agree in every quantity. A rank with a non-finite or missing loss or
gradient norm, or a zero gradient (a step where no rank has a gradient is no duplicate data),
never counts; with no loss on any rank (none captured) the gradient norms and cosines decide. A
group that stays together for ``duplicate_steps`` consecutive instrumented steps (twice as many
where only the gradient norms are known) is named (``rank`` its lowest rank, ``ranks`` all of
them, ``score`` their number, ``since`` the first of those steps). Distinct data agrees by
chance: a pair of healthy ranks whose losses and gradient norms spread with a coefficient of
variation ``c`` across ranks agrees in one of them to a relative tolerance ``tau`` with a
probability of about ``tau / (sqrt(pi) c)`` a step (the difference of two ranks' values has a
standard deviation of ``sqrt(2) c``), in both about ``tau^2 / (pi c^2)``, on ``k`` steps running
``(tau^2 / (pi c^2))^k``. At W = 1024 (523,776 pairs) over 100,000 steps, with ``tau = 1e-4``,
``c = 1%`` and ``k = 3``: 523,776 x 1e5 x (3.2e-5)^3 = 1.7e-3 false alarms a run, before the
cosines, which agree to 1e-4 by chance about one step in 1,800 more (a spread of 0.1 across
ranks). On the embedded model's healthy runs ``c`` is 3-15% (losses) and 5-24% (gradient norms),
medians over steps, and a pair's chance agreement in both was measured at 3.2e-7 a step
(see ``duplicate_tolerance``): 523,776 x 1e5 x (3.2e-7)^3 = 2e-9 false alarms a run. One alert
per episode: a rank stays flagged until it has been in no duplicate group for ``quiet_steps``
steps; a group with a rank not yet flagged raises a new one.

Every alert's message ends with what its kind typically means (``LIKELY_CAUSES``) and a pointer to
its section of the alerts reference, ``; see docs/alerts.md#<kind>`` (``reference``): what the alert
means, what to check first, its measured false-alarm rate and delay.

Example::
    >>> detector = Detector()
    >>> for record in records:
    ...     for alert in detector.update(Observation.from_record(record)):
    ...         print(alert["message"])
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from statistics import NormalDist

import numpy as np

from ddphooks.identity import RankTable

SIGNALS = ("loss", "grad_norm", "cosine", "cosine_previous")
#: Which change of each signal is suspicious, against the rank's own history and against the other
#: ranks: +1 a rise, -1 a drop, 0 either way (see the module docstring). Against its own history
#: only a rise of the loss counts: a rank whose loss falls (a stuck loader memorising its batch)
#: would make the other rank's loss, relative to the step's mean, look risen at W = 2 and take
#: the blame.
OWN_DIRECTION = {"loss": +1, "grad_norm": 0, "cosine": -1, "cosine_previous": +1}
CROSS_DIRECTION = {"loss": 0, "grad_norm": 0, "cosine": -1, "cosine_previous": +1}
#: Which change of each signal counts in the combined CUSUM (W >= 3): the pattern of a rank that
#: trains on wrong data, whose loss and gradient norm rise while its gradient turns from the
#: others'. Each signal's own CUSUM still counts either way (CROSS_DIRECTION); in the sum, a change
#: either way would add every healthy rank's folded noise (0.8 standard deviations a signal on
#: average) to the allowance, and a rank a little off would have to be off by that much more.
COMBINED_DIRECTION = {"loss": +1, "grad_norm": +1, "cosine": -1, "cosine_previous": +1}
#: What each kind of alert typically means, at the end of its message before its ``reference``:
#: the faults whose pattern it is (benchmarks/detection.py: a corrupted gradient raised ``layer``
#: alerts, a stuck loader ``cosine_previous`` ones, shuffled labels ``combined`` ones), so the
#: reader knows what to check. Its keys are every kind the detector raises (the watchdog adds
#: ``unsynchronised``), each with a section of the alerts reference.
LIKELY_CAUSES = {
    "layer": "a corrupted gradient (a failing accelerator, silent data corruption)",
    "cosine_previous": "the same batch over and over (a stuck or exhausted data loader)",
    "combined": "wrong or different data (mislabelled or shuffled examples, another shard or preprocessing)",
    "loss": "different data or a different loss (another shard or preprocessing, mislabelled examples)",
    "grad_norm": "a gradient scaled differently (another loss scale, a corrupted gradient, different data)",
    "cosine": "a gradient pointing elsewhere (different data, a corrupted gradient)",
    "replica": "an update that differs (another learning rate, a non-deterministic or corrupted optimizer step, unsynchronised buffers)",
    "nonfinite": "a numerical fault on that rank (an overflow in its batch or activations, a corrupted batch, a failing accelerator)",
    "duplicate_data": (
        "the same batches on several ranks (a data sampler without the rank: DistributedSampler missing or given the same rank "
        "on every rank, one data seed on every rank)"
    ),
}
#: The alerts reference, one section per kind with the kind as its anchor (``docs/alerts.md#replica``):
#: what the alert means, what to check first, its measured false-alarm rate and delay.
ALERTS_REFERENCE = "docs/alerts.md"


def reference(kind: str) -> str:
    """The pointer every alert message ends with (after ``"; "``): its section of the alerts
    reference, e.g. ``reference("replica") == "see docs/alerts.md#replica"``."""
    return f"see {ALERTS_REFERENCE}#{kind}"


#: Signals measured by the sketch, whose changes inside the sketch's noise never count.
SKETCHED = ("cosine", "cosine_previous")
#: The gradient-norm level CUSUM's key (see ``DetectorConfig.level_drift``): its alerts are ``grad_norm`` alerts.
LEVEL = ("level", "grad_norm")
#: Its row in the own-history window, after the signals'.
LEVEL_ROW = len(SIGNALS)
MAD_TO_STD = 1.4826
PARAMETER_RATE = 0.1  # weight of a new step in the per-parameter exponential averages
#: The per-parameter W x P arithmetic is in float32: the norms come from fp32 slots (their own
#: precision), and at W = 4096 x 273 parameters each pass over float64 cost twice as much
#: (the logs 3.5 times as much).
PARAMETER_DTYPE = np.float32
#: Fewest steps a baseline is learned from: a median and MAD of one or two steps have no spread,
#: and a rank kept out of its own baseline for a whole window (while it is suspect, see
#: ``Detector.update``) would otherwise score its next steps against the scale's floor.
MIN_BASELINE_STEPS = 8
#: At W = 2, the pair's mean log gradient norm is kept over this many windows of steps (see
#: Detector._pair_owner): a level alert comes 13 steps or more after its CUSUM began rising.
PAIR_STEPS = 4
#: Lone non-finite steps of one rank within ``quiet_steps`` that name it (see ``_nonfinite_alerts``):
#: a workload-zoo rank with a failing unit (exponent bits flipped in its gradient) went Inf alone on
#: steps 151, 153, 156 and 163 and was named at 164 by the next-step rule alone.
NONFINITE_AGAIN = 3
#: Fewest parameters whose median is a rank's common factor (see ``Detector._parameter_changes``):
#: with one or two, a corrupted parameter would move it.
COMMON_FACTOR_PARAMETERS = 3


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the detector; the defaults were chosen on healthy runs (see docs/detection.md)."""

    window: int = 32
    """Trailing steps the baselines (median, MAD) are computed over."""

    warmup: int = 24
    """Steps observed before the first alert (replica alerts excepted). Not 16: in the first steps
    of training the ranks' losses spread apart (on the embedded model their spread across ranks
    grew 4x over steps 0-30), and baselines learned on 16 such steps raised combined alerts on
    healthy runs at steps 22 and 25."""

    threshold: float = 20.0
    """CUSUM level (in standard deviations summed over steps) at which an alert is raised, for the
    per-signal and combined CUSUMs (the cross-rank ``cosine_previous`` CUSUM has
    ``repeat_threshold``, the per-parameter ones ``layer_threshold``)."""

    alert_level: float = 1.25
    """One knob for how much evidence an alert needs: every statistical CUSUM's alert level
    (``threshold``, ``repeat_threshold``, ``layer_threshold``) is multiplied by it. Higher: fewer false alarms, later
    alerts (each step of a lasting shift adds the same evidence, so the delay grows about in
    proportion). The default, 1.25, is the lowest level that raised no false alarm on the
    experiment's healthy runs at W = 2, 4 and 8 (level 1 raised one, at W = 2); the measured
    false-alarm rate and delays per level are in ``benchmarks/detection.py --levels``. Replica,
    non-finite, duplicate-data and unsynchronised alerts need no evidence to accumulate and do
    not depend on it."""

    drift: float = 3.0
    """Allowance subtracted from every step's score: shifts smaller than this never accumulate."""

    step_cap: float = 16.0
    """Cap on one step's score in each CUSUM of one signal (own and cross loss, gradient norm and
    cosines; the per-parameter CUSUMs have ``layer_cap``): a step adds at most ``step_cap -
    drift`` (13), so no single step, however wild, alerts alone: one odd batch (in a healthy run, a length-grouped
    batch whose gradient was 3.5x smaller than the others', 25 standard deviations) is not a rank
    that diverged. Not lower: on a pretrained model (SmolLM2, shuffled labels) the loss rose 15-21
    standard deviations on one of the first steps after the fault and 5-9 on the others, and at 12
    two of those alerts were lost."""

    layer_drift: float = 2.25
    """Allowance of the per-parameter CUSUMs (one per rank and parameter, in standard deviations).
    There are W x P of them, so it sits above the 2 that one CUSUM alone would need: at 2 (and a
    scale learned on calm steps only, since replaced), healthy runs raised per-parameter alerts
    (5 in 1000 steps of one healthy seed at W = 4)."""

    layer_cap: float = 5.0
    """Cap on one step's score in each per-parameter CUSUM: a step adds at most ``layer_cap -
    layer_drift`` (2.75), so one parameter needs five steps at the cap to alert at level 1
    (``layer_threshold``, 12) and six at the default level, however wild. A cap near a corrupted
    layer's rise, not far above it: healthy parameters have heavy tails (on held-out runs
    P(z > 5) = 1.0e-3 per parameter-step against 2.9e-7 for a normal; the largest 16.1), and
    under a high cap the healthy levels come from single wild steps, which the threshold must
    clear, while a corrupted layer rises a steady 3-5 standard deviations a step (the ``sdc`` runs
    from step 150 at W = 2 and 4). With 10 and a threshold of 20, median / worst delay at W = 2 /
    4 / 8: 14 / 25, 12.5 / 17, 3 on the eleventh session's held-out set, where this was chosen, and
    5.5 / 17, 8.5 / 10, 5 on 11 runs held out from the choice; with 5 and 12, 8 / 16, 8.5 / 11, 5
    and 5 / 10, 6 / 7, 5, with no false alarm in either set (benchmarks/README.md). A strong
    corruption needs more steps than before: from step 30, where the corrupted weight rose about
    10 a step, 5 / 5 and 5 / 5 at W = 2 / 4 (5 / 9 and 3 / 5 before). Not 16: early in
    length-grouped runs single parameters rose 15-20 standard deviations on two steps running,
    two false alarms in 15,600 held-out steps."""

    layer_threshold: float = 12.0
    """Level at which a per-parameter CUSUM alerts (times ``alert_level``: 15 at the default level).
    Its own, like ``repeat_threshold``: with scores capped at ``layer_cap`` its healthy levels are
    lower than those of the few CUSUMs of ``threshold``. Just above the highest level of any
    per-parameter CUSUM on the eleventh session's 13,030 held-out healthy steps (11.2, at W = 2;
    at W = 4 0.7 of that); on 17,770 healthy steps held out from the choice the per-parameter
    CUSUMs stayed under 10.1 (W = 2) and 6.3 (W = 4)."""

    scale_quantile: float = 0.9
    """Every baseline's scale (own history and across ranks; not the per-parameter ones) is the
    larger of two estimates of the standard deviation: ``1.4826 * MAD``, and this quantile of the
    absolute deviations from the median over a normal's (1.6449 at 0.9). For normal noise they
    agree. Where a signal's healthy noise has shoulders or a second mode, the quantile's is the
    larger, and what is routine scores as routine: ranks whose batches come from different
    domains (losses, gradient norms and cosines several MADs apart on a third of the steps), a
    rank whose batch often draws an outlier. 0.5: the MAD alone. Chosen on the workload zoo's
    development seeds (benchmarks/README.md "Workload zoo"): with the MAD alone and the loss on a
    log scale, a domain mixture raised 37 false alarms in 5,900 healthy steps at W = 2, 4 and 8;
    0 at 0.8, which was the default until the twenty-fifth session. 0.9 since then: on fresh zoo
    sets 0.8 raised 3, 3, 1 and 8 false alarms at W = 2, 4, 8 and 20 (22,400 healthy steps each
    at W <= 8, 5,600 at 20; the `heavy` and `mixture` families), 0.9 raised 1, 0, 0 and 0, with
    the same faults named about as fast; on fresh experiment runs (seeds 150-151) neither raised
    one in 6,600 healthy steps, and 0.9 named shuffled labels at W = 4 and a stuck loader at
    W = 2 half a step to a step later (benchmarks/README.md, "The compact wire at the default").
    Its known cost, a stuck loader on LoRA (a weak repeat): on the development seeds once 48
    steps against 24 at 0.8; on all ten fixed fault seeds at W = 2 and 4 since, 20 of 20 named
    (median 7.5 steps, worst 57) against 19 of 20 (median 8, worst 38). Each rank's quantile,
    then the median rank's: a quantile pooled over ranks would take in the one rank that is off
    (a quarter of the values at W = 4), and a lasting shift of 5 standard deviations in one
    rank's loss raised its scale until it scored nothing."""

    loss_scale: str = "log"
    """How the loss signal reads each rank's loss: ``"log"``, its log (relative changes, as the
    gradient norm's), or ``"linear"``, the loss itself. Under ``"log"`` a run whose loss is ever
    <= 0 (an ELBO, a GAN's, a policy objective) is read linearly from that step on, its loss
    baselines started afresh. A log because a loss is positive and its noise grows with it: on a
    regression with heavy-tailed noise (Student-t, df 1.5) a rank's batch loss was many MADs
    above the others' every few dozen steps, and the linear reading raised 98 false alarms in
    5,450 healthy steps at W = 2, 4 and 8, the log 2 (with ``scale_quantile`` 0.5). Its cost:
    misaligned labels were named a step later at W = 4 in six of the seven zoo families that
    named them (2-3 steps instead of 1-2)."""

    level_drift: float = 1.0
    """Allowance of the gradient-norm level CUSUM: one per rank and direction, over its log
    gradient norm minus the median rank's, against its own trailing median, in standard
    deviations. Read against the median rank, every rank's trend (the schedule, the training
    phase) cancels on every step, and the baseline is the rank's spread against the others, not
    that trend. Lower than ``drift``: a gradient scaled by 1.5 on one rank moves the gap between
    the ranks' log norms by 0.41, one to four standard deviations of the healthy gap in the
    workload zoo, under the allowance of 3 that the per-signal CUSUMs need for the heavy tails
    of single steps. Its baseline learns a rank's step only while the rank's level CUSUM is at
    zero (a healthy step is independent of the steps before it, so this leaves a fair sample; a
    lasting shift is not learned as the new normal within the 6 steps the shoulders' scale
    would take), and while it is left out its baseline is held, not aged out of the window:
    otherwise a shift too small to alert within a window (x1.5 on a rank whose healthy gap is
    wide, d' about 2) outlived its baseline, scored nothing, and was learned once the CUSUM had
    drained (twenty-fifth session, benchmarks/README.md "Gradient-scale faults"). A step's score
    is signed: a fall of the gap takes from the CUSUM of its rises, and the other way round (a
    spread that widens around the same level is no shift). At W = 2 a rise of one rank is the
    other's fall, the same split in two mirrored CUSUMs: it accumulates on both and, as it
    alerts, is given to the rank the pair's mean log norm moved with (``Detector._pair_owner``;
    the message says the owner is the likelier, not the certain one; to a rank already under
    alert, when one is, as the same fault; until then the split makes neither rank suspect, so
    the healthy rank's other baselines keep learning). Giving each step to the
    rank whose own norm moved the more, as the loss does, stalled under a steep schedule,
    whose shared moves are larger than a lasting x1.5 (twenty-sixth session)."""

    level_cap: float = 3.0
    """Cap on one step's score in the gradient-norm level CUSUM: a step adds at most ``level_cap -
    level_drift`` (2), so the level CUSUM alerts on a lasting shift, never on a few wild steps
    (13 steps at the cap at the default level)."""

    level_threshold: float = 20.0
    """Level at which the gradient-norm level CUSUM alerts (times ``alert_level``)."""

    cosine_floor: float = 2.0
    """Cosine deviations smaller than this many ``cosine_noise`` units score zero."""

    recent: int = 8
    """Last steps whose spread across ranks, against the whole window's, scales the baselines up
    (W >= 3): a spread that grows, as in the first steps of training, is not taken for a fault."""

    combined_drift: float = 3.0
    """Allowance of the combined CUSUM (W >= 3), which sums a rank's four cross-rank scores, each
    in the direction of ``COMBINED_DIRECTION``."""

    combined_cap: float = 4.0
    """Cap on each score entering the combined CUSUM, so that one signal cannot pass for several:
    alone it adds at most ``combined_cap - combined_drift`` a step, what a shift of that size adds
    to the signal's own CUSUM."""

    combined_growth: float = 0.5
    """Power of the spread growth (see ``recent``) that scales the combined CUSUM's terms, from 0
    (none) to 1 (all of it, as the single-signal CUSUMs). The growth is a ratio of noisy medians of
    a few steps' spreads, never below 1, so it also inflates the scales by chance (1.0-2.25 at step
    29 of 12 runs), and the combined CUSUM divides four terms by it: a fault early in training,
    while the spreads still grow, went unnoticed for longer. Shuffled labels at step 30 of the
    embedded model, median / worst delay: 5 / 26 at 1 and 4 / 10 at 0.5 on the 12 runs this was
    chosen on; 10 / 24 (3 of 10 missed) and 7 / 17 (1 missed) on 10 runs held out; the same
    false alarms in 8000 held-out healthy steps. Not 0: a spread that grows on every rank in two
    signals at once raises combined alerts there."""

    repeat_drift: float = 2.0
    """Allowance of the cross-rank ``cosine_previous`` CUSUM (W >= 3). Lower than ``drift``: on
    Fisher's scale, against a scale pooled over ranks, the cosine's score has light tails in
    healthy runs, and a stuck rank raises it by a few standard deviations on most steps, not on
    all. Not 1, as before the loss fall joined the score (``repeat_loss_cap``): that adds the
    healthy ranks' one-sided loss noise to every step."""

    repeat_cap: float = 5.0
    """Cap on one step's cosine score in the cross-rank ``cosine_previous`` CUSUM (the loss term
    has its own, ``repeat_loss_cap``): a step adds at most ``repeat_cap + repeat_loss_cap -
    repeat_drift`` to that CUSUM (``repeat_cap - pair_repeat_drift`` at W = 2), so no single step,
    however wild, alerts alone."""

    repeat_threshold: float = 14.0
    """Level at which the cross-rank ``cosine_previous`` CUSUM alerts: with the caps, on the 3rd
    raised step at the earliest (the 4th at W = 2)."""

    repeat_loss_cap: float = 3.0
    """Cap on the loss term of the cross-rank ``cosine_previous`` score (W >= 3): how far the
    rank's loss fell below the median rank's, in standard deviations, counted on the steps whose
    cosine rose (0: the cosine alone). A rank that keeps training on one batch memorises it: on
    the embedded model's ``stuck`` runs of sets B, C and D the stuck rank's loss stood a mean 1.9
    standard deviations below the others' over the 15 steps after the fault, while its cosine to
    its previous step stood 2.7 above. Chosen on sets B and C with ``repeat_drift`` 2: ``stuck``
    at W = 4 went from 7 / 11 (median / worst delay) to 5 / 9, and the healthy runs' highest level
    of this CUSUM from 0.93 to 0.76 of its threshold (see benchmarks/README.md for the runs held
    out)."""

    pair_repeat_drift: float = 0.5
    """Allowance of the cross-rank ``cosine_previous`` CUSUM at W = 2, in place of
    ``repeat_drift``. Lower because the same stuck rank scores about half as much there: with two
    ranks its deviation is half their gap, against a scale that holds both ranks' noise. Over the
    first 10 steps of the embedded model's ``stuck`` runs the stuck rank scored a median of 1.9
    standard deviations at W = 2 and 4.3 at W = 4, while healthy W = 2 runs had the lighter tail
    (99.9th percentile 4.2 against 6.4). At 1 a stuck rank was named in 1 of 5 runs at W = 2; at
    0.5 in 5 of 5, and healthy W = 2 runs (4000 steps) peaked at 0.55 of the threshold."""

    pair_combined_drift: float = 2.0
    """Allowance of the combined CUSUM at W = 2, which sums a rank's own-history scores (its
    change minus the other rank's, each in the direction of ``COMBINED_DIRECTION`` and capped at
    ``combined_cap``). Lower than ``combined_drift`` because that sum is lighter on healthy runs:
    a change both ranks share scores nothing, so on the embedded model's healthy W = 2 runs (12,780
    rank-steps) it scored a mean 0.77 (1.38 for the cross-rank sum at W = 4), and 2 sits about
    where 3 sits at W = 4, at the 86th (83rd) percentile of the healthy step scores. Shuffled
    labels at W = 2 (3 runs, from step 150): at 3, delays 5, 7 and 20 steps; at 2, 4, 5 and 8,
    while the healthy W = 2 runs (8,100 steps) peaked at 0.61 of the threshold (0.43 at 3)."""

    quiet_steps: int = 8
    """Steps with every score below threshold that end a rank's alert episode."""

    top_parameters: int = 5
    """Parameters named in an alert."""

    duplicate_steps: int = 3
    """Consecutive instrumented steps on which a group of ranks must compute the same loss and
    gradient before a ``duplicate_data`` alert (twice as many on steps where only the gradient
    norms are known: no loss captured, no sketch). Not 2: a pair of healthy ranks agrees by
    chance in loss and gradient norm with a probability ``p`` of about ``tau^2 / (pi c^2)`` a
    step (see the module docstring), 3.2e-5 at ``tau = 1e-4`` and a spread ``c`` of 1%, and at
    W = 1024 over 100,000 steps ``p^2`` gives 53 false alarms a run, ``p^3`` 1.7e-3."""

    duplicate_tolerance: float = 1e-4
    """Relative difference (``|a - b| / max(|a|, |b|)``) under which two ranks' losses, and their
    gradient norms, count as the same. The same data gives the same numbers to rounding (bitwise
    on gloo: 0 in both; float32 sums in another order, 1e-7), while distinct data spreads them.
    On the embedded model's healthy runs (5 healthy settings and a fault, 120 steps at W = 2; 5
    healthy settings at W = 4: 4320 pairs of ranks and steps), one quantity alone came close (the
    losses to 3.7e-6, the gradient norms to 5.9e-5), but never both: a pair's larger relative
    difference was at least 1.7e-3; both were under 1e-2 on 14 of the 4320 (3.2e-3), and that
    rate scales with the tolerance squared: 3.2e-7 a pair and step at 1e-4."""

    duplicate_cosine_tolerance: float = 1e-4
    """With a sketch, the most two duplicate ranks' leave-one-out cosines may differ (the same
    gradient has the same sum of the others), and how far below 1 a group of every rank may have
    them. Sketched cosines of the same gradient agree to rounding (1 - cos is quadratic in a
    difference of the gradients). Not 1e-3: distinct gradients come close to 1 as well, early in
    training, where the mean gradient dominates every rank's: up to 0.9978 on the embedded
    model's healthy runs at W = 4."""

    def __post_init__(self) -> None:
        for name in ("window", "warmup", "quiet_steps", "top_parameters", "recent", "duplicate_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DetectorConfig.{name}={value!r} must be an int >= 1")
        for name in (
            "threshold", "drift", "step_cap", "layer_cap", "cosine_floor", "layer_drift", "combined_drift", "combined_cap",
            "repeat_drift", "repeat_cap", "repeat_threshold", "level_drift", "level_cap", "level_threshold", "layer_threshold", "pair_repeat_drift", "pair_combined_drift", "duplicate_tolerance", "duplicate_cosine_tolerance",
            "alert_level",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DetectorConfig.{name}={value!r} must be a number > 0")
        if self.window < 4:
            raise ValueError(f"DetectorConfig.window={self.window} must be >= 4 (a median and a MAD need a few steps)")
        if self.step_cap <= self.drift or self.layer_cap <= self.layer_drift:
            raise ValueError(
                f"DetectorConfig.step_cap={self.step_cap} must be > drift={self.drift} and layer_cap={self.layer_cap} > "
                f"layer_drift={self.layer_drift} (a capped step would never raise a CUSUM)"
            )
        if self.level_cap <= self.level_drift:
            raise ValueError(f"DetectorConfig.level_cap={self.level_cap} must be > level_drift={self.level_drift} (a capped step would never raise the level CUSUM)")
        if self.repeat_cap <= max(self.repeat_drift, self.pair_repeat_drift):
            raise ValueError(
                f"DetectorConfig.repeat_cap={self.repeat_cap} must be > repeat_drift={self.repeat_drift} and "
                f"pair_repeat_drift={self.pair_repeat_drift} (a capped step would never raise the cosine_previous CUSUM)"
            )
        if isinstance(self.repeat_loss_cap, bool) or not isinstance(self.repeat_loss_cap, (int, float)) or not self.repeat_loss_cap >= 0:
            raise ValueError(f"DetectorConfig.repeat_loss_cap={self.repeat_loss_cap!r} must be a number >= 0 (0: the cosine alone)")
        if isinstance(self.combined_growth, bool) or not isinstance(self.combined_growth, (int, float)) or not 0 <= self.combined_growth <= 1:
            raise ValueError(f"DetectorConfig.combined_growth={self.combined_growth!r} must be a number from 0 to 1 (a power of the spread growth)")
        for name in ("duplicate_tolerance", "duplicate_cosine_tolerance"):
            if getattr(self, name) >= 1:
                raise ValueError(f"DetectorConfig.{name}={getattr(self, name)!r} must be < 1 (a relative difference: equality to rounding)")
        if isinstance(self.scale_quantile, bool) or not isinstance(self.scale_quantile, (int, float)) or not 0.5 <= self.scale_quantile < 1:
            raise ValueError(f"DetectorConfig.scale_quantile={self.scale_quantile!r} must be a number from 0.5 (the MAD alone) to below 1")
        if self.loss_scale not in ("log", "linear"):
            raise ValueError(f"DetectorConfig.loss_scale={self.loss_scale!r} must be 'log' or 'linear'")
        if self.recent > self.window:
            raise ValueError(f"DetectorConfig.recent={self.recent} must be <= window={self.window} (the recent steps are the window's last)")

    @classmethod
    def from_overrides(cls, items: list[str]) -> "DetectorConfig":
        """The defaults with ``NAME=VALUE`` items applied (``--set`` of ``ddphooks detect`` and of
        benchmarks/detection.py), each value read as its field's type; ``ValueError`` names the
        item and the valid names, or the field's own check.

        Example::
            >>> DetectorConfig.from_overrides(["threshold=25", "warmup=16"]).threshold
            25.0
        """
        types = {f.name: type(getattr(cls(), f.name)) for f in fields(cls)}
        values = {}
        for item in items:
            name, equals, text = item.partition("=")
            if name not in types or not equals or not text:
                raise ValueError(f"--set {item!r}: expected NAME=VALUE with NAME one of {', '.join(types)}")
            try:
                values[name] = types[name](text)
            except ValueError:
                raise ValueError(f"--set {item!r}: {text!r} is not a valid {types[name].__name__} (DetectorConfig.{name})") from None
        return cls(**values)


@dataclass
class Observation:
    """What the detector reads of one step (from a record dict or from ``SilentStats``)."""

    step: int
    world_size: int
    losses: np.ndarray | None  # W, NaN where unknown
    grad_norms: np.ndarray  # W
    cosine_loo: np.ndarray | None  # W, None without a sketch
    cosine_noise: float
    cosine_previous: np.ndarray | None = None  # W, None without a sketch or a comparable previous step
    replicas: dict | None = None
    parameter_names: list[str] | None = None
    parameter_norms: np.ndarray | None = None  # W x P (rows x P with parameter_rows), only where the step carries them
    parameter_rows: list[int] | None = None  # the ranks of parameter_norms' rows where not every rank's (the compact wire)
    parameter_mean_norms: np.ndarray | None = None  # P, with parameter_rows: each parameter's mean norm over all present ranks
    layer_levels: np.ndarray | None = None  # W, the compact wire: each rank's own layer CUSUM level (ddphooks.fleet.own_values), NaN: unknown
    layer_parameters: np.ndarray | None = None  # W, with layer_levels: the index of the parameter each level is that of
    nonfinite: dict | None = None  # a record's ``nonfinite``: ``losses`` (ranks), ``gradients`` ({rank, parameter, ...})
    absent: list[int] = field(default_factory=list)  # ranks that did not train on the step (joined under Join): all NaN

    @classmethod
    def from_record(cls, record: dict) -> "Observation":
        """From a record as the sinks receive it (compact or detailed). Raises ``ValueError`` for a
        compact record that summarises its per-rank signals over the ranks (``per_rank`` false:
        above ``per_rank_max_world``): the detector reads every rank's values."""
        world = int(record["world_size"])
        if record.get("per_rank") is False:
            raise ValueError(
                f"the record of step {record['step']} summarises its per-rank signals over the W = {world} ranks "
                f"(a compact record above per_rank_max_world); offline detection needs every rank's values in every "
                f"record: rerun with per_rank_max_world >= {world} (the online detector reads them whatever it is)"
            )

        def vector(key: str) -> np.ndarray | None:
            values = record.get(key)
            if values is None:
                return None
            return np.array([math.nan if v is None else float(v) for v in values], dtype=float)

        names = norms = rows = means = None
        parameters = record.get("parameters")
        key = "grad_norms_sampled" if record.get("sampled_ranks") is not None else "grad_norms"  # the compact wire: sampled ranks
        if parameters and all(key in p for p in parameters):
            names = [p["name"] for p in parameters]
            norms = np.array([[math.nan if v is None else v for v in p[key]] for p in parameters], dtype=float).T
            if key == "grad_norms_sampled":
                rows = list(record["sampled_ranks"])
                means = np.array([math.nan if p.get("grad_norm_mean") is None else p["grad_norm_mean"] for p in parameters], dtype=float)
        noise = record.get("cosine_noise")
        return cls(
            step=int(record["step"]),
            world_size=world,
            losses=vector("losses"),
            grad_norms=vector("grad_norms"),
            cosine_loo=vector("cosine_loo"),
            cosine_noise=math.nan if noise is None else float(noise),
            cosine_previous=vector("cosine_previous"),
            replicas=record.get("replicas"),
            parameter_names=names,
            parameter_norms=norms,
            parameter_rows=rows,
            parameter_mean_norms=means,
            layer_levels=vector("layer_levels"),
            layer_parameters=vector("layer_parameters"),
            nonfinite=record.get("nonfinite"),
            absent=list(record.get("absent") or []),
        )

    @classmethod
    def from_stats(cls, stats) -> "Observation":
        """From a live ``SilentStats`` (per-parameter norms of every step included: every rank's, or
        with the compact wire those of the step's sampled ranks)."""
        rows = stats.parameter_rows
        return cls(
            step=stats.step,
            world_size=stats.world_size,
            losses=stats.losses,
            grad_norms=stats.grad_norms,
            cosine_loo=stats.cosine_loo,
            cosine_noise=stats.cosine_noise,
            cosine_previous=stats.cosine_previous,
            replicas=stats.replicas,
            parameter_names=stats.parameter_names,
            parameter_norms=_present_norms(stats.param_sq, stats.absent) if rows is None else _present_norms(stats.sampled_param_sq, stats.absent[rows]),
            parameter_rows=rows,
            parameter_mean_norms=None if rows is None else stats.mean_param_norms,
            layer_levels=getattr(stats, "layer_scores", None),
            layer_parameters=getattr(stats, "layer_parameters", None),
            nonfinite=stats.nonfinite,
            absent=stats.absent_ranks,
        )


def _partial_layer_view(obs: Observation) -> bool:
    """Whether the step's layer evidence is the ranks' own layer levels: the compact wire sent
    them and its rows miss some rank. Where every rank is sampled on every step (W <=
    ``sampled_ranks``) the detector's own per-parameter CUSUMs see every rank from its first
    step, against the median rank (the levels' reference is the other ranks' mean, which one rank
    moves by 1 / (W - 1) of its own change), and it keeps them."""
    if obs.layer_levels is None or obs.parameter_rows is None:
        return False
    return len(set(obs.parameter_rows) | set(obs.absent)) < obs.world_size


def _present_norms(param_sq: np.ndarray, absent: np.ndarray) -> np.ndarray:
    """W x P norms from squared norms, NaN on absent ranks: ``np.where(absent[:, None], nan,
    sqrt(param_sq))`` without a second W x P pass where no rank is absent. In ``PARAMETER_DTYPE``,
    the precision of the slots they come from and of the arithmetic that reads them."""
    norms = np.sqrt(param_sq, dtype=PARAMETER_DTYPE)
    absent = np.asarray(absent, dtype=bool)
    if absent.any():
        norms[absent] = np.nan
    return norms


@dataclass
class _Episode:
    since: int
    quiet: int = 0


class _History:
    """Trailing values of ``signals`` signals over the last ``window`` steps: a ring buffer,
    ``data`` signals x W x window (each rank's steps of a signal side by side, so its quantiles
    need no transpose; ``next`` the slot of the next step), NaN where missing or excluded. Every
    statistic taken over a window is order-free but the growth's (its last steps: ``slots``).
    ``known`` and ``finite``: per signal and rank, how many of its values in the window are not
    NaN, and finite (kept as steps come and go, not counted over the window every step).
    ``spread``: with ``spreads``, each step's spread across ranks per signal, signals x window
    (see ``_spreads``), taken as the step is pushed: a pushed step never changes. ``steps_first``:
    with ``by_step``, the same values signals x window x W (each step's ranks side by side, for
    statistics across ranks: written as the step is pushed, not transposed every step)."""

    def __init__(self, window: int, world: int, signals: int = 1, spreads: bool = False, by_step: bool = False) -> None:
        self.window, self.world = window, world
        self.data = np.full((signals, world, window), np.nan)
        self.steps_first = np.full((signals, window, world), np.nan) if by_step else None
        self.known = np.zeros((signals, world), dtype=np.int64)
        self.finite = np.zeros((signals, world), dtype=np.int64)
        self.spread = np.full((signals, window), np.nan) if spreads else None
        self.next = 0

    def push(self, rows: np.ndarray, keep: np.ndarray, hold: np.ndarray | None = None) -> None:
        """One step: ``rows`` signals x W (W for one signal), ranks not in ``keep`` as NaN, or,
        where ``hold`` (signals x W) too, as the value their slot already holds: that rank's
        window stays as it was, so its baseline neither learns the step nor ages out; its
        ``steps_first`` (each step's ranks, for the spread across them) gets the step's value, so
        that a spread that grows on every rank is seen even while every rank is held."""
        leaving = self.data[:, :, self.next]
        kept = np.where(keep, rows, np.nan if hold is None else np.where(hold, leaving, np.nan)).reshape(len(self.data), self.world)
        across = kept if hold is None else np.where(keep | hold, rows, np.nan).reshape(len(self.data), self.world)
        self.known += np.isnan(leaving)  # minus the leaving step's known values, plus the new one's
        self.known -= np.isnan(kept)
        self.finite -= np.isfinite(leaving)
        self.finite += np.isfinite(kept)
        self.data[:, :, self.next] = kept
        if self.steps_first is not None:
            self.steps_first[:, self.next] = across
        if self.spread is not None:
            self.spread[:, self.next] = _spreads(kept)
        self.next = (self.next + 1) % self.window

    def clear(self, signal: int) -> None:
        """Forget one signal's steps (the loss's, when its scale changes: see ``_loss_scale``)."""
        self.data[signal] = np.nan
        self.known[signal] = self.finite[signal] = 0
        if self.steps_first is not None:
            self.steps_first[signal] = np.nan
        if self.spread is not None:
            self.spread[signal] = np.nan

    def slots(self, last: int) -> np.ndarray:
        """The slots of the last ``last`` steps, oldest first."""
        return (self.next - last + np.arange(last)) % self.window

    def steps(self, signal: int = 0) -> np.ndarray:
        """One signal's window, steps x W, oldest first (a copy)."""
        return self.data[signal][:, self.slots(self.window)].T


@dataclass
class _Signal:
    """One signal of a ``_History``: ``values``, its window as steps x W, oldest first (a copy)."""

    history: _History
    index: int

    @property
    def values(self) -> np.ndarray:
        return self.history.steps(self.index)


def _column_quantiles(values: np.ndarray, q: float) -> np.ndarray:
    """The ``q`` quantile of each column of a 2-D array (linear interpolation between the two
    nearest values, as ``np.nanquantile``), ignoring NaN (NaN for an all-NaN column).

    One sort instead of ``np.nanquantile``, whose masked-array path costs a millisecond a call on
    the small arrays the detector has (the detector runs on every step of every rank). For rows,
    and for long columns, ``_sorted_quantiles`` and ``_select_quantiles`` give the same numbers.
    """
    ordered = np.sort(values, axis=0)  # NaN sorts last
    count = np.sum(~np.isnan(values), axis=0)
    return _sorted_quantiles(ordered.T, count, q)


def _sorted_quantiles(ordered: np.ndarray, count: np.ndarray, q: float) -> np.ndarray:
    """The ``q`` quantile of each row of ``ordered`` (rows sorted, NaN last), of whose values
    ``count`` per row are known: ``_column_quantiles`` on rows (several quantiles from one sort)."""
    rows = np.arange(ordered.shape[0])
    position = q * np.maximum(count - 1, 0)
    low = np.floor(position).astype(int)
    high = np.minimum(low + 1, np.maximum(count - 1, 0))
    with np.errstate(invalid="ignore"):
        quantile = ordered[rows, low] + (position - low) * (ordered[rows, high] - ordered[rows, low])
    return np.where(count > 0, quantile, np.nan)


def _select_quantiles(work: np.ndarray, q: float, count: np.ndarray | None = None) -> np.ndarray:
    """The ``q`` quantile of each row of ``work`` (rows x n, C-contiguous), ignoring NaN: the same
    numbers as ``_column_quantiles(work.T, q)``, the two order statistics it interpolates found
    by a selection (``np.partition``, O(n)) instead of a sort, per number of known values a row
    has (one or a few). Reorders each row of ``work`` in place (its values stay in it).
    ``count``: how many values each row has that are not NaN, where the caller knows it (no
    pass to count them)."""
    rows, n = work.shape
    if count is None:
        count = n - np.count_nonzero(np.isnan(work), axis=1)
    result = np.full(rows, np.nan, dtype=np.result_type(work, np.float32))  # float32 stays float32
    for known in np.unique(count).tolist():
        if known == 0:
            continue
        select = count == known
        block = work if select.all() else work[select]  # the few rows with another count: a copy
        position = q * (known - 1)
        low = math.floor(position)
        high = min(low + 1, known - 1)
        block.partition(high, axis=1)  # NaN sorts last: the known values come first
        upper = block[:, high]
        lower = block[:, :high].max(axis=1) if high > low else upper  # the low-th: the largest before
        with np.errstate(invalid="ignore"):
            result[select] = lower + (position - low) * (upper - lower)
    return result


#: Rows copied at a time by ``_transposed``.
TRANSPOSE_BLOCK = 256


def _transposed(values: np.ndarray, ufunc: np.ufunc | None = None) -> np.ndarray:
    """A C-ordered copy of ``values.T`` (2-D; with ``ufunc``, of ``ufunc(values).T``), copied a
    block of rows at a time: a plain copy of a transpose reads memory a row apart for every
    element, three times slower on a W x P array (4096 x 273)."""
    out = np.empty(values.shape[::-1], dtype=values.dtype)
    for start in range(0, values.shape[0], TRANSPOSE_BLOCK):
        block = values[start : start + TRANSPOSE_BLOCK].T
        if ufunc is None:
            out[:, start : start + TRANSPOSE_BLOCK] = block
        else:
            ufunc(block, out=out[:, start : start + TRANSPOSE_BLOCK])
    return out


def _spreads(work: np.ndarray, infinite: bool = True) -> np.ndarray:
    """Per row (a signal on a step, across W ranks), its MAD, ignoring NaN: the spread that
    ``_growth`` compares. ``work`` (rows x W, C-contiguous) is overwritten. ``infinite=False``:
    the caller knows ``work`` holds no infinity (the distances to the median are NaN where the
    values are: not counted again)."""
    count = len(work[0]) - np.count_nonzero(np.isnan(work), axis=1) if len(work) else None
    median = _select_quantiles(work, 0.5, count)
    with np.errstate(invalid="ignore"):
        np.abs(work - median[:, None], out=work)  # each row's values, in another order: the same multiset
    return _select_quantiles(work, 0.5, None if infinite else count)


def _column_medians(values: np.ndarray) -> np.ndarray:
    """Median of each column of a 2-D array, ignoring NaN (NaN for an all-NaN column)."""
    return _column_quantiles(values, 0.5)


def _robust(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of a 2-D array, the median and ``1.4826 * MAD``, ignoring NaN. With
    ``_shoulders`` and ``_growth``, the definition of the baselines: the detector computes the
    same numbers from its ring buffers (``Detector._own_baselines``, ``_cross_baselines``;
    tests/test_detect_scale.py compares them step by step)."""
    median = _column_medians(values)
    mad = _column_medians(np.abs(values - median))
    return median, MAD_TO_STD * np.nan_to_num(mad, nan=0.0)


def _typical_shoulder(per_rank: np.ndarray, quantile: float) -> np.ndarray:
    """From each rank's ``quantile`` of its absolute deviations (signals x W), the standard
    deviation ``_shoulders`` returns: the median rank's (the smaller at W = 2) over a normal's."""
    # No majority at W = 2: the smaller of the two, as the rank that is off raises its own.
    typical = _column_medians(per_rank.T) if per_rank.shape[1] >= 3 else np.fmin(per_rank[:, 0], per_rank[:, 1])
    return np.nan_to_num(typical, nan=0.0) / NormalDist().inv_cdf(0.5 + quantile / 2)


def _shoulders(values: np.ndarray, center: np.ndarray, quantile: float) -> np.ndarray:
    """Per signal, a standard deviation from the shoulders of its noise (see
    ``DetectorConfig.scale_quantile``): each rank's ``quantile`` of ``|value - center|`` over the
    window, over a normal's, and of those the median rank's, which the one rank that is off
    cannot move (W >= 3; the smaller at W = 2). ``values`` is signals x steps x W, ``center`` signals x W (or x 1);
    zeros at ``quantile`` 0.5 (the MAD alone)."""
    signals, steps, world = values.shape
    if quantile <= 0.5:
        return np.zeros(signals)
    distance = np.abs(values - center[:, None, :]).transpose(1, 0, 2).reshape(steps, signals * world)
    return _typical_shoulder(_column_quantiles(distance, quantile).reshape(signals, world), quantile)


def _growth_ratio(per_step: np.ndarray, recent: np.ndarray) -> np.ndarray:
    """Per signal, the median of its ``recent`` steps' spreads (``per_step`` signals x steps;
    ``recent`` the indices of those steps) over the median of all, never below 1."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = _column_medians(per_step[:, recent].T) / _column_medians(per_step.T)
    return np.fmax(1.0, np.nan_to_num(ratio, nan=1.0, posinf=1.0))


def _growth(deviations: np.ndarray, recent: int) -> np.ndarray:
    """How much the spread across ranks grew lately, per signal (W >= 3). ``deviations`` is
    signals x steps x W; each step's spread is its MAD across ranks, which the one rank that is
    off cannot move (at W = 3 it is the smaller of the two gaps to the middle rank); the result is
    the median of the last ``recent`` steps' spreads over the median of all, never below 1 (a
    spread that shrinks keeps the window's scale)."""
    signals, steps, world = deviations.shape
    per_step = _spreads(np.array(deviations, dtype=float).reshape(signals * steps, world)).reshape(signals, steps)
    return _growth_ratio(per_step, np.arange(max(steps - recent, 0), steps))


def _relative_to_median(log_norms: np.ndarray) -> np.ndarray:
    """Each rank's log gradient norm minus the median rank's (the level CUSUM's reading): the
    schedule's and the training phase's trend, shared by every rank, cancels on every step, and
    the one rank that is off cannot move the median (against the mean, a rank's doubled gradient
    would lower every other rank's relative norm by log(2) / W). Unknown (NaN) and zero (-inf)
    norms stay as they are, out of the median."""
    finite = log_norms[np.isfinite(log_norms)]
    return log_norms - np.median(finite) if finite.size else np.full(len(log_norms), np.nan)


def _nan_to_zero(z: np.ndarray) -> np.ndarray:
    """A score with unknown (NaN) entries scoring zero: ``np.nan_to_num(z, nan=0.0)`` for the
    scores here, which are finite or NaN (non-finite inputs are NaN, scales are floored above
    zero), at a fraction of its cost (it also looks for infinities, on every signal of every step)."""
    return np.where(np.isnan(z), 0.0, z)


def _fisher(cosine: np.ndarray) -> np.ndarray:
    """Fisher's ``atanh`` of a cosine: a rank whose gradient repeats lands near 1, where a sketched
    cosine's error shrinks (about ``(1 - c^2) / sqrt(k)``); on this scale it is about the same
    everywhere, so 0.6 -> 0.9 counts for what it is, far more than 0.0 -> 0.3."""
    return np.arctanh(np.clip(cosine, -0.999, 0.999))


def _sides(change: np.ndarray, direction: int) -> list[np.ndarray]:
    """The suspicious parts of a change, each accumulated apart: itself (+1, a rise), its negative
    (-1, a drop), or both (0: a rise and a drop, never their sum or size)."""
    return [change, -change] if direction == 0 else [direction * change]


def _others_change(z: np.ndarray) -> np.ndarray:
    """Per rank, the other ranks' change: the largest at W = 2 (there is one), the median at
    W >= 3; O(W log W) from one sort, not one median per rank."""
    world = len(z)
    if world < 2:
        return np.zeros(world)
    if world == 2:
        return z[::-1].copy()
    order = np.argsort(z, kind="stable")
    position = np.empty(world, dtype=int)
    position[order] = np.arange(world)
    ranked = z[order]
    # The median of the W - 1 others: middle positions of the sorted list with one entry removed.
    count = world - 1
    low, high = (count - 1) // 2, count // 2

    def pick(k: int) -> np.ndarray:  # the k-th smallest of the others, for every rank at once
        return np.where(position <= k, ranked[min(k + 1, world - 1)], ranked[k])

    return 0.5 * (pick(low) + pick(high))


def _relative_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b| / max(|a|, |b|)``, 0 where ``a == b`` (two zeros included)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(a == b, 0.0, np.abs(a - b) / np.maximum(np.abs(a), np.abs(b)))


def _duplicate_groups(
    losses: np.ndarray | None, norms: np.ndarray, cosines: np.ndarray | None, tolerance: float, cosine_tolerance: float
) -> tuple[np.ndarray, bool]:
    """Per rank, the lowest rank of its duplicate group on this step (-1 outside any), and whether
    more than the gradient norms were compared (see the module docstring).

    O(W log W): sorted by loss, the ranks fall into pieces of losses that agree neighbour to
    neighbour; each piece sorted by gradient norm, neighbours are linked where they agree in every
    known quantity. Links only join neighbours of that order, so a group is a run of links in it.
    """
    world = len(norms)
    labels = np.full(world, -1)
    valid = np.isfinite(norms) & (norms > 0)  # a zero gradient computes nothing, not the same thing
    use_loss = losses is not None and bool(np.isfinite(losses).any())
    if use_loss:
        valid &= np.isfinite(losses)
    known_cosines = cosines is not None and bool(np.isfinite(cosines[valid]).any())
    ranks = np.flatnonzero(valid)
    if len(ranks) < 2:
        return labels, use_loss or known_cosines
    loss = losses[ranks] if use_loss else np.zeros(len(ranks))
    order = np.argsort(loss, kind="stable")
    pieces = np.empty(len(ranks), dtype=int)
    pieces[order] = np.concatenate([[0], np.cumsum(_relative_difference(loss[order][1:], loss[order][:-1]) > tolerance)])
    order = np.lexsort((norms[ranks], pieces))  # by piece, then by gradient norm
    first, second = ranks[order][:-1], ranks[order][1:]
    link = (pieces[order][1:] == pieces[order][:-1]) & (_relative_difference(norms[first], norms[second]) <= tolerance)
    if use_loss:
        link &= _relative_difference(losses[first], losses[second]) <= tolerance
    if known_cosines:
        gap = np.abs(cosines[first] - cosines[second])
        link &= ~(gap > cosine_tolerance)  # compared where both are known
    if not link.any():
        return labels, use_loss or known_cosines
    segment = np.concatenate([[0], np.cumsum(~link)])  # per position in `order`: its run of links
    sizes = np.bincount(segment)
    lowest = np.full(len(sizes), world)
    np.minimum.at(lowest, segment, ranks[order])
    grouped = sizes[segment] >= 2
    labels[ranks[order][grouped]] = lowest[segment][grouped]
    if known_cosines and len(sizes) == 1 and len(ranks) == world:
        # Every rank in one group: each one's gradient is the sum of the others' direction.
        if np.nanmin(cosines) < 1 - cosine_tolerance:
            labels[:] = -1
    return labels, use_loss or known_cosines


class Detector:
    """Online detector over step observations; see the module docstring for the method.

    Args:
        config: thresholds (``DetectorConfig()`` by default).
        keep_scores: keep each step's scores per CUSUM, rank and part (``step_scores``) and the
            CUSUM behind each statistical alert (``fired``), for ``benchmarks/detection.py``.

    Example::
        >>> detector = Detector()
        >>> alerts = detector.update(Observation.from_record(record))
    """

    def __init__(self, config: DetectorConfig | None = None, keep_scores: bool = False) -> None:
        self.config = config or DetectorConfig()
        self.world: int | None = None
        self.seen = 0
        self.alerts: list[dict] = []
        # For the benchmarks (the per-step separation d' of the signal that fired, the best CUSUM
        # over the same scores): each step's scores per CUSUM key (W x parts, before the cap), and
        # the key and part (the parameter, or the direction) behind each statistical alert.
        self.step_scores: dict[tuple[str, str], np.ndarray] | None = {} if keep_scores else None
        self.fired: list[tuple[int, int, tuple[str, str], int]] = []  # (step, rank, key, the part that crossed)

    def _start(self, world: int) -> None:
        window = self.config.window
        self.world = world
        # Own-history values and deviations from the others, every signal in one window each
        # (signals x W x window); raw and cross: each signal's, as steps x W (``values``).
        # One more row after the signals': the level CUSUM's relative log gradient norms, learned
        # only while that CUSUM is at zero (see update); its baselines come from the same sorts.
        self.own_history = _History(window, world, len(SIGNALS) + 1, by_step=world >= 3)
        self.cross_history = _History(window, world, len(SIGNALS), spreads=True)
        self.raw = {name: _Signal(self.own_history, index) for index, name in enumerate(SIGNALS)}
        self.level = _Signal(self.own_history, LEVEL_ROW)
        self.cross = {name: _Signal(self.cross_history, index) for index, name in enumerate(SIGNALS)}
        # At W = 2 only: the losses themselves (which of the two ranks' loss moved, see _scores), and
        # the last steps' mean log gradient norm of the pair with their step numbers (which rank a
        # split of the pair's norms belongs to, see _pair_owner), the same per parameter with the
        # parameters' names (which rank a layer's split belongs to, see _changed_itself); the rank
        # the level's evidence was given to, while its episode lasts.
        self.pair_history = _History(window, world) if world == 2 else None
        self.pair_means: deque = deque(maxlen=PAIR_STEPS * window)
        self.pair_parameter_means: deque = deque(maxlen=PAIR_STEPS * window)
        self.mirror_since: dict[tuple, int] = {}  # (rank, key) of evidence taken for the other rank's mirror -> when it began
        self.level_owner: int | None = None
        self.log_losses = self.config.loss_scale == "log"  # until a loss <= 0 (see _loss_scale)
        self.cusum = {(kind, name): np.zeros(world) for kind in ("own", "cross") for name in SIGNALS}
        if world >= 3:
            self.cusum[("cross", "combined")] = np.zeros(world)
        else:
            self.cusum[("own", "combined")] = np.zeros(world)
        self.cusum[("own", "layer")] = np.zeros(world)
        self.cusum[LEVEL] = np.zeros(world)
        self.rising_since = {key: np.full(world, -1) for key in self.cusum}
        self.parts: dict[tuple[str, str], np.ndarray] = {}  # key -> W x parts CUSUMs (see _accumulate)
        # key -> W x parts: the step each part last started rising (read only where it is above 0:
        # its rising since, -1 elsewhere; see _accumulate).
        self.parts_start: dict[tuple[str, str], np.ndarray] = {}
        config = self.config
        # Per CUSUM: its allowance, the cap on one step's score, and its alert level.
        self.allowance = {key: config.drift for key in self.cusum}
        self.cap = {key: config.step_cap for key in self.cusum}
        self.limit = {key: config.threshold * config.alert_level for key in self.cusum}
        repeat = ("cross", "cosine_previous")
        self.allowance[repeat], self.cap[repeat], self.limit[repeat] = config.repeat_drift, config.repeat_cap, config.repeat_threshold * config.alert_level
        if world == 2:  # the same rise scores about half as much with two ranks (see pair_repeat_drift)
            self.allowance[repeat] = config.pair_repeat_drift
        if world >= 3:  # terms capped one by one: combined_cap; repeat_cap and repeat_loss_cap (in _scores)
            self.allowance[("cross", "combined")], self.cap[("cross", "combined")] = config.combined_drift, math.inf
            self.cap[repeat] = math.inf
        else:
            self.allowance[("own", "combined")], self.cap[("own", "combined")] = config.pair_combined_drift, math.inf
        self.allowance[LEVEL], self.cap[LEVEL], self.limit[LEVEL] = config.level_drift, config.level_cap, config.level_threshold * config.alert_level
        self.allowance[("own", "layer")] = config.layer_drift
        self.cap[("own", "layer")] = config.layer_cap
        self.limit[("own", "layer")] = config.layer_threshold * config.alert_level
        self.episodes: dict[int, _Episode] = {}
        self.replica_episodes: set[int] = set()
        self.nonfinite_first: dict[int, dict] = {}  # rank -> what went non-finite on the last step, the others finite
        self.nonfinite_episodes: dict[int, int] = {}  # rank under a nonfinite alert -> finite steps since
        # The last steps' duplicate groups: (step, labels, strong, losses, grad norms, cosines);
        # strong: more than the gradient norms compared (see _duplicate_alerts).
        self.duplicate_history: deque = deque(maxlen=2 * self.config.duplicate_steps)
        self.duplicate_episodes: dict[int, int] = {}  # rank under a duplicate_data alert -> steps in no group since
        self.parameter_level: np.ndarray | None = None  # W x P exponential averages of log|g_{i,p}|
        self.parameter_scale: np.ndarray | None = None  # standard deviations of their rises, 1 x P (W = 2: W x P; see _learn_parameters)
        self.parameter_change: np.ndarray | None = None  # this step's W x P change (see _parameter_changes)
        self.parameter_rows: np.ndarray | None = None  # the ranks of parameter_change's rows, where not every rank's
        self.parameter_names: list[str] | None = None

    # -- the step ------------------------------------------------------------------------------
    def update(self, obs: Observation) -> list[dict]:
        """Read one step; return the alerts it raises (also appended to ``self.alerts``)."""
        if obs.world_size - len(obs.absent) < 2:
            return []  # nothing to compare (ranks that joined under Join are absent, not zero)
        if self.world != obs.world_size:
            self._start(obs.world_size)
        if self.step_scores is not None:
            self.step_scores.clear()
        # Non-finite values are unknown here, as in a record (null) read offline; _nonfinite_alerts
        # reports them.
        losses = np.where(np.isfinite(obs.losses), obs.losses, np.nan) if obs.losses is not None else np.full(obs.world_size, np.nan)
        losses = self._loss_scale(losses)  # from here on as the loss signal reads them (log or linear)
        with np.errstate(divide="ignore"):
            log_norms = np.log(np.where(np.isfinite(obs.grad_norms), obs.grad_norms, np.nan))
        values = self._values(obs, losses, log_norms)
        relative_norms = _relative_to_median(log_norms)
        if self.world == 2:
            self.pair_means.append((obs.step, float(np.mean(log_norms))))  # NaN where either is unknown
            if obs.parameter_norms is not None and obs.parameter_rows is None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    logs = np.log(np.where(np.isfinite(obs.parameter_norms) & (obs.parameter_norms > 0), obs.parameter_norms, np.nan))
                self.pair_parameter_means.append((obs.step, obs.parameter_names, logs.mean(axis=0)))
        deviations = self._deviations(values)
        self._parameter_changes(obs)
        # No scores before the baselines hold `warmup` steps: a median of three steps is no baseline.
        scores = self._scores(values, deviations, losses, log_norms, relative_norms, obs.cosine_noise) if self.seen >= self.config.warmup else {}
        alerts = self._replica_alerts(obs) + self._nonfinite_alerts(obs) + self._duplicate_alerts(obs)
        # The level CUSUM's baseline learns a rank's step only if that CUSUM was at zero before it:
        # a lasting shift of a few standard deviations is never learned as the new normal, while
        # a healthy step, independent of the steps before it, is kept or left out by chance alone.
        level = self.parts.get(LEVEL)
        level_quiet = np.ones(self.world, dtype=bool) if level is None else ~(level > 0).any(axis=1)
        alerts += self._score_alerts(obs, scores, values)
        # A rank with half the evidence of an alert (or under alert) does not teach the baselines:
        # otherwise a lasting fault becomes the new normal before it is reported.
        # At W = 2 the level's evidence is the pair's split, as much the other rank's as this one's
        # until it alerts (_pair_owner): it does not make either rank suspect, or the healthy rank's
        # baselines would age out under it and score its next steps against a few (its own
        # level baseline is held by level_quiet either way).
        suspect = self.evidence(without=LEVEL if self.world == 2 else None) > 0.5
        suspect[list(self.episodes)] = True
        if self.pair_history is not None:
            self.pair_history.push(losses, ~suspect)
        keep = np.repeat(~suspect[None], len(SIGNALS) + 1, axis=0)
        keep[LEVEL_ROW] &= level_quiet
        # The level's baseline is held while the rank is left out of it, not aged out: read
        # against the median rank, a trend cancels, so an old baseline stays valid, and a shift
        # too small to alert within a window would otherwise outlive its baseline, score nothing
        # and be learned as the new normal once the CUSUM drained. A spread that grows on every
        # rank (early training) still grows the level's scale: the spread across ranks reads
        # every rank's step, held ones too (_History.push). The other signals' trends do not
        # cancel: their baselines age out as before.
        hold = np.zeros_like(keep)
        hold[LEVEL_ROW] = True
        self.own_history.push(np.stack([values[name] for name in SIGNALS] + [relative_norms]), keep, hold)
        unknown = np.full(self.world, np.nan)  # a signal not compared across ranks (W = 2)
        self.cross_history.push(np.stack([deviations.get(name, unknown) for name in SIGNALS]), ~suspect)
        self.seen += 1
        self._learn_parameters(obs, suspect)
        self.alerts.extend(alerts)
        return alerts

    def _values(self, obs: Observation, losses: np.ndarray, log_norms: np.ndarray) -> dict[str, np.ndarray]:
        nan = np.full(obs.world_size, np.nan)
        # The mean of the known losses without np.nanmean, whose warning for an all-NaN step would
        # need warnings.catch_warnings: that swaps the process-wide filters, and the detector runs
        # on the pipeline thread while training code may set its own.
        known = losses[~np.isnan(losses)]
        with np.errstate(divide="ignore", invalid="ignore"):
            # The loss relative to the step's mean loss: the run's downward trend cancels, and a
            # rank whose loss rises stands out from its own history even at W = 2.
            return {
                "loss": losses - known.mean() if known.size else nan,
                "grad_norm": log_norms,  # its own trend is the others' (see _others_change)
                "cosine": obs.cosine_loo if obs.cosine_loo is not None else nan,
                "cosine_previous": _fisher(obs.cosine_previous) if obs.cosine_previous is not None else nan,
            }

    def _loss_scale(self, losses: np.ndarray) -> np.ndarray:
        """The losses on the scale the loss signal reads them (``DetectorConfig.loss_scale``): their
        logs while every loss seen was positive, the losses themselves from the first step with
        a loss <= 0 on (a loss that may be negative: an ELBO, a GAN's, a policy objective), when
        the loss baselines start afresh rather than mix the two scales."""
        if self.log_losses and (losses <= 0).any():
            self.log_losses = False
            loss = SIGNALS.index("loss")
            for history, signal in ((self.own_history, loss), (self.cross_history, loss), (self.pair_history, 0)):
                if history is not None:
                    history.clear(signal)
        if not self.log_losses:
            return losses
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(losses)

    @staticmethod
    def _deviations(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # From the median of all ranks, the rank itself included: at W = 3 the median of the
        # *other* two would be pulled halfway to a faulty rank, making the healthy ones look off.
        # At W = 2 the two deviations are opposite: only a signal where one direction is the
        # suspicious one (a rise of the cosine to the previous step) can say which rank it is.
        world = len(values["loss"])
        return {
            name: row - _column_medians(row[:, None])[0]
            for name, row in values.items()
            if world >= 3 or CROSS_DIRECTION[name] > 0
        }

    def _scores(self, values: dict, deviations: dict, losses: np.ndarray, log_norms: np.ndarray, relative_norms: np.ndarray, cosine_noise: float) -> dict[tuple[str, str], np.ndarray]:
        """Per (kind, signal), every rank's z-scores for this step (>= 0, W x parts): one part for
        a signal suspicious in one direction, two (its rise, its fall) for one suspicious either way,
        one per parameter for the layers."""
        noise = cosine_noise if math.isfinite(cosine_noise) else 0.0
        floors = {name: max(noise, 1e-3) if name in SKETCHED else 1e-3 for name in SIGNALS}
        ignored = self.config.cosine_floor * noise  # a sketched change below this is the sketch's noise
        scores = {}
        combined_terms = []
        loss_fall = np.zeros(self.world)  # how far each rank's loss fell below the median rank's (W >= 3)
        # Baselines in batched sorts (per kind, over every signal and rank at once), since the
        # detector runs on every step of every rank; the scales grow with the recent spread (see the
        # module docstring).
        own_median, own_scale = self._own_baselines()
        crossed = [name for name in SIGNALS if name in deviations]
        if crossed:
            cross_median, cross_scale, growth = self._cross_baselines([SIGNALS.index(name) for name in crossed])
            combined_scale = cross_scale * growth**self.config.combined_growth
            cross_scale = cross_scale * growth
        for index, name in enumerate(SIGNALS):
            # Own history: the rank's change against its trailing median, minus the others' change.
            median, scale = own_median[index], np.maximum(own_scale[index], floors[name])
            change = values[name] - median
            if name in SKETCHED:
                change = np.where(np.abs(change) < ignored, 0.0, change)
            sides = [_nan_to_zero(side / scale) for side in _sides(change, OWN_DIRECTION[name])]
            scores[("own", name)] = np.stack([np.maximum(z - _others_change(np.maximum(z, 0.0)), 0.0) for z in sides], axis=1)
            if name in deviations:
                position = crossed.index(name)
                median, scale = cross_median[position], max(cross_scale[position], floors[name])
                gap = deviations[name] - median
                if name in SKETCHED:
                    gap = np.where(np.abs(gap) < ignored, 0.0, gap)
                sides = [_nan_to_zero(side / scale) for side in _sides(gap, CROSS_DIRECTION[name])]
                scores[("cross", name)] = np.maximum(np.stack(sides, axis=1), 0.0)
                if self.world >= 3:
                    z = _nan_to_zero(gap / max(combined_scale[position], floors[name]))
                    combined_terms.append(np.clip(COMBINED_DIRECTION[name] * z, 0.0, self.config.combined_cap))
                    if name == "loss":
                        loss_fall = np.clip(-z, 0.0, self.config.repeat_loss_cap)
        if combined_terms:
            scores[("cross", "combined")] = sum(combined_terms)[:, None]
        repeat = ("cross", "cosine_previous")
        if self.world >= 3 and repeat in scores:
            # Repeating data: the gradient repeats and the loss falls below the others' (the rank
            # memorises the batch it keeps seeing); each term capped apart (see repeat_loss_cap).
            # The loss counts only on steps whose cosine rose: a rank with easier data, its loss
            # alone lower, never passes for one whose gradient repeats.
            raised = scores[repeat] > 0
            scores[repeat] = np.minimum(scores[repeat], self.config.repeat_cap) + np.where(raised, loss_fall[:, None], 0.0)
        # The level: the rank's log gradient norm relative to the median rank's, against its own
        # median, both ways (the second part, a fall); learned while the level CUSUM is at zero.
        z = _nan_to_zero((relative_norms - own_median[LEVEL_ROW]) / np.maximum(own_scale[LEVEL_ROW], floors["grad_norm"]))
        scores[LEVEL] = np.maximum(np.stack([z, -z], axis=1), -self.config.level_cap)
        if self.world == 2:
            # With two ranks a loss relative to the step's mean rises on one rank exactly as much as
            # it falls on the other: it counts only for the rank whose own loss moved the more
            # against its trailing median (a rank given easier data, or memorising a batch it keeps
            # seeing, does not get the other rank named).
            moved = np.abs(_nan_to_zero(losses - _column_medians(self.pair_history.steps())))
            scores[("own", "loss")] = np.where((moved >= moved[::-1])[:, None], scores[("own", "loss")], 0.0)
            # So does the level, but a step's own moves are no guide to which rank's norm split
            # from the other's: a shared trend moves both more than a lasting x1.5 does. The
            # pair's split accumulates on both (a rise of one is the fall of the other, one CUSUM
            # in two mirrors) and is given to one rank when it alerts (_pair_owner), the mirror's
            # then left out while that rank's episode lasts.
            if self.level_owner is not None:
                scores[LEVEL][1 - self.level_owner] = 0.0
            # Several signals at once against the rank's own history: each own score's first part is
            # its change in COMBINED_DIRECTION (a rise; a drop for the cosine), capped one by one.
            scores[("own", "combined")] = sum(np.minimum(scores[("own", name)][:, :1], self.config.combined_cap) for name in SIGNALS)
        if self.parameter_change is not None:
            # Per rank and parameter, in standard deviations; accumulated per parameter in _score_alerts.
            scores[("own", "layer")] = self.parameter_change
        return scores

    def _own_baselines(self) -> tuple[np.ndarray, np.ndarray]:
        """Per signal and rank (signals x W), the median of its own window and its scale: ``_robust``
        and ``_shoulders`` over the window, grown by ``_growth`` at W >= 3 (see the module
        docstring); the median NaN where the window holds fewer than ``MIN_BASELINE_STEPS`` steps.
        One sort of each rank's steps, one of their distances to its median (the MAD and the
        shoulders' quantile both from it), and two selections per step across ranks."""
        quantile, history = self.config.scale_quantile, self.own_history
        signals, world, steps = history.data.shape
        rows = history.data.reshape(signals * world, steps)  # one row per signal and rank
        count = history.known.reshape(-1)
        median = _sorted_quantiles(np.sort(rows, axis=1), count, 0.5)
        with np.errstate(invalid="ignore"):
            distance = np.abs(rows - median[:, None])
        ordered = np.sort(distance, axis=1)
        infinite = not np.array_equal(history.known, history.finite)  # inf - inf: a NaN distance
        if infinite:
            count = steps - np.count_nonzero(np.isnan(distance), axis=1)
        scale = MAD_TO_STD * np.nan_to_num(_sorted_quantiles(ordered, count, 0.5), nan=0.0)
        median, scale = median.reshape(signals, world), scale.reshape(signals, world)
        if quantile > 0.5:
            scale = np.maximum(scale, _typical_shoulder(_sorted_quantiles(ordered, count, quantile).reshape(signals, world), quantile)[:, None])
        median[history.finite < MIN_BASELINE_STEPS] = np.nan  # no baseline: no score
        if world >= 3:  # at W = 2 the spread across ranks is the gap that the rank that is off makes
            with np.errstate(invalid="ignore"):
                # One row per signal and step; float32, as the per-parameter arithmetic: the
                # spreads' ratio needs no more, and the window's selections cost half as much.
                work = np.subtract(history.steps_first, median[:, None, :], dtype=np.float32)
            per_step = _spreads(work.reshape(signals * steps, world), infinite).reshape(signals, steps)
            scale = scale * _growth_ratio(per_step, history.slots(self.config.recent))[:, None]
        return median, scale

    def _cross_baselines(self, crossed: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | float]:
        """Per signal compared across ranks (indices ``crossed`` into SIGNALS), the median and scale
        of the deviations of every rank and step in the window, pooled over ranks (healthy ranks
        are exchangeable; ``_robust`` and ``_shoulders``), and the growth of their spread across
        ranks (W >= 3, else 1.0; each step's spread taken as the step was pushed)."""
        quantile, history = self.config.scale_quantile, self.cross_history
        data = history.data if len(crossed) == len(history.data) else history.data[crossed]
        signals, world, steps = data.shape
        known, finite = history.known[crossed], history.finite[crossed]
        infinite = not np.array_equal(known, finite)  # inf - inf: a NaN distance
        values = data.reshape(signals, world * steps)
        median = _select_quantiles(values.copy(), 0.5, known.sum(axis=1))
        with np.errstate(invalid="ignore"):
            distance = np.abs(values - median[:, None])
        scale = MAD_TO_STD * np.nan_to_num(_select_quantiles(distance.copy(), 0.5, None if infinite else known.sum(axis=1)), nan=0.0)
        if quantile > 0.5:
            rows = distance.reshape(signals * world, steps)  # each rank's steps
            count = steps - np.count_nonzero(np.isnan(rows), axis=1) if infinite else known.reshape(-1)
            per_rank = _sorted_quantiles(np.sort(rows, axis=1), count, quantile).reshape(signals, world)
            scale = np.maximum(scale, _typical_shoulder(per_rank, quantile))
        median[finite.sum(axis=1) < MIN_BASELINE_STEPS] = np.nan
        growth = _growth_ratio(history.spread[crossed], history.slots(self.config.recent)) if world >= 3 else 1.0
        return median, scale, growth

    # -- alerts ----------------------------------------------------------------------------------
    def _score_alerts(self, obs: Observation, scores: dict, values: dict) -> list[dict]:
        config = self.config
        if _partial_layer_view(obs):  # the compact wire above sampled_ranks: every rank ran its layer CUSUM itself
            scores.pop(("own", "layer"), None)
            self._take_layer_levels(obs)
        for key, z in scores.items():
            self._accumulate(key, z, obs.step, self.parameter_rows if key == ("own", "layer") else None)
        alerts = []
        # Only ranks over their alert level or in an episode need a look (a few, not W).
        for rank in sorted(set(np.flatnonzero(self.evidence() > 1).tolist()) | set(self.episodes)):
            levels = {key: self.cusum[key][rank] for key in self.cusum}
            strength = {key: level / self.limit[key] for key, level in levels.items()}
            strongest = max(strength, key=strength.get)
            episode = self.episodes.get(rank)
            if strength[strongest] > 1:
                since, reading = int(self.rising_since[strongest][rank]), ""
                if strongest == LEVEL and self.world == 2 and self.level_owner is None:
                    owner, reading = self._give_split(rank, since)
                    if owner != rank:  # the mirror's evidence is the owner's: alert on it, in its episode
                        if owner in self.episodes:
                            continue
                        rank, episode, levels = owner, None, {key: self.cusum[key][owner] for key in self.cusum}
                if episode is None and self.world == 2 and 1 - rank in self.episodes:
                    # At W = 2 each rank is read against the other (the median of two, the step's
                    # mean): while one rank's episode lasts, the other's rising scores are its
                    # mirror, the same fault, unless the pair says this rank changed
                    # (_changed_itself, read from when the mirror first rose). A mirror's evidence
                    # is emptied, not alerted on.
                    since = self.mirror_since.setdefault((rank, strongest), since)
                    if not self._changed_itself(rank, strongest, since):
                        self._empty_evidence(rank)
                        continue
                if episode is None:
                    self.episodes[rank] = _Episode(since)
                    alerts.append(self._alert(obs, rank, strongest, levels, since, values, reading))
                else:
                    episode.quiet = 0
            elif episode is not None:
                episode.quiet += 1
                if episode.quiet >= config.quiet_steps:
                    del self.episodes[rank]
                    self.mirror_since = {key: first for key, first in self.mirror_since.items() if key[0] == rank}
                    if rank == self.level_owner:
                        self.level_owner = None
        return alerts

    def _changed_itself(self, rank: int, key: tuple[str, str], since: int) -> bool:
        """At W = 2, whether ``rank``'s layer evidence (``key``, rising since ``since``) is its own
        change, not its mirror of the other rank's: the parameter's gradient norm rose against the
        other rank's, and the pair's mean log norm of that parameter, which moves with the rank
        that changed, rose against its trend (``_trend_shift``, as ``_pair_owner`` reads the
        gradient norm) by more than its steps' spread about that trend before. Any other key:
        False, the pair's split of it belongs to the rank under alert."""
        if key != ("own", "layer") or not self.pair_parameter_means:
            return False
        parameter = int(self.parts[key][rank].argmax())
        names = self.pair_parameter_means[-1][1]
        history = [(step, means[parameter]) for step, step_names, means in self.pair_parameter_means if step_names == names]
        shift = self._trend_shift(history, since)
        return shift is not None and shift[0] > shift[1]

    def _trend_shift(self, history: list[tuple[int, float]], since: int) -> tuple[float, float] | None:
        """Steps 2-3 of ``_pair_owner`` on ``history`` (step, the pair's mean): the median, over the
        steps from ``since``, of the mean against the straight line through its up to ``window``
        steps before (a constant where fewer than ``MIN_BASELINE_STEPS``), and the spread of the
        steps before about that line (1.4826 x their median absolute residual); None without a
        step before ``since`` or from it."""
        steps, means = (np.array(column, dtype=float) for column in zip(*history))
        known = np.isfinite(means)
        before = known & (steps < since)
        before &= np.cumsum(before[::-1])[::-1] <= self.config.window  # the last `window` of them
        after = known & (steps >= since)
        if not before.any() or not after.any():
            return None
        if before.sum() >= MIN_BASELINE_STEPS:
            slope, intercept = np.polyfit(steps[before], means[before], 1)
        else:
            slope, intercept = 0.0, float(np.median(means[before]))
        spread = 1.4826 * float(np.median(np.abs(means[before] - (intercept + slope * steps[before]))))
        return float(np.median(means[after] - (intercept + slope * steps[after]))), spread

    def _empty_evidence(self, rank: int, keys=None) -> None:
        """``rank``'s CUSUMs of ``keys`` (every one by default) back to zero, and their parts (each
        signal's rise and fall, each parameter)."""
        for key in self.cusum if keys is None else keys:
            if key in self.parts:
                self.parts[key][rank] = 0.0
            self.cusum[key][rank], self.rising_since[key][rank] = 0.0, -1

    def _give_split(self, rank: int, since: int) -> tuple[int, str]:
        """At W = 2, the rank the pair's split in gradient norm is given to as ``rank``'s level
        CUSUM alerts, and the reading for its message: the rank already under alert if one is (the
        same fault, most likely), else ``_pair_owner``'s. The mirror's level CUSUM is emptied and
        left out (``_scores``) while the owner's episode lasts."""
        flagged = [r for r in range(2) if r in self.episodes]
        owner, reading = (flagged[0], "") if len(flagged) == 1 else self._pair_owner(rank, since)
        self.level_owner = owner
        self._empty_evidence(1 - owner, (LEVEL,))
        return owner, reading

    def _pair_owner(self, rank: int, since: int) -> tuple[int, str]:
        """At W = 2, which rank the pair's split in gradient norm belongs to, as ``rank``'s level
        CUSUM (rising since ``since``) alerts, and the reading for the message. The split itself
        is certain, its owner is not: rank a's norm rising by a factor and rank b's falling by it
        make the same split. What tells them apart is the pair's mean log norm, which moves with
        the changed rank's, by half the split: its steps from ``since`` on, against the straight
        line through its steps before (the shared trend, extrapolated), rose for a rank that rose.

        1. ``m_t``: the mean of the two ranks' log gradient norms at step t.
        2. Fit ``m_t = a + b t`` to the up to ``window`` steps before ``since`` among the last
           ``PAIR_STEPS x window`` steps (a constant where fewer than ``MIN_BASELINE_STEPS``; none:
           the owner is then the rank that alerted).
        3. ``shift``: the median of ``m_t - (a + b t)`` over the steps from ``since``.
        4. The owner is the rank whose norm rose against the other's if ``shift > 0``, else
           the one whose norm fell."""
        rose = rank if int(self.parts[LEVEL][rank].argmax()) == 0 else 1 - rank  # part 0: a rise against the other
        trend = self._trend_shift(list(self.pair_means), since)
        if trend is None:
            return rank, "which of the two changed could not be read (too few steps before the split)"
        shift = trend[0]
        owner = rose if shift > 0 else 1 - rose
        fell = 1 - rose
        reading = (
            f"with two ranks the split is certain but not which rank changed: the pair's mean log gradient norm, which moves with "
            f"the rank that changed, moved {shift:+.3g} against its trend before step {since}, as rank {rose}'s norm rose against "
            f"rank {fell}'s: rank {owner} is the likelier; check both"
        )
        return owner, reading

    def evidence(self, without: tuple[str, str] | None = None) -> np.ndarray:
        """Per rank, its highest statistical CUSUM as a fraction of that CUSUM's alert level (an
        alert above 1; empty before the first multi-rank step). Times ``alert_level``, the CUSUM
        over its level-1 threshold: ``benchmarks/detection.py`` reports the highest on healthy
        steps, the margin left before a false alarm. ``without``: that CUSUM left out."""
        if self.world is None:
            return np.zeros(0)
        return np.max(np.stack([self.cusum[key] / self.limit[key] for key in self.cusum if key != without]), axis=0)

    def _accumulate(self, key: tuple[str, str], z: np.ndarray, step: int, rows: np.ndarray | None = None) -> None:
        """One CUSUM per rank and part of ``z`` (W x parts, see ``_scores``), ``S <- max(0, S +
        min(z, cap) - allowance)``; the rank's level of ``key`` is its largest part. Parts keep
        their evidence apart: a rise and a fall of a signal scored either way (a gradient norm
        that dips on one step and spikes on the next is no lasting shift), and the parameters
        (a lasting rise of one parameter's gradient norm on one rank, silent corruption of that
        layer, accumulates there instead of drowning in the noise of all the others). ``rows``:
        ``z`` holds these ranks' parts only (the compact wire's sampled ranks); the others'
        CUSUMs stay as they are, neither fed nor drained by a step that did not see them."""
        if self.step_scores is not None:
            self.step_scores[key] = np.array(z, dtype=float)  # every part, before the cap
        previous = self.parts.get(key)
        if rows is not None:
            self._accumulate_rows(key, z, step, rows)
            return
        if previous is None:  # the first scored step, or other parameters (see _parameter_changes)
            previous, self.parts_start[key] = np.zeros_like(z), np.full(z.shape, -1, dtype=np.int32)  # steps < 2**31
        updated = np.minimum(z, self.cap[key])  # S + min(z, cap) - allowance, floored at 0, in one buffer
        updated += previous
        updated -= self.allowance[key]
        np.maximum(0.0, updated, out=updated)
        # A part rising since a step keeps it while above 0; only the parts that start rising on
        # this step are written (W x P parts for the layers: no pass over all of them for the rest).
        start = self.parts_start[key]
        start[(previous == 0) & (updated > 0)] = step
        self.parts[key] = updated
        top = updated.argmax(axis=1)
        ranks = np.arange(self.world)
        level = updated[ranks, top]
        self.cusum[key], self.rising_since[key] = level, np.where(level > 0, start[ranks, top], -1)

    def _accumulate_rows(self, key: tuple[str, str], z: np.ndarray, step: int, rows: np.ndarray) -> None:
        """``_accumulate`` of the rows ``rows`` of a W x parts CUSUM: O(rows x parts), not O(W x parts)."""
        parts = self.parts.get(key)
        if parts is None:
            parts = self.parts[key] = np.zeros((self.world, z.shape[1]), dtype=z.dtype)
            self.parts_start[key] = np.full(parts.shape, -1, dtype=np.int32)
        before = parts[rows]
        updated = np.minimum(z, self.cap[key])
        updated += before
        updated -= self.allowance[key]
        np.maximum(0.0, updated, out=updated)
        start = self.parts_start[key][rows]
        start[(before == 0) & (updated > 0)] = step
        parts[rows], self.parts_start[key][rows] = updated, start
        top = updated.argmax(axis=1)
        level = updated[np.arange(len(rows)), top]
        self.cusum[key][rows], self.rising_since[key][rows] = level, np.where(level > 0, start[np.arange(len(rows)), top], -1)

    def _take_layer_levels(self, obs: Observation) -> None:
        """The compact wire's layer CUSUMs as this detector's own: each rank's level (the highest of
        the per-parameter CUSUMs it ran on itself, ``ddphooks.fleet.own_values``, with this
        detector's default rate, drift and cap) on its parameter, 0 on the others. A rank's
        sampled rows would give it a baseline only from the first step it was sampled, a fault
        older than that included; the rank itself has its whole history."""
        names = obs.parameter_names or self.parameter_names
        if not names:
            return
        key = ("own", "layer")
        levels = np.nan_to_num(np.asarray(obs.layer_levels, dtype=float), nan=0.0)
        which = np.clip(np.nan_to_num(np.asarray(obs.layer_parameters, dtype=float), nan=0.0).astype(np.intp), 0, len(names) - 1)
        ranks = np.arange(self.world)
        before = self.rising_since.get(key)
        since = np.full(self.world, -1, dtype=np.int32) if before is None or len(before) != self.world else before.astype(np.int32)
        since = np.where(levels > 0, np.where(since >= 0, since, obs.step), -1).astype(np.int32)
        parts = np.zeros((self.world, len(names)), dtype=PARAMETER_DTYPE)
        parts[ranks, which] = levels
        start = np.full(parts.shape, -1, dtype=np.int32)
        start[ranks, which] = since
        self.parts[key], self.parts_start[key] = parts, start
        self.cusum[key], self.rising_since[key] = levels, since

    def parts_since(self, key: tuple[str, str]) -> np.ndarray:
        """W x parts: the step since which each part of CUSUM ``key`` has been above 0 (-1 where it is 0)."""
        return np.where(self.parts[key] > 0, self.parts_start[key], -1)

    @property
    def layer_level(self) -> np.ndarray | None:
        """W x P: the per-parameter CUSUMs (None before the first scored step with parameters)."""
        return self.parts.get(("own", "layer"))

    def _alert(self, obs: Observation, rank: int, strongest: tuple[str, str], levels: dict, since: int, values: dict, reading: str = "") -> dict:
        if self.step_scores is not None:
            self.fired.append((obs.step, rank, strongest, int(self.parts[strongest][rank].argmax())))
        kind, name = strongest
        signals = sorted({f"{n} ({k})" for (k, n), level in levels.items() if level > self.limit[(k, n)] / 2})
        parameters = self._suspicious_parameters(rank)
        against = {"cross": "the other ranks", "level": "its own usual level against the other ranks"}.get(kind, "its own recent steps")
        if name == "layer":
            top = int(self.layer_level[rank].argmax())
            detail = f"the gradient norm of {self.parameter_names[top]} rose against the median rank's and against this rank's other parameters, step after step"
        elif strongest == ("cross", "cosine_previous") and self.world >= 3 and np.isfinite(values["loss"][rank]):
            detail = "; ".join(self._now_and_usual(("cross", signal), rank, values) for signal in ("cosine_previous", "loss"))
        elif name == "combined":
            detail = "; ".join(self._now_and_usual((kind, signal), rank, values) for signal in SIGNALS if np.isfinite(values[signal][rank]))
        else:
            detail = self._now_and_usual(strongest, rank, values)
        label = {
            "layer": "layer gradients",
            "combined": "loss, gradient norm and cosines together",
            "cosine_previous": "gradient cosine to its own previous step",
        }.get(name, name.replace("_", " "))
        message = (
            f"rank {rank} has diverged since step {since}: its {label} depart{'' if name in ('layer', 'combined') else 's'} from {against} "
            f"({detail}; CUSUM {levels[strongest]:.1f} > {self.limit[strongest]:g})"
        )
        if reading:
            message += f"; {reading}"
        if parameters:
            message += f", mostly in {', '.join(parameters[:3])}"
        message += f"; typical of {LIKELY_CAUSES[name]}; {reference(name)}"
        return {
            "step": obs.step,
            "rank": rank,
            "kind": name,
            "since": since,
            "score": float(levels[strongest]),
            "signals": signals,
            "parameters": parameters,
            "message": message,
        }

    def _now_and_usual(self, key: tuple[str, str], rank: int, values: dict) -> str:
        """One signal of one rank for a message: its value now and its trailing median."""
        kind, name = key
        history = (self.level if kind == "level" else (self.cross if kind == "cross" else self.raw)[name]).values[:, rank]
        usual = float(np.nanmedian(history)) if np.isfinite(history).any() else math.nan
        if kind == "level":  # read against the median rank, as it is scored
            now = float(_relative_to_median(values["grad_norm"])[rank])
        else:
            now = float((self._deviations(values) if kind == "cross" else values)[name][rank])
        describe = {
            ("cross", "loss"): f"{'log ' if self.log_losses else ''}loss minus the median rank's",
            ("own", "loss"): f"{'log ' if self.log_losses else ''}loss minus the step's mean {'log ' if self.log_losses else ''}loss",
            ("cross", "grad_norm"): "log gradient norm minus the median rank's",
            LEVEL: "log gradient norm minus the median rank's",
            ("own", "grad_norm"): "log gradient norm",
            ("cross", "cosine"): "gradient cosine to the others minus the median rank's",
            ("own", "cosine"): "gradient cosine to the other ranks",
            ("cross", "cosine_previous"): "atanh of its gradient cosine to its own previous step minus the median rank's",
            ("own", "cosine_previous"): "gradient cosine to its own previous step",
        }[key]
        if key == ("own", "cosine_previous"):  # scored on Fisher's scale, shown as a cosine
            now, usual = math.tanh(now), math.tanh(usual)
        return f"{describe}: now {now:.4g}, usually {usual:.4g}"

    def _replica_alerts(self, obs: Observation) -> list[dict]:
        replicas = obs.replicas
        if not replicas:
            return []
        differing = set(replicas.get("ranks", []))
        alerts = []
        for rank in sorted(differing - self.replica_episodes):
            tensors = [p for p in replicas.get("parameters", []) if rank in p.get("ranks", [])]
            names = [p["name"] for p in tensors][: self.config.top_parameters]
            largest = max((p.get("relative_difference") or 0.0 for p in tensors), default=0.0)
            tie = " (no majority at this world size: either rank may be the faulty one)" if len(differing) == obs.world_size else ""
            alerts.append(
                {
                    "step": obs.step,
                    "rank": rank,
                    "kind": "replica",
                    "since": obs.step,
                    "score": float(largest),
                    "signals": ["replicas"],
                    "parameters": names,
                    "message": (
                        f"rank {rank} holds different parameters than the other replicas at step {obs.step}{tie}: "
                        f"{replicas.get('tensors', len(tensors))} tensor(s) differ"
                        + (f" (compared by fingerprint hashes at step {replicas['checked_step']}: sizes unknown)" if replicas.get("checked_step") is not None else f", up to {largest:.3g} relative")
                        + (f", in {', '.join(names[:3])}" if names else "")
                        + f"; typical of {LIKELY_CAUSES['replica']}; {reference('replica')}"
                    ),
                }
            )
        self.replica_episodes = differing
        return alerts

    def _nonfinite_alerts(self, obs: Observation) -> list[dict]:
        """Ranks whose loss or local gradient went non-finite while the other ranks' were finite,
        named on the next step if they are still not finite (see the module docstring)."""
        report = obs.nonfinite or {}
        bad_loss = {int(rank) for rank in report.get("losses", [])}
        bad_gradient = set(np.flatnonzero(~np.isfinite(obs.grad_norms)).tolist()) - set(obs.absent)  # an absent rank's NaN is no fault
        bad = bad_loss | bad_gradient
        alone = len(bad) < obs.world_size  # every rank at once names none
        # Named: still not finite on the step after it went non-finite alone (its NaN reached every
        # replica, or it stays non-finite), or non-finite alone for the NONFINITE_AGAIN-th time
        # within quiet_steps steps (a failing unit that corrupts some steps only). A loss scaler's
        # overflow on one rank is finite on the next step, and does not come back twice so soon on
        # the same rank: the scale is halved each time.
        window = self.config.quiet_steps
        self.nonfinite_first = {
            rank: kept for rank, lone in self.nonfinite_first.items() if (kept := [first for first in lone if obs.step - first["step"] < window])
        }  # fmt: skip
        alerts = []
        for rank, lone in sorted(self.nonfinite_first.items()):
            if rank not in bad:
                continue
            if lone[-1]["step"] == obs.step - 1:
                alerts.append(self._nonfinite_alert(obs, rank, lone[-1], bad))
            elif alone and len(lone) + 1 >= NONFINITE_AGAIN:
                alerts.append(self._nonfinite_alert(obs, rank, lone[0], bad))
        self.nonfinite_episodes.update((alert["rank"], 0) for alert in alerts)  # a new episode per alert
        for rank in list(self.nonfinite_episodes):
            self.nonfinite_first.pop(rank, None)
            self.nonfinite_episodes[rank] = 0 if rank in bad else self.nonfinite_episodes[rank] + 1
            if self.nonfinite_episodes[rank] >= self.config.quiet_steps:
                del self.nonfinite_episodes[rank]
        if alone:
            for rank in sorted(bad - set(self.nonfinite_episodes)):
                what = " and ".join(part for part, hit in (("loss", rank in bad_loss), ("local gradient", rank in bad_gradient)) if hit)
                names = [g["parameter"] for g in report.get("gradients", []) if g.get("rank") == rank]
                first = {"step": obs.step, "what": what, "parameters": names, "finite": sorted(set(range(obs.world_size)) - bad)}
                self.nonfinite_first.setdefault(rank, []).append(first)
        return alerts

    def _nonfinite_alert(self, obs: Observation, rank: int, first: dict, bad: set[int]) -> dict:
        names = first["parameters"][: self.config.top_parameters]
        if len(bad) == obs.world_size:
            now = "every rank's values are not finite"
        elif obs.step == first["step"] + 1:
            now = "its values are still not finite"
        else:
            now = f"its values are not finite again while the others' are ({NONFINITE_AGAIN} times in {obs.step - first['step'] + 1} steps)"
        return {
            "step": obs.step,
            "rank": rank,
            "kind": "nonfinite",
            "since": first["step"],
            "score": float(len(first["parameters"])),
            "signals": ["nonfinite"],
            "parameters": names,
            "message": (
                f"rank {rank}'s {first['what']} went non-finite (NaN or Inf) at step {first['step']} while rank(s) "
                f"{', '.join(map(str, first['finite']))} had finite values"
                + (f", in {', '.join(names[:3])}" if names else "")
                + f"; at step {obs.step} {now}; typical of {LIKELY_CAUSES['nonfinite']}; {reference('nonfinite')}"
            ),
        }

    def _duplicate_alerts(self, obs: Observation) -> list[dict]:
        """Groups of ranks that computed the same loss and gradient on the last ``duplicate_steps``
        steps (twice as many where a step compared only the gradient norms), from step 0: see the
        module docstring."""
        config = self.config
        finite = lambda array: None if array is None else np.where(np.isfinite(array), array, np.nan)
        losses, norms, cosines = finite(obs.losses), finite(obs.grad_norms), finite(obs.cosine_loo)
        labels, strong = _duplicate_groups(losses, norms, cosines, config.duplicate_tolerance, config.duplicate_cosine_tolerance)
        self.duplicate_history.append((obs.step, labels, strong, losses, norms, cosines))
        alerts = []
        if (labels >= 0).any():
            needed = config.duplicate_steps
            if not all(entry[2] for entry in list(self.duplicate_history)[-needed:]):
                needed *= 2  # the gradient norms alone: one chance agreement a step is far likelier
            if len(self.duplicate_history) >= needed:
                recent = np.stack([entry[1] for entry in list(self.duplicate_history)[-needed:]])  # steps x W
                candidates = np.flatnonzero((recent >= 0).all(axis=0))
                if len(candidates) >= 2:
                    # Ranks together on every one of those steps: the same labels on each.
                    _, together = np.unique(recent[:, candidates].T, axis=0, return_inverse=True)
                    together = np.asarray(together).reshape(-1)
                    for group in sorted((candidates[together == g] for g in np.unique(together)), key=lambda g: g[0]):
                        if len(group) >= 2 and not set(group.tolist()) <= set(self.duplicate_episodes):
                            alerts.append(self._duplicate_alert(obs, group))
                            self.duplicate_episodes.update((int(rank), 0) for rank in group)
        for rank in list(self.duplicate_episodes):
            self.duplicate_episodes[rank] = 0 if labels[rank] >= 0 else self.duplicate_episodes[rank] + 1
            if self.duplicate_episodes[rank] >= config.quiet_steps:
                del self.duplicate_episodes[rank]
        return alerts

    def _duplicate_alert(self, obs: Observation, group: np.ndarray) -> dict:
        """The alert for ``group`` (ranks together on the last steps): since when, and the largest
        relative differences seen among them on those steps."""
        steps = []
        for entry in reversed(self.duplicate_history):  # back while the group stayed together
            members = entry[1][group]
            if members[0] < 0 or (members != members[0]).any():
                break
            steps.append(entry)
        since = steps[-1][0]

        def largest_gap(index: int) -> float:  # over those steps, (max - min) / max of the group's values, NaN if unknown
            values = [entry[index][group] for entry in steps if entry[index] is not None]
            return max((float(_relative_difference(v.max(), v.min())) for v in values if np.isfinite(v).all()), default=math.nan)

        loss_gap, norm_gap = largest_gap(3), largest_gap(4)
        known = [entry[5][group] for entry in steps if entry[5] is not None and np.isfinite(entry[5][group]).any()]
        every = len(group) == obs.world_size
        ranks = [int(rank) for rank in group]
        if every:
            who = f"every rank (all {len(ranks)})"
        elif len(ranks) <= 8:
            who = f"ranks {', '.join(map(str, ranks))}"
        else:
            who = f"{len(ranks)} ranks ({', '.join(map(str, ranks[:8]))}, ...)"
        agreement = lambda gap: "exactly" if gap == 0 else f"to {gap:.2g} relative"
        agreed = [f"their losses agreed {agreement(loss_gap)}"] if not math.isnan(loss_gap) else []
        agreed.append(f"their gradient norms {'' if agreed else 'agreed '}{agreement(norm_gap)}")
        evidence = " and ".join(agreed)
        if known and every:
            below = max(0.0, 1 - min(float(np.nanmin(v)) for v in known))
            evidence += f"; their gradient cosines to the sum of the others were {'all 1' if below == 0 else f'within {below:.2g} of 1'}"
        elif known:
            gap = max(float(np.nanmax(v) - np.nanmin(v)) for v in known)
            evidence += f"; their gradient cosines to the sum of the others agreed {'exactly' if gap == 0 else f'to {gap:.2g}'}"
        signals = (["loss"] if not math.isnan(loss_gap) else []) + ["grad_norm"] + (["cosine"] if known else [])
        same = "gradient" if math.isnan(loss_gap) else "loss and gradient"
        message = (
            f"{who} computed the same {same} on every step since step {since} ({len(steps)} steps; {evidence}): "
            f"they train on the same data, and the work of {len(ranks) - 1} of these {len(ranks)} ranks is wasted; "
            f"typical of {LIKELY_CAUSES['duplicate_data']}; {reference('duplicate_data')}"
        )
        return {
            "step": obs.step,
            "rank": ranks[0],
            "kind": "duplicate_data",
            "since": int(since),
            "score": float(len(ranks)),
            "signals": signals,
            "parameters": [],
            "message": message,
            "ranks": ranks,
        }

    # -- which layers ----------------------------------------------------------------------------
    def _parameter_changes(self, obs: Observation) -> None:
        """Per rank and parameter, how far ``d_{i,p} - median_q d_{i,q}`` (with ``d_{i,p} =
        log|g_{i,p}| - median_j log|g_{j,p}|``) rose above its exponential average, in standard
        deviations (``parameter_change``; None without the norms). With ``parameter_rows`` (the
        compact wire) only those ranks' rows: ``median_j log|g_{j,p}|`` is then the log of the
        mean norm of the other ranks present, exact from ``parameter_mean_norms`` (a few sampled
        rows would make a poor median, one row none at all: the rank itself), and each rank's
        baseline is the one it had when it was last sampled."""
        self.parameter_change = None
        if obs.parameter_norms is None or obs.parameter_names is None:
            return
        rows = None if obs.parameter_rows is None else np.asarray(obs.parameter_rows, dtype=np.intp)
        self.parameter_rows = rows
        with np.errstate(divide="ignore", invalid="ignore"):
            # Non-finite norms are unknown, as offline (null); _nonfinite_alerts reports them. So is a
            # zero norm: a parameter the rank's batch did not use (conditional computation, an
            # expert or a head no sample was routed to) has no local gradient to compare, and its
            # log, -inf, would make every rank that used it look infinitely far above the median.
            # (The log of every norm, then the non-finite ones unknown: the log is finite exactly
            # where the norm is finite and above zero.)
            norms = obs.parameter_norms  # C-ordered logs, whatever the norms' order (offline: a transpose)
            logs = np.log(norms, out=np.empty(norms.shape, dtype=PARAMETER_DTYPE))
            finite = np.isfinite(logs)
            self._parameters_known = bool(finite.all())  # every norm known: no NaN below
            if not self._parameters_known:
                logs[~finite] = np.nan
            # Medians by selection, over each parameter's ranks (a transposed copy) and each
            # rank's parameters: O(W x P), not a sort.
            known = self._parameters_known
            full = None if not known else np.full(logs.shape[1], logs.shape[0])  # every rank known
            if rows is not None and obs.parameter_mean_norms is not None:
                # The other ranks' mean norm: (n mean - own) / (n - 1), over the n ranks present.
                present = obs.world_size - len(obs.absent)
                others = (present * obs.parameter_mean_norms.astype(PARAMETER_DTYPE) - norms) / max(present - 1, 1)
                reference = np.log(others)
                reference[~np.isfinite(reference)] = np.nan
                deviation = logs - reference
            else:
                deviation = logs - _select_quantiles(_transposed(logs), 0.5, full)
            if deviation.shape[1] >= COMMON_FACTOR_PARAMETERS:
                # A batch that makes one rank's whole gradient larger moves every parameter alike;
                # the median over parameters is that common factor, which one corrupted parameter
                # cannot move. Without it, a parameter's noise is mostly the rank's total.
                deviation -= _select_quantiles(deviation.copy(), 0.5, None if not known else np.full(len(logs), logs.shape[1]))[:, None]
            self._parameter_now = deviation
            self._parameter_rise = None  # this step's rise (after the warm-up), for _learn_parameters
        if self.parameter_names != obs.parameter_names:
            self._reorder_parameters(obs.parameter_names)
        if self.parameter_names != obs.parameter_names or self.parameter_level is None:  # other parameters: start afresh
            self.parameter_names = list(obs.parameter_names)
            if rows is None:
                self.parameter_level = self._parameter_now.copy()
            else:  # a rank's level is unknown (NaN) until it is first sampled
                self.parameter_level = np.full((self.world, self._parameter_now.shape[1]), np.nan, dtype=PARAMETER_DTYPE)
                self.parameter_level[rows] = self._parameter_now
            # W >= 3: one scale per parameter, pooled over ranks (1 x P, broadcast); W = 2: each rank's.
            self.parameter_scale = np.zeros((1 if self.world >= 3 else len(self.parameter_level), self.parameter_level.shape[1]), dtype=PARAMETER_DTYPE)
            self.parameter_seen = 0
            self.parts.pop(("own", "layer"), None)
            return
        if self.parameter_seen >= self.config.warmup:
            level = self.parameter_level if rows is None else self.parameter_level[rows]
            rise = self._parameter_rise = self._parameter_now - level
            # The scale's average starts from zero: divided by the weight it has gathered (as in
            # Adam's bias correction), it is not underestimated over the first steps.
            scale = self.parameter_scale if rows is None or len(self.parameter_scale) == 1 else self.parameter_scale[rows]
            scale = scale / (1 - (1 - PARAMETER_RATE) ** self.parameter_seen)
            scale += 1e-3
            with np.errstate(invalid="ignore"):
                change = np.divide(rise, scale)
            finite = np.isfinite(change)  # as np.nan_to_num(nan=0.0, posinf=1e9, neginf=-1e9), looking once
            if not finite.all():
                change[~finite] = np.nan_to_num(change[~finite], nan=0.0, posinf=1e9, neginf=-1e9)
            self.parameter_change = change

    def _reorder_parameters(self, names: list[str]) -> None:
        """Follow the same parameters listed in another order (DDP lists them in bucket order, and
        rebuilds its buckets after the first steps): permute their baselines and per-parameter
        CUSUMs by name, so a fault in progress is neither lost nor blamed on another layer.
        Nothing changes unless ``names`` are exactly the known parameters."""
        if self.parameter_level is None or len(set(names)) != len(names) or sorted(names) != sorted(self.parameter_names):
            return
        where = {name: index for index, name in enumerate(self.parameter_names)}
        order = [where[name] for name in names]
        self.parameter_level, self.parameter_scale = self.parameter_level[:, order], self.parameter_scale[:, order]
        layer = ("own", "layer")
        if layer in self.parts:
            self.parts[layer], self.parts_start[layer] = self.parts[layer][:, order], self.parts_start[layer][:, order]
        self.parameter_names = list(names)

    def _learn_parameters(self, obs: Observation, suspect: np.ndarray) -> None:
        if obs.parameter_norms is None or self.parameter_level is None or self.parameter_names != obs.parameter_names:
            return
        rate = PARAMETER_RATE
        rows = self.parameter_rows
        level = self._parameter_now
        stored = self.parameter_level if rows is None else self.parameter_level[rows]  # rows: a copy, written back below
        rise = self._parameter_rise if self._parameter_rise is not None else level - stored
        self._parameter_rise = None
        if rows is not None:
            suspect = suspect[rows]
        # A suspect rank does not teach the baseline its fault (with every norm known, the
        # learnable entries are its rows: no W x P pass to find them).
        learnable = ~suspect[:, None] if self._parameters_known else np.isfinite(level) & ~suspect[:, None]
        keep = np.broadcast_to(learnable, level.shape)
        layer_level = self.layer_level
        if layer_level is not None and layer_level.shape[0] == self.world and layer_level.shape[1] == keep.shape[1]:
            keep = keep & ((layer_level if rows is None else layer_level[rows]) == 0)  # nor does a parameter whose evidence is accumulating
        # (1 - rate) * level + rate * now where kept, in place; the few entries not kept (a
        # scattered few of W x P: a branch per entry would cost more) put back after.
        held = np.flatnonzero(~keep)
        kept_before = stored.flat[held]
        stored *= 1 - rate
        stored += rate * level
        if rows is not None:
            first = np.isnan(stored)  # a rank sampled for the first time: its level is this step's
            stored[first] = level[first]
        stored.flat[held] = kept_before
        if rows is not None:
            self.parameter_level[rows] = stored
        if self.world >= 3:
            # Every step, pooled over ranks: the median absolute rise (1.4826 of it is a standard
            # deviation), which the one rank that is off cannot move (by selection, over each
            # parameter's ranks: a transposed copy).
            deviation = _transposed(rise, np.abs)
            if self._parameters_known:
                deviation[:, suspect] = np.nan
            elif not learnable.all():
                deviation[~learnable.T] = np.nan
            typical = MAD_TO_STD * _select_quantiles(deviation, 0.5)
            learned = np.isfinite(typical)
            if learned.all():
                self.parameter_scale *= 1 - rate
                self.parameter_scale += rate * typical
            else:
                learned_scale = (1 - rate) * self.parameter_scale
                learned_scale += rate * np.nan_to_num(typical)
                self.parameter_scale = np.where(learned, learned_scale, self.parameter_scale)
        else:
            # No majority: each rank's own average absolute rise (sqrt(pi/2) of it is a standard
            # deviation), only while its evidence on the parameter is not accumulating, or the
            # fault would become the scale.
            typical, learned = math.sqrt(math.pi / 2) * np.abs(rise), keep & np.isfinite(rise)
            scale = self.parameter_scale if rows is None else self.parameter_scale[rows]
            scale = np.where(learned, (1 - rate) * scale + rate * np.nan_to_num(typical), scale)
            if rows is None:
                self.parameter_scale = scale
            else:
                self.parameter_scale[rows] = scale
        self.parameter_seen += 1

    def _suspicious_parameters(self, rank: int) -> list[str]:
        if self.parameter_change is None:
            return []
        rows = self.parameter_rows
        if rows is None:
            change = self.parameter_change[rank].astype(float)  # float64: the tie-break below stays above rounding
        elif rank in rows:  # the compact wire: this step's rise where the rank was sampled, else none
            change = self.parameter_change[int(np.flatnonzero(rows == rank)[0])].astype(float)
        else:
            change = np.zeros(self.parameter_change.shape[1])
        # Accumulated evidence first (the per-parameter CUSUMs), this step's rise where there is none.
        relative = change if self.layer_level is None else self.layer_level[rank] + 1e-6 * change
        order = np.argsort(-relative)[: self.config.top_parameters]
        return [self.parameter_names[p] for p in order if relative[p] > 0]


def detect_run(records: list[dict], config: DetectorConfig | None = None) -> list[dict]:
    """The alerts a finished run raises, by the same detector fed its records in order.

    Raises ``ValueError`` if the records carry no sketches (``cosine_loo``): the detector's
    cosine signal needs them; rerun with ``sketch_dim`` > 0. Also where a record summarises its
    per-rank signals over the ranks (``per_rank`` false, above ``per_rank_max_world``).
    """
    if records and all(record.get("cosine_loo") is None and record.get("per_rank") is not False for record in records):
        raise ValueError(
            "the run's records have no sketches (no 'cosine_loo': sketch_dim=0, or written by ddphooks < 0.2); "
            "detection needs them: rerun with sketch_dim > 0 (256 is the default)"
        )
    detector = Detector(config)
    for record in records:
        detector.update(Observation.from_record(record))
    # Named as the run named them online: with the ranks' table its first record carries.
    table = next((table for record in records if (table := RankTable.from_record(record)) is not None), None)
    return detector.alerts if table is None else [table.name_alert(alert) for alert in detector.alerts]
