"""PrometheusSink: the metrics as Prometheus reads them (scraped over HTTP, parsed with
prometheus_client's own parser), bounded series at W = 4096, an endpoint that never hurts training
(port in use, hung scraper, close), and the shipped alerting rules (promtool)."""

from __future__ import annotations

import http.client
import json
import logging
import math
import pickle
import shutil
import socket
import subprocess
import sys
import time

import pytest

from ddphooks.sinks.scalars import SIGNALS

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ddphooks.sinks.prometheus import PrometheusSink, rules_path  # noqa: E402

W = 3


def make_record(step: int, world: int = W, **extra) -> dict:
    """A compact record after docs/records.md (values differ per step and per rank)."""
    losses = [1.0 + 0.1 * step + 0.01 * r for r in range(world)]
    record = {
        "step": step,
        "world_size": world,
        "per_rank": True,
        "losses": losses,
        "loss_mean": sum(losses) / world,
        "loss_std": 0.01,
        "loss_range": losses[-1] - losses[0],
        "loss_cv": 0.01,
        "grad_norms": [2.0 + step + 0.5 * r for r in range(world)],
        "grad_norm_mean": 2.5 + step,
        "grad_norm_std": 0.4,
        "grad_norm_cv": 0.1,
        "reduced_grad_norm": 1.5 + step,
        "cosine_to_others": [0.3, 0.2, None][:world] + [0.25] * max(0, world - 3),
        "cosine_previous": None,
        "mean_cosine": 0.25,
        "weighted_mean_cosine": 0.27,
        "noise_scale": None,
        "noise_scale_smoothed": 3.0,
        "nonfinite": {"losses": [], "gradients": []},
        "dropped_records": {},
        "alerts": [],
        "detail": False,
    }
    record.update(extra)
    return record


def null_record(step: int) -> dict:
    """A record whose every signal is null (nothing measured on the step)."""
    return make_record(step, **{key: None for key in SIGNALS}, losses=[None] * W, grad_norms=[None] * W, cosine_to_others=[None] * W)


def scrape(port: int, timeout: float = 5.0) -> dict[str, list]:
    """GET the endpoint; samples by name: ``{name: [(labels, value), ...]}``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        text = response.read().decode()
    finally:
        connection.close()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict, name: str, **labels) -> float:
    (found,) = [v for l, v in samples[name] if all(l.get(k) == str(w) for k, w in labels.items())]
    return found


@pytest.fixture
def sink():
    created = []

    def make(**kwargs) -> PrometheusSink:
        s = PrometheusSink(port=kwargs.pop("port", 0), addr=kwargs.pop("addr", "127.0.0.1"), **kwargs)
        created.append(s)
        return s

    yield make
    for s in created:
        s.close()


def test_metrics_after_records(sink):
    s = sink()
    identity = [{"global_rank": 10 + r, "group_rank": r, "host": f"host-{r}", "device": f"cuda:{r}"} for r in range(W)]
    s.write(make_record(0, identity=identity))
    alert = {"step": 1, "rank": 2, "kind": "layer", "since": 1, "message": "rank 2 ..."}
    s.write(make_record(1, alerts=[alert], dropped_records={"queue": 2}))
    s.write(make_record(2, dropped_records={"queue": 3, "JsonlSink('x')": 1}))
    samples = scrape(s.port)
    last = make_record(2)
    assert value(samples, "ddphooks_step") == 2 and value(samples, "ddphooks_world_size") == W
    for key in SIGNALS:  # every signal, under its own name; null is NaN (never the previous value)
        got = value(samples, f"ddphooks_{key}")
        assert math.isnan(got) if last[key] is None else got == pytest.approx(last[key]), key
    assert value(samples, "ddphooks_records_total") == 3
    assert abs(value(samples, "ddphooks_last_record_timestamp_seconds") - time.time()) < 600
    # the alert: global rank and host from the first record's identity (the alert dict lacks them)
    assert samples["ddphooks_alerts_total"] == [({"kind": "layer", "rank": "12", "host": "host-2", "device": "cuda:2"}, 1.0)]
    assert value(samples, "ddphooks_dropped_records_total", sink="queue") == 3
    assert value(samples, "ddphooks_dropped_records_total", sink="JsonlSink('x')") == 1
    # per-rank series labelled with the global rank; the null cosine of rank 2 is NaN
    assert value(samples, "ddphooks_rank_loss", rank=11) == pytest.approx(last["losses"][1])
    assert value(samples, "ddphooks_rank_grad_norm", rank=12) == pytest.approx(last["grad_norms"][2])
    assert math.isnan(value(samples, "ddphooks_rank_cosine_to_others", rank=12))
    assert value(samples, "ddphooks_rank_info", rank=11, group_rank=1, host="host-1", device="cuda:1") == 1
    assert value(samples, "ddphooks_loss_over_ranks", quantile="0.5") == pytest.approx(last["losses"][1])
    assert value(samples, "ddphooks_grad_norm_over_ranks", quantile="1") == pytest.approx(max(last["grad_norms"]))
    assert value(samples, "ddphooks_unmeasured_steps_total") == 0 and value(samples, "ddphooks_steps_since_measured") == 0


def test_alert_fields_win_over_identity_and_global_ranks_are_used(sink):
    """The alert's own global_rank/host/device (added by the detector) label it; without
    identity, the record's global_ranks (a subgroup) give the global rank."""
    s = sink()
    alerts = [
        {"rank": 0, "kind": "nonfinite", "global_rank": 7, "host": "node-a", "device": "cuda:3", "where": "global rank 7 ..."},
        {"rank": 1, "kind": "loss"},
    ]
    s.write(make_record(0, global_ranks=[4, 5, 6], alerts=alerts))
    samples = scrape(s.port)
    assert sorted(tuple(sorted(l.items())) for l, _ in samples["ddphooks_alerts_total"]) == [
        (("device", ""), ("host", ""), ("kind", "loss"), ("rank", "5")),
        (("device", "cuda:3"), ("host", "node-a"), ("kind", "nonfinite"), ("rank", "7")),
    ]
    assert value(samples, "ddphooks_rank_loss", rank=6) == pytest.approx(make_record(0)["losses"][2])


