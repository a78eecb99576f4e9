"""End to end with the real servers: two gloo ranks train with a PrometheusSink on rank 0, a real
Prometheus scrapes it and evaluates the shipped rules, a real Alertmanager delivers the page to a
webhook served here. A fault on one rank reaches the webhook with its kind, rank and host; a
healthy run pages nobody.

Needs the ``prometheus`` and ``alertmanager`` binaries (Debian: ``apt-get install prometheus
prometheus-alertmanager``); skipped, with that reason, where they are absent. Everything listens
on 127.0.0.1 only, every wait is bounded, and the servers are killed in the fixture's teardown.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or ALERTMANAGER is None,
    reason="needs the prometheus and alertmanager binaries (apt-get install prometheus prometheus-alertmanager)",
)

#: Seconds to wait for a server to answer /-/ready.
READY_S = 30.0
#: Seconds to wait for the webhook after the faulty run's alert was raised.
DELIVERY_S = 40.0
#: Seconds a healthy run is watched after training: several 1 s scrape + evaluation cycles and
#: Alertmanager's 1 s group_wait, so a page, if any rule fired, would have arrived.
HEALTHY_WATCH_S = 6.0
#: The training ranks wait this long at most for the test to say it is done with the endpoint.
RANK_WAIT_S = 60.0
FAULT_STEP = 30
FAULT_RANK = 1
STEPS = 70


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            _get(url)
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {READY_S} s:\n{log.read_text()[-3000:]}")


class _Webhook:
    """Alertmanager's webhook receiver: keeps every POSTed payload with its arrival time."""

    def __init__(self) -> None:
        self.payloads: list[tuple[float, dict]] = []
        self.arrived = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with hook.arrived:
                    hook.payloads.append((time.time(), json.loads(body)))
                    hook.arrived.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def firing(self) -> list[tuple[float, dict]]:
        """(arrival time, alert) for every firing alert delivered so far."""
        with self.arrived:
            return [(t, alert) for t, payload in self.payloads for alert in payload.get("alerts", []) if alert.get("status") == "firing"]

    def wait_for(self, predicate, timeout: float) -> list[tuple[float, dict]]:
        with self.arrived:
            self.arrived.wait_for(lambda: any(predicate(a) for _, a in self.firing()), timeout)
        return [(t, a) for t, a in self.firing() if predicate(a)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Alertmanager (clustering off, group_wait 1 s, the webhook as receiver) and Prometheus
    (scrape and rule evaluation every 1 s, the shipped rules, the sink's port as its target)."""
    from ddphooks.sinks.prometheus import rules_path

    folder = tmp_path_factory.mktemp("prometheus-e2e")
    hook = _Webhook()
    sink_port, prometheus_port, alertmanager_port = _free_port(), _free_port(), _free_port()
    am_config = {  # JSON is YAML
        "route": {"receiver": "hook", "group_by": ["alertname", "kind", "rank"], "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "hook", "webhook_configs": [{"url": f"http://127.0.0.1:{hook.port}/", "send_resolved": False}]}],
    }
    prometheus_config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [rules_path()],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]},
        "scrape_configs": [{"job_name": "ddphooks-e2e", "static_configs": [{"targets": [f"127.0.0.1:{sink_port}"]}]}],
    }
    (folder / "alertmanager.yml").write_text(json.dumps(am_config))
    (folder / "prometheus.yml").write_text(json.dumps(prometheus_config))
    commands = {
        "alertmanager": [
            ALERTMANAGER, f"--config.file={folder / 'alertmanager.yml'}", f"--storage.path={folder / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{alertmanager_port}", "--cluster.listen-address=",
        ],
        "prometheus": [
            PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
        ],
    }  # fmt: skip
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, command in commands.items():
            log = folder / f"{name}.log"
            with open(log, "wb") as out:
                processes[name] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=folder)
        _wait_ready(f"http://127.0.0.1:{alertmanager_port}/-/ready", processes["alertmanager"], folder / "alertmanager.log")
        _wait_ready(f"http://127.0.0.1:{prometheus_port}/-/ready", processes["prometheus"], folder / "prometheus.log")
        yield {"hook": hook, "sink_port": sink_port, "prometheus": f"http://127.0.0.1:{prometheus_port}", "folder": folder}
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        hook.close()


def _query(prometheus: str, expression: str) -> list[dict]:
    answer = json.loads(_get(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expression})))
    return answer["data"]["result"]


def _wait_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.1)
    return path.exists()


