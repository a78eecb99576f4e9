"""The alerts reference (docs/alerts.md) and the alerts agree: every kind the detector and the
watchdog can raise has a section whose anchor is the kind, and every alert's message ends with the
pointer to that section. The alerts are real ones, from the detector fed the synthetic streams of
test_detect.py and from the watchdog on a DDP-free stand-in module."""

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from test_detect import NAMES, _duplicates, _non_finite, _stream

from ddphooks import detect, watchdog
from ddphooks.detect import DetectorConfig, detect_run
from ddphooks.detect.evidence import Evidence

PAGE = Path(__file__).resolve().parents[1] / "docs" / "alerts.md"
ANCHOR = re.compile(r"^#{2,6} .*\{#([A-Za-z0-9_-]+)\}\s*$", re.MULTILINE)


def _sections() -> dict[str, str]:
    """The page's sections with an explicit anchor: anchor -> its text, up to the next heading of
    the same or a higher level."""
    text = PAGE.read_text(encoding="utf-8")
    matches = list(ANCHOR.finditer(text))
    sections = {}
    for match, following in zip(matches, matches[1:] + [None]):
        sections[match.group(1)] = text[match.end() : following.start() if following else len(text)]
    return sections


class _StandIn(torch.nn.Module):
    """What SyncWatchdog needs of a DistributedDataParallel module, without a process group: its
    ``module``, ``require_backward_grad_sync`` and forward pre-hooks. Nothing calls the hook DDP
    would call, so every backward it should have synchronised is unsynchronised."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 1)
        self.require_backward_grad_sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _watchdog_alerts() -> list[dict]:
    alerts = []
    model = _StandIn()
    guard = watchdog.SyncWatchdog(model, raise_alert=alerts.append, log_note=lambda *args: None, rank=0, current_step=lambda: 7)
    try:
        model(torch.ones(1, 2)).sum().backward()
        guard.check()  # as flush() does: the backward is judged
    finally:
        guard.remove()
    return alerts


def _first(alerts: list[dict], kind: str) -> dict:
    found = [a for a in alerts if a["kind"] == kind]
    assert found, (kind, [(a["kind"], a["rank"], a["step"]) for a in alerts])
    return found[0]


def _shifted(world: int, seed: int, key: str, rank: int, change) -> list[dict]:
    """A healthy stream whose ``key`` on ``rank`` is changed from step 50 on."""
    records = _stream(world, 100, seed=seed)
    for record in records[50:]:
        record[key][rank] = change(record[key][rank])
    return records


def _real_alerts() -> dict[str, dict]:
    """One real alert of every kind: kind -> alert."""
    alerts = {}
    replicas = _stream(4, 12, seed=4)
    replicas[5]["replicas"] = {"ranks": [3], "tensors": 2, "parameters": [{"name": NAMES[0], "ranks": [3], "relative_difference": 0.01}]}
    alerts["replica"] = _first(detect_run(replicas), "replica")
    nonfinite = _stream(4, 12, seed=5)
    _non_finite(nonfinite[5], [1])
    for record in nonfinite[6:]:
        _non_finite(record, [0, 1, 2, 3])
    alerts["nonfinite"] = _first(detect_run(nonfinite), "nonfinite")
    alerts["duplicate_data"] = _first(detect_run(_duplicates(_stream(4, 6, seed=54), [0, 2])), "duplicate_data")
    alerts["combined"] = _first(detect_run(_stream(4, 70, seed=0, fault_rank=2, fault_step=60)), "combined")
    corrupted = _stream(4, 60, seed=1, fault_rank=1, fault_step=50, kind="sdc")
    for record in corrupted[50:]:  # the layer alone: the rank's total gradient norm as before
        record["grad_norms"][1] /= 3
    alerts["layer"] = _first(detect_run(corrupted), "layer")
    alerts["cosine_previous"] = _first(detect_run(_stream(4, 60, seed=24, fault_rank=1, fault_step=50, kind="stuck")), "cosine_previous")
    alerts["loss"] = _first(detect_run(_shifted(4, 9, "losses", 2, lambda v: v + 0.6)), "loss")
    alerts["grad_norm"] = _first(detect_run(_shifted(4, 7, "grad_norms", 1, lambda v: v * 3)), "grad_norm")
    alerts["cosine"] = _first(detect_run(_shifted(4, 8, "cosine_loo", 3, lambda v: v - 0.8)), "cosine")
    alerts["unsynchronised"] = _first(_watchdog_alerts(), "unsynchronised")
    return alerts


@pytest.fixture(scope="module")
def real_alerts() -> dict[str, dict]:
    return _real_alerts()


def _kinds_from_code(real_alerts: dict[str, dict]) -> set[str]:
    """Every kind an alert can have: the detector's (LIKELY_CAUSES, whose keys every detector
    alert's message uses; the statistical kinds are the names of its CUSUMs) and the watchdog's."""
    statistical = {name for _, name in Evidence(DetectorConfig(), 3).cusum}  # W >= 3: every CUSUM, the combined one included
    assert statistical <= set(detect.LIKELY_CAUSES), statistical - set(detect.LIKELY_CAUSES)
    return set(detect.LIKELY_CAUSES) | {real_alerts["unsynchronised"]["kind"]}


def test_every_kind_has_a_section_whose_anchor_is_the_kind(real_alerts):
    kinds = _kinds_from_code(real_alerts)
    anchors = ANCHOR.findall(PAGE.read_text(encoding="utf-8"))
    assert len(anchors) == len(set(anchors)), anchors  # each anchor once
    assert set(anchors) == kinds, (sorted(set(anchors) - kinds), sorted(kinds - set(anchors)))
    assert set(real_alerts) == kinds  # the messages below cover every kind


def test_every_alert_message_ends_with_the_pointer_to_its_section(real_alerts):
    sections = _sections()
    for kind, alert in real_alerts.items():
        assert alert["kind"] == kind
        assert detect.reference(kind) == f"see docs/alerts.md#{kind}"
        assert alert["message"].endswith(f"; see docs/alerts.md#{alert['kind']}"), alert["message"]
        assert alert["message"].count("docs/alerts.md") == 1, alert["message"]
        assert alert["kind"] in sections, alert["kind"]


def test_each_section_explains_its_kind_with_an_example_and_the_fields_are_documented(real_alerts):
    text = PAGE.read_text(encoding="utf-8")
    for kind, section in _sections().items():
        for part in ("**What it means.**", "**Example**", "**What to check first.**", "**Measured"):
            assert part in section, (kind, part)
        examples = re.findall(r"```text\n(.*?)\n```", section, re.DOTALL)
        assert len(examples) == 1, (kind, examples)
        # The example is a message of this kind, with what the code says it is typical of.
        assert examples[0].endswith(f"; {detect.reference(kind)}"), (kind, examples[0])
        cause = detect.LIKELY_CAUSES.get(kind, watchdog.CAUSES)
        assert cause in examples[0], (kind, cause)
        assert re.search(r"^1\. ", section, re.MULTILINE), kind  # what to check first: an ordered list
    for key in {key for alert in real_alerts.values() for key in alert}:
        assert f"| `{key}` |" in text, key  # every field in the table of the alert's fields


def test_each_section_names_the_module_that_raises_its_kind():
    # The reference maps onto the code: each section's "Raised by" is a module whose source raises
    # that kind (a rule of ddphooks.detect.rules, or the watchdog).
    for kind, section in _sections().items():
        found = re.search(r"\*\*Raised by\*\* `([\w.]+)`", section)
        assert found, kind
        assert f'"{kind}"' in inspect.getsource(importlib.import_module(found.group(1))), (kind, found.group(1))


def test_every_alert_message_starts_with_what_to_check_first_as_the_table_says(real_alerts):
    table = dict(re.findall(r"^\| \[`(\w+)`\]\(#\w+\) \| [^|]+ \| ([^|]+?) \|$", PAGE.read_text(encoding="utf-8"), re.MULTILINE))
    assert table == detect.FIRST_CHECK  # the message says what the reference's table says
    for kind, alert in real_alerts.items():
        check = detect.FIRST_CHECK[kind].replace("`since`", str(alert["since"]))
        assert alert["check_first"] == check and alert["message"].startswith(f"check {check} first: "), alert["message"]