def test_unmeasured_steps_from_gaps_and_null_records(sink):
    s = sink()
    for step in (0, 10, 20, 50):  # every = 10, inferred: steps 30 and 40 are missing
        s.write(make_record(step))
    samples = scrape(s.port)
    assert value(samples, "ddphooks_unmeasured_steps_total") == 2
    s.write(null_record(60))
    s.write(null_record(70))
    samples = scrape(s.port)
    assert value(samples, "ddphooks_unmeasured_steps_total") == 4
    assert value(samples, "ddphooks_steps_since_measured") == 20  # from step 50
    s.write(make_record(0))  # a restarted run: the step went back, nothing counted
    s.write(make_record(10))
    samples = scrape(s.port)
    assert value(samples, "ddphooks_unmeasured_steps_total") == 4 and value(samples, "ddphooks_steps_since_measured") == 0
    given = sink(every=5)  # the state's every, given: the first gap counts too
    given.write(make_record(0))
    given.write(make_record(15))
    assert value(scrape(given.port), "ddphooks_unmeasured_steps_total") == 2


def over_ranks_summary(values: list[float]) -> dict:
    return {"known": len(values), "quantiles": dict(zip(["min", "p01", "p10", "p25", "median", "p75", "p90", "p99", "max"], sorted(values)[:9])), "outliers": [[3000, 9.0], [7, 8.0]]}


