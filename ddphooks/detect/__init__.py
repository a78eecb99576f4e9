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

What follows is how each part works, in the module that does it; ``benchmarks/detection.py
--ablations`` measures what each pooling and setting buys, on held-out runs (benchmarks/README.md).

- ``config``: ``DetectorConfig``, the settings, each default with the runs it was chosen on;
- ``observation``: ``Observation``, what the detector reads of one step (from a record or from a
  live ``SilentStats``);
- ``signals``: the four signals of every rank and which change of each is suspicious;
- ``robust`` and ``baselines``: the robust statistics, and the windows and baselines every score
  is read against (median, scale from the MAD and the noise's shoulders, growth of the spread);
- ``scores``: the robust z-scores of a step, against the rank's own history and against the
  other ranks, and their combined sum;
- ``attribution``: each parameter's rise on each rank (the layer scores, and the parameters an
  alert names);
- ``evidence``: the CUSUMs the scores accumulate in;
- ``rules``: one module per alert rule, ``divergence`` (the statistical kinds) with ``pair``
  (the W = 2 split and mirror), ``replica``, ``nonfinite`` and ``duplicate_data``;
- ``messages``: what each kind typically means, what to check first (every message starts with
  it), and its section of the alerts reference (``LIKELY_CAUSES``, ``FIRST_CHECK``, ``reference``);
- ``detector``: ``Detector``, which composes them step by step; ``offline``: ``detect_run`` on
  a finished run's records; ``process``: ``DetectorProcess``, the same ``Detector`` in a process
  of its own, which the training process feeds over a pipe (how ddphooks runs it online: its
  Python would otherwise hold the training process's GIL).

Example::
    >>> detector = Detector()
    >>> for record in records:
    ...     for alert in detector.update(Observation.from_record(record)):
    ...         print(alert["message"])
"""

from .attribution import COMMON_FACTOR_PARAMETERS, PARAMETER_RATE
from .baselines import MIN_BASELINE_STEPS
from .config import DetectorConfig
from .detector import Detector
from .messages import ALERTS_REFERENCE, FIRST_CHECK, LIKELY_CAUSES, reference
from .observation import PARAMETER_DTYPE, Observation
from .offline import detect_run
from .rules.pair import PAIR_STEPS
from .signals import LEVEL, SIGNALS

# Helpers the tests check against their plain definitions (tests/test_detect.py,
# tests/test_detect_scale.py), importable from here as they were from the single module.
from .baselines import _History  # noqa: F401,E402
from .robust import _column_quantiles, _growth, _robust, _select_quantiles, _shoulders, _sorted_quantiles, _transposed  # noqa: F401,E402
from .rules.duplicate_data import _duplicate_groups  # noqa: F401,E402
from .scores import _others_change  # noqa: F401,E402
from .signals import _relative_to_median  # noqa: F401,E402

__all__ = [
    "ALERTS_REFERENCE", "COMMON_FACTOR_PARAMETERS", "FIRST_CHECK", "LEVEL", "LIKELY_CAUSES", "MIN_BASELINE_STEPS", "PAIR_STEPS", "PARAMETER_DTYPE",
    "PARAMETER_RATE", "SIGNALS", "Detector", "DetectorConfig", "Observation", "detect_run", "reference",
]  # fmt: skip