def _train(rank: int, world: int, sink_port: int, folder: str, case: str) -> dict:
    """One run of the tiny MLP of test_hook on rank-dependent data; with ``case == "fault"``,
    ddphooks' sdc fault (one weight's gradient plus noise 4x its norm) on FAULT_RANK from
    FAULT_STEP. Both ranks stop after the same step once the first alert is collected
    (``stop_on``); ``on_alert`` notes when the detector found it. Rank 0 then writes what it saw to ``<case>.json`` and keeps its
    endpoint up until the test writes ``<case>.done`` (bounded)."""
    import torch
    from test_hook import _batch, _loss, _make_ddp

    import ddphooks
    from ddphooks.experiment.settings import GradientCorruption, sdc_parameter

    model = _make_ddp()
    sink = ddphooks.PrometheusSink(port=sink_port, addr="127.0.0.1")
    found: list[float] = []  # when on_alert was called (on its own thread, as the detector found the alert)
    state = ddphooks.attach(model, sketch_dim=256, sinks=[sink], on_alert=lambda alert: found.append(time.time()), stop_on="all", check_replicas_every=0)
    corruption = None
    if case == "fault" and rank == FAULT_RANK:
        corruption = GradientCorruption(model.get_parameter(sdc_parameter(model)), first_step=FAULT_STEP, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    fault_time = None
    for step in range(STEPS):
        if step == FAULT_STEP:
            fault_time = time.time()
        if corruption is not None:
            corruption.step = step
        x, y = _batch(rank, step)
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if state.should_stop():
            break
    state.flush()  # the alert's record has reached the sink
    alert_time = found[0] if found else None
    if rank == 0:
        seen = {"alerts": [dict(a) for a in state.alerts], "fault_time": fault_time, "alert_time": alert_time, "steps": step + 1, "port": sink.port}
        (Path(folder) / f"{case}.json").write_text(json.dumps(seen))
        _wait_file(Path(folder) / f"{case}.done", RANK_WAIT_S)
    state.close()
    return {"alerts": len(state.alerts)}


def _e2e(rank: int, world: int, sink_port: int, folder: str) -> list[dict]:
    return [_train(rank, world, sink_port, folder, case) for case in ("healthy", "fault")]


def test_a_fault_pages_through_prometheus_and_alertmanager_and_a_healthy_run_does_not(servers):
    from ddphooks.launch import spawn

    hook, folder, prometheus = servers["hook"], Path(servers["folder"]), servers["prometheus"]
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["results"] = spawn(_e2e, 2, args=(servers["sink_port"], str(folder)), timeout=240)
        except BaseException as error:  # reported by the test below
            outcome["error"] = error

    training = threading.Thread(target=run, daemon=True)
    training.start()
    try:
        # -- the healthy run: scraped, evaluated, and nobody paged
        assert _wait_file(folder / "healthy.json", 120), outcome.get("error")
        healthy = json.loads((folder / "healthy.json").read_text())
        assert healthy["alerts"] == [] and healthy["port"] == servers["sink_port"]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not _query(prometheus, f"ddphooks_records_total >= {healthy['steps']}"):
            time.sleep(0.5)
        assert _query(prometheus, f"ddphooks_records_total >= {healthy['steps']}"), "Prometheus never scraped the healthy run's records"
        time.sleep(HEALTHY_WATCH_S)
        assert hook.firing() == [], hook.firing()
        (folder / "healthy.done").write_text("")

        # -- the faulty run: the first alert reaches the webhook with its labels
        assert _wait_file(folder / "fault.json", 120), outcome.get("error")
        fault = json.loads((folder / "fault.json").read_text())
        assert fault["alerts"], "the detector raised no alert on the faulty run"
        first = fault["alerts"][0]
        assert first["rank"] == FAULT_RANK
        global_rank = first.get("global_rank", first["rank"])  # the alert's own global rank where the detector adds it

        def matches(alert: dict) -> bool:
            labels = alert["labels"]
            return labels.get("alertname") == "DdphooksAlert" and labels.get("kind") == first["kind"] and labels.get("rank") == str(global_rank)

        delivered = hook.wait_for(matches, DELIVERY_S)
        (folder / "fault.done").write_text("")
        assert delivered, f"no page for {first['kind']} on rank {global_rank} within {DELIVERY_S} s; got {hook.firing()}"
        arrival, alert = delivered[0]
        labels = alert["labels"]
        # alerts carry host and device once the detector adds them; until then the labels are
        # empty, which Prometheus does not keep (an empty label is an absent one)
        assert labels.get("host", "") == first.get("host", "") and labels.get("device", "") == first.get("device", "")
        assert labels["job"] == "ddphooks-e2e" and labels["severity"] == "critical"
        assert alert["annotations"]["runbook_url"] == f"docs/operations.md#{first['kind']}"
        assert alert["annotations"]["summary"].startswith(f"ddphooks {first['kind']} alert on global rank {global_rank}")
        print(
            f"\nprometheus e2e: {first['kind']} alert on rank {global_rank} (host {labels.get('host', '')!r}), raised "
            f"{fault['alert_time'] - fault['fault_time']:.2f} s after the fault step (step {first['step']}, fault from {FAULT_STEP}); "
            f"webhook delivery {arrival - fault['fault_time']:.2f} s after the fault step "
            f"({arrival - fault['alert_time']:.2f} s after the alert)"
        )
    finally:
        for case in ("healthy", "fault"):
            (folder / f"{case}.done").write_text("")  # release the ranks whatever happened
        training.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["results"][0] == [{"alerts": 0}, {"alerts": len(fault["alerts"])}]