def test_series_stay_bounded_at_4096_ranks(sink):
    """A compact record at W = 4096 (quantiles instead of lists) and a detail record with every
    rank's values: per-rank series only for ranks below max_ranks plus the ranks alerts named."""
    world = 4096
    s = sink(max_alerted_ranks=2)
    compact = make_record(0, world=world, per_rank=False, losses=None, grad_norms=None, cosine_to_others=None, cosine_previous=None)
    compact.update({f"{key}_over_ranks": over_ranks_summary([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]) for key in ("losses", "grad_norms", "cosine_to_others", "cosine_previous")})
    compact["alerts"] = [{"rank": 3000, "kind": "layer"}, {"rank": 7, "kind": "loss"}]
    s.write(compact)
    samples = scrape(s.port)
    ranks = {l["rank"] for l, _ in samples["ddphooks_rank_loss"]}
    assert ranks == {str(r) for r in range(16)} | {"3000"}
    assert value(samples, "ddphooks_rank_loss", rank=3000) == 9.0  # from the record's outliers
    assert math.isnan(value(samples, "ddphooks_rank_loss", rank=0))  # not in this compact record
    assert value(samples, "ddphooks_loss_over_ranks", quantile="0.99") == 8.0
    detail = make_record(100, world=world, detail=True, alerts=[{"rank": 4000, "kind": "grad_norm"}, {"rank": 4001, "kind": "grad_norm"}])
    s.write(detail)
    samples = scrape(s.port)
    ranks = {l["rank"] for l, _ in samples["ddphooks_rank_loss"]}
    assert ranks == {str(r) for r in range(16)} | {"4000", "4001"}  # 3000 dropped: max_alerted_ranks=2
    assert value(samples, "ddphooks_rank_loss", rank=4001) == pytest.approx(detail["losses"][4001])
    series = sum(len(v) for v in samples.values())
    assert series < 400, series
    for name, found in samples.items():
        assert name.startswith("ddphooks_"), name
        assert len(found) <= 4 * 64, (name, len(found))


def test_alert_series_are_capped(sink, caplog):
    s = sink(max_alert_series=2)
    compact = dict(world=4096, per_rank=False, losses=None, grad_norms=None, cosine_to_others=None)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        s.write(make_record(0, **compact, alerts=[{"rank": r, "kind": "loss"} for r in range(5)]))
        s.write(make_record(1, **compact, alerts=[{"rank": 9, "kind": "loss"}]))
    samples = scrape(s.port)
    assert {l["rank"]: v for l, v in samples["ddphooks_alerts_total"]} == {"0": 1.0, "1": 1.0, "other": 4.0}
    assert sum("max_alert_series" in r.getMessage() for r in caplog.records) == 1  # said once


def test_port_in_use_warns_and_training_goes_on(sink, caplog):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        s = sink(port=port)
        with caplog.at_level(logging.WARNING, logger="ddphooks"):
            s.write(make_record(0))
            s.write(make_record(1))
        assert s.port is None
        (message,) = [r.getMessage() for r in caplog.records if "PrometheusSink" in r.getMessage()]
        assert f"127.0.0.1:{port}" in message and "PrometheusSink(port=...)" in message
        # the metrics are still kept (for a push, or a registry read)
        assert prometheus_client.generate_latest(s.registry).count(b"ddphooks_records_total 2.0") == 1
    finally:
        busy.close()


def test_port_per_local_rank(sink, monkeypatch):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    base = probe.getsockname()[1]
    probe.close()
    monkeypatch.setenv("LOCAL_RANK", "1")
    s = sink(port=base - 1, port_per_local_rank=True)
    s.bind_rank(9)  # SilentState binds it on a writing rank: the endpoint starts there
    assert s.port == base
    assert value(scrape(s.port), "ddphooks_records_total") == 0


def test_a_hung_scraper_blocks_neither_other_scrapes_nor_writes(sink):
    s = sink()
    s.write(make_record(0))
    hung = socket.create_connection(("127.0.0.1", s.port))
    try:
        hung.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half a request, never finished
        for step in range(1, 51):  # write sets values only: the hung connection's thread is not in its way
            s.write(make_record(step))
        # a second scraper is served (a hang would raise socket.timeout), and sees every write
        assert value(scrape(s.port, timeout=5.0), "ddphooks_records_total") == 51
    finally:
        hung.close()


def test_close_frees_the_port_and_later_writes_fail(sink):
    s = sink()
    s.write(make_record(0))
    port = s.port
    s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(ValueError, match="closed"):
        s.write(make_record(1))
    again = sink(port=port)  # the port is free again
    again.write(make_record(0))
    assert again.port == port


def test_two_sinks_in_one_process_do_not_collide(sink):
    a, b = sink(), sink()
    a.write(make_record(0))
    b.write(make_record(5))
    b.write(make_record(6))
    assert value(scrape(a.port), "ddphooks_step") == 0 and value(scrape(b.port), "ddphooks_records_total") == 2


