"""Offline detection (``detect_run``): the alerts a finished run's records raise, by the same
detector that runs during training (``ddphooks detect RUN.jsonl``)."""

from __future__ import annotations

from ddphooks.identity import RankTable

from .config import DetectorConfig
from .detector import Detector
from .observation import Observation


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
    # Named as the run named them online: with the ranks' table its records carry.
    table = next((table for record in records if (table := RankTable.from_record(record)) is not None), None)
    return detector.alerts if table is None else [table.name_alert(alert) for alert in detector.alerts]
