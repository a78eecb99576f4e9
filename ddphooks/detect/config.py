"""The detector's settings (``DetectorConfig``): its CUSUMs' allowances, caps and thresholds, the
baselines' window and scale, and the rules without a baseline; each default with the runs it was
chosen on."""

from __future__ import annotations

from dataclasses import dataclass, fields


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
    (``threshold``, ``repeat_threshold``, ``layer_threshold``, ``level_threshold``,
    ``pair_persistence_threshold``) is multiplied by it. Higher: fewer false alarms, later
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
    4 / 8: 14 / 25, 12.5 / 17, 3 on the held-out set of e66939c (2026-12-02), where this was chosen, and
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
    per-parameter CUSUM on the 13,030 held-out healthy steps of e66939c (11.2, at W = 2;
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
    0 at 0.8, which was the default until d6a58dc (2026-12-05). 0.9 since then: on fresh zoo
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
    drained (e9c3ca5, 2026-12-05, benchmarks/README.md "Gradient-scale faults"). A step's score
    is signed: a fall of the gap takes from the CUSUM of its rises, and the other way round (a
    spread that widens around the same level is no shift). At W = 2 a rise of one rank is the
    other's fall, the same split in two mirrored CUSUMs: it accumulates on both and, as it
    alerts, is given to the rank the pair's mean log norm moved with (``PairSplit.pair_owner``, ``ddphooks.detect.rules.pair``;
    the message says the owner is the likelier, not the certain one; to a rank already under
    alert, when one is, as the same fault; until then the split makes neither rank suspect, so
    the healthy rank's other baselines keep learning). Giving each step to the
    rank whose own norm moved the more, as the loss does, stalled under a steep schedule,
    whose shared moves are larger than a lasting x1.5 (8ec6cae, 2026-12-05)."""

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

    pair_persistence_score: float = 1.5
    """At W = 2, the per-parameter score (``ddphooks.detect.attribution``'s change, in standard
    deviations) above which a parameter's step counts as raised in its persistence CUSUM (one
    per rank and parameter): ``S <- max(0, S + 1)`` on a raised step, ``S <- max(0, S -
    pair_persistence_drift)`` on another; its alerts are ``layer`` alerts. It counts how long a
    rise lasts, not how high it goes: one layer's gradient x1.5 on one rank (karpathy/nanoGPT)
    scored 2.6 +- 0.9 a step, as high as a healthy LoRA adapter's 20-step excursion, so the
    ``layer_drift`` CUSUM names it after 45 steps and a lower allowance named healthy runs; the
    excursion ends, the fault does not. A step adds at most 1, so no run of wild steps alerts
    before ``pair_persistence_threshold * alert_level`` raised steps. 9.1% of healthy steps are
    raised (577,344 rank-parameter steps of the zoo's 18 healthy W = 2 runs of r = 18-19). At
    W >= 3 the ``layer_drift`` CUSUM's scale is pooled over ranks, and there is none."""

    pair_persistence_drift: float = 0.7
    """What a step that is not raised takes off the persistence CUSUM (see
    ``pair_persistence_score``): the log-likelihood ratio of a step that is not raised over one
    that is, ``ln((1 - p0) / (1 - p1)) / ln(p1 / p0)`` with ``p0`` = 0.091 raised on healthy steps
    and ``p1`` = 0.8 on a faulty layer's; the CUSUM rises while more than 41% (``drift / (1 +
    drift)``) of a parameter's steps are raised."""

    pair_persistence_threshold: float = 17.0
    """Level at which a persistence CUSUM alerts (times ``alert_level``: 21.25 at the default, at
    least 22 raised steps). Chosen on the zoo's healthy W = 2 runs of r = 18-19, whose highest
    level was 13.9 (a LoRA run): 1.22 times it at level 1, 1.53 at the default. Held out, no false
    alarm: r = 20-23 (36 runs, 28,800 steps), highest 15.5; r = 24-29 (54 runs, 43,200 steps),
    highest 14.7. The x1.5 layer on nanoGPT is named after 26 steps (benchmarks/README.md)."""

    quiet_steps: int = 8
    """Steps with every score below threshold that end a rank's alert episode."""

    top_parameters: int = 5
    """Parameters named in an alert."""

    duplicate_steps: int = 3
    """Consecutive instrumented steps on which a group of ranks must compute the same loss and
    gradient before a ``duplicate_data`` alert (twice as many on steps where only the gradient
    norms are known: no loss captured, no sketch). Not 2: a pair of healthy ranks agrees by
    chance in loss and gradient norm with a probability ``p`` of about ``tau^2 / (pi c^2)`` a
    step (see ``ddphooks.detect.rules.duplicate_data``), 3.2e-5 at ``tau = 1e-4`` and a spread ``c`` of 1%, and at
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
            "repeat_drift", "repeat_cap", "repeat_threshold", "level_drift", "level_cap", "level_threshold", "layer_threshold", "pair_repeat_drift", "pair_combined_drift",
            "pair_persistence_score", "pair_persistence_drift", "pair_persistence_threshold", "duplicate_tolerance", "duplicate_cosine_tolerance",
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