def test_settings_are_checked_and_the_sink_pickles_before_it_starts():
    for kwargs, name in (({"port": -1}, "port"), ({"port": "9464"}, "port"), ({"port": 1, "max_ranks": -1}, "max_ranks"),
                         ({"port": 1, "max_alerted_ranks": -1}, "max_alerted_ranks"), ({"port": 1, "every": 0}, "every"),
                         ({"port": 1, "addr": ""}, "addr")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            PrometheusSink(**kwargs)
    copy = pickle.loads(pickle.dumps(PrometheusSink(port=9464, addr="127.0.0.1", max_ranks=4, every=10)))
    assert (copy.base_port, copy.addr, copy.max_ranks, copy.every, copy.port) == (9464, "127.0.0.1", 4, 10, None)


def test_missing_library_message_and_no_import_at_import_ddphooks(monkeypatch):
    code = "import sys, ddphooks; assert 'prometheus_client' not in sys.modules; print(ddphooks.PrometheusSink.__name__)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "PrometheusSink"
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install 'ddphooks\[prometheus\]'"):
        PrometheusSink(port=9464)


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_rules_file_passes_promtool_check():
    result = subprocess.run([PROMTOOL, "check", "rules", rules_path()], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 4 rules found" in result.stdout


def _series(name: str, values: str, **labels) -> dict:
    labels = {"job": "train", "instance": "node-a:9464", **labels}
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_rules_fire_when_they_should_promtool_unit_tests(tmp_path):
    """The rules' behaviour on synthetic series (promtool test rules): a kind/rank's first alert
    (a new counter series) and a later one both page, with their labels and runbook link, then
    resolve; stale records page only while the target is up; unmeasured steps and drops."""
    alert_labels = {"kind": "layer", "rank": "3", "host": "node-a", "device": "cuda:1"}
    later_labels = {"kind": "loss", "rank": "5", "host": "node-b", "device": "cuda:0"}

    def paged(labels: dict) -> list[dict]:
        kind, rank, host, device = labels["kind"], labels["rank"], labels["host"], labels["device"]
        return [{
            "exp_labels": {"job": "train", "instance": "node-a:9464", "severity": "critical", **labels},
            "exp_annotations": {
                "summary": f"ddphooks {kind} alert on global rank {rank} on {host} ({device}), job train",
                "description": f"The ddphooks detector raised a {kind} alert naming global rank {rank} on host {host}, device {device} "
                "(target node-a:9464). Its message (numbers, parameters, the step it started) is in the training log "
                '("ddphooks alert: ...") and in the records\' "alerts".',
                "runbook_url": f"docs/operations.md#{kind}",
            },
        }]  # fmt: skip

    def warned(name: str, instance: str, severity: str = "warning", **labels) -> dict:
        return {"alertname": name, "exp_alerts": [{"exp_labels": {"job": "train", "instance": instance, "severity": severity, **labels}}]}

    tests = {
        "rule_files": [rules_path()],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                _series("ddphooks_alerts_total", "_ _ _ 1x60", **alert_labels),  # created by its first alert at 3m
                _series("ddphooks_alerts_total", "0x20 1x40", **later_labels),  # an existing series, +1 at 21m
                _series("ddphooks_last_record_timestamp_seconds", "0+60x10 600x40"),  # records stop at 10m
                _series("up", "1x60"),
                _series("ddphooks_last_record_timestamp_seconds", "0+60x10 600x40", instance="node-b:9464"),
                _series("up", "1x10 0x50", instance="node-b:9464"),  # the process ended: not this rule's page
                _series("ddphooks_unmeasured_steps_total", "0x5 0+1x30", instance="node-c:9464"),
                _series("ddphooks_dropped_records_total", "0x10 4x30", sink="queue", instance="node-d:9464"),
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "DdphooksAlert", "exp_alerts": paged(alert_labels)},
                {"eval_time": "15m", "alertname": "DdphooksAlert", "exp_alerts": paged(alert_labels)},
                {"eval_time": "20m", "alertname": "DdphooksAlert", "exp_alerts": []},
                {"eval_time": "23m", "alertname": "DdphooksAlert", "exp_alerts": paged(later_labels)},
                {"eval_time": "45m", "alertname": "DdphooksAlert", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "DdphooksRecordsStopped", "exp_alerts": []},
                {"eval_time": "8m", "alertname": "DdphooksStatisticsUnmeasured", "exp_alerts": []},
            ],
        }],
    }
    # promtool compares the annotations too (templates rendered)
    checks = [("30m", warned("DdphooksRecordsStopped", "node-a:9464")), ("25m", warned("DdphooksStatisticsUnmeasured", "node-c:9464")),
              ("15m", warned("DdphooksRecordsDropped", "node-d:9464", severity="info", sink="queue"))]  # fmt: skip
    annotations = {
        "DdphooksRecordsStopped": {
            "summary": "no ddphooks record for 20m 0s on node-a:9464 (job train)",
            "description": "The training process still serves its metrics but has written no record for 20m 0s: training is stuck, "
            'or every step\'s statistics fail (the log of the rank says why: "step N is not measured").',
            "runbook_url": "docs/operations.md#records-stopped",
        },
        "DdphooksStatisticsUnmeasured": {
            "summary": "ddphooks statistics unmeasured on 15 steps in 15 minutes on node-c:9464",
            "description": "15 instrumented steps of job train had no statistics in the last 15 minutes: the detector is blind on them. "
            'The training log says why once ("ddphooks: step N is not measured").',
            "runbook_url": "docs/operations.md#statistics-unmeasured",
        },
        "DdphooksRecordsDropped": {
            "summary": "ddphooks dropped 4 records for sink queue on node-d:9464",
            "description": "Sink queue of job train missed records in the last 15 minutes (slower than training, or raising: the "
            "training log names its error once).",
            "runbook_url": "docs/operations.md#records-dropped",
        },
    }  # fmt: skip
    for eval_time, check in checks:
        check["exp_alerts"][0]["exp_annotations"] = annotations[check["alertname"]]
        tests["tests"][0]["alert_rule_test"].append({"eval_time": eval_time, **check})
    path = tmp_path / "rules-test.yml"
    path.write_text(json.dumps(tests))  # JSON is YAML
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_runbook_link_has_its_section_in_operations_md():
    """The rules link to docs/operations.md#<kind> and #<name>: the page has a section for every
    alert kind of docs/alerts.md and for every other rule's anchor."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    anchor = re.compile(r"^#{2,6} .*\{#([A-Za-z0-9_-]+)\}\s*$", re.MULTILINE)
    kinds = set(anchor.findall((docs / "alerts.md").read_text(encoding="utf-8")))
    sections = set(anchor.findall((docs / "operations.md").read_text(encoding="utf-8")))
    rules = Path(rules_path()).read_text(encoding="utf-8")
    fixed = set(re.findall(r"docs/operations\.md#([a-z-]+)\"", rules))
    assert {"replica", "layer", "nonfinite"} <= kinds and fixed == {"records-stopped", "statistics-unmeasured", "records-dropped"}
    assert "docs/operations.md#{{ $labels.kind }}" in rules
    assert kinds | fixed <= sections, (kinds | fixed) - sections


def test_a_hung_scraper_is_dropped_after_the_socket_timeout_quietly(sink, monkeypatch, capfd, caplog):
    import ddphooks.sinks.prometheus as module

    monkeypatch.setattr(module, "SCRAPE_SOCKET_TIMEOUT_S", 0.5)
    s = sink()
    s.write(make_record(0))
    hung = socket.create_connection(("127.0.0.1", s.port))
    try:
        with caplog.at_level(logging.DEBUG, logger="ddphooks"):
            hung.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request
            hung.settimeout(10.0)  # a bound on the test, far above the sink's 0.5 s
            # the endpoint closed the connection (after logging why: socketserver reports, then shuts the socket)
            assert hung.recv(1024) == b""
    finally:
        hung.close()
    assert "Traceback" not in capfd.readouterr().err  # no traceback printed into the training log
    assert any("a scrape from" in r.getMessage() for r in caplog.records)  # at debug level instead
