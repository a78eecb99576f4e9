"""What each kind of alert means, for the end of its message: the faults whose pattern it is
(``LIKELY_CAUSES``) and the pointer to its section of the alerts reference (``reference``).

Every alert's message ends with what its kind typically means and ``; see docs/alerts.md#<kind>``:
the section that says what the alert means, what to check first, its measured false-alarm rate and
delay.
"""

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
#: What a person checks first on each kind of alert (the alerts reference's "check first" column,
#: kept equal to it by tests/test_alert_docs.py): every alert's message starts with it
#: (``first_check``), so the page an on-call engineer reads opens with what to do.
FIRST_CHECK = {
    "replica": "the optimizer's settings on that rank",
    "nonfinite": "that rank's batch at step `since`",
    "duplicate_data": "the data sampler's rank",
    "unsynchronised": "a conversion of the module after wrapping",
    "layer": "that rank's accelerator",
    "cosine_previous": "that rank's data loader",
    "combined": "that rank's data",
    "loss": "that rank's data and loss function",
    "grad_norm": "how that rank scales its loss",
    "cosine": "that rank's data",
}
#: The alerts reference, one section per kind with the kind as its anchor (``docs/alerts.md#replica``):
#: what the alert means, what to check first, its measured false-alarm rate and delay.
ALERTS_REFERENCE = "docs/alerts.md"


def reference(kind: str) -> str:
    """The pointer every alert message ends with (after ``"; "``): its section of the alerts
    reference, e.g. ``reference("replica") == "see docs/alerts.md#replica"``."""
    return f"see {ALERTS_REFERENCE}#{kind}"


def first_check(alert: dict) -> dict:
    """``alert`` with what to check first (``check_first``) put at the start of its message:
    ``check that rank's accelerator first: rank 1 has diverged since step 40: ...``."""
    check = FIRST_CHECK[alert["kind"]].replace("`since`", str(alert.get("since")))
    return dict(alert, check_first=check, message=f"check {check} first: {alert['message']}")
