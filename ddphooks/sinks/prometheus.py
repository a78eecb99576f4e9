"""Prometheus sink: the step signals and alert counts on an HTTP endpoint Prometheus scrapes.

Needs the ``prometheus-client`` package (``pip install 'ddphooks[prometheus]'``); it is imported
when the sink is created, never by ``import ddphooks``. The alerting rules that page on these
metrics ship with the package (``ddphooks/ops/prometheus-rules.yml``, see ``rules_path()``), and
docs/operations.md says how to deploy both.

Why a pull endpoint and counters: Prometheus pages on what it scrapes, and a counter of alerts
survives a missed scrape (an alert raised between two scrapes still shows as an increase), where a
gauge "last alert" would be overwritten by the next record.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from importlib import resources

import numpy as np

from ddphooks.identity import RankTable
from ddphooks.sinks.base import Sink
from ddphooks.sinks.scalars import DEFAULT_MAX_RANKS, PER_RANK, SIGNALS, record_scalars
from ddphooks.stats import OVER_RANKS_QUANTILES, over_ranks

logger = logging.getLogger("ddphooks")

#: Ranks named in alerts that keep per-rank series beyond ``max_ranks`` (the most recently named).
DEFAULT_MAX_ALERTED_RANKS = 16
#: Label sets of ``ddphooks_alerts_total`` kept apart; alerts beyond them count under rank "other".
DEFAULT_MAX_ALERT_SERIES = 256
#: Seconds the endpoint waits on a scraper that connected but does not finish its request (or read
#: its answer) before dropping the connection: a hung scraper holds one thread for this long at most.
SCRAPE_SOCKET_TIMEOUT_S = 30.0
#: Seconds ``close()`` waits for the endpoint's thread to stop.
CLOSE_TIMEOUT_S = 5.0
#: Help strings of the step signals (``ddphooks_<signal>`` gauges), after docs/records.md.
SIGNAL_HELP = {
    "loss_mean": "Mean over the ranks of each rank's loss on the latest recorded step.",
    "loss_std": "Population standard deviation of the ranks' losses on the latest recorded step.",
    "loss_range": "Largest minus smallest rank loss on the latest recorded step.",
    "loss_cv": "Coefficient of variation (std / |mean|) of the ranks' losses on the latest recorded step.",
    "grad_norm_mean": "Mean over the ranks of the L2 norm of each rank's local gradient (before averaging).",
    "grad_norm_std": "Population standard deviation of the ranks' local gradient norms.",
    "grad_norm_cv": "Coefficient of variation (std / mean) of the ranks' local gradient norms.",
    "reduced_grad_norm": "L2 norm of the averaged gradient every rank applies.",
    "mean_cosine": "Mean off-diagonal sketched cosine between the ranks' local gradients.",
    "weighted_mean_cosine": "Exact norm-weighted mean pairwise cosine between the ranks' local gradients.",
    "noise_scale": "Gradient noise scale of the step, in units of one rank's batch.",
    "noise_scale_smoothed": "Gradient noise scale from moving averages of its two terms, in units of one rank's batch.",
}
#: Help strings of the per-rank signals (``ddphooks_rank_<suffix>`` and ``ddphooks_<suffix>_over_ranks``).
PER_RANK_HELP = {
    "loss": "the rank's mean loss of the step",
    "grad_norm": "the L2 norm of the rank's local gradient before averaging",
    "cosine_to_others": "the rank's mean sketched gradient cosine to the other ranks",
    "cosine_previous": "the sketched cosine between the rank's gradient and its own of the previous instrumented step",
}


def _prometheus_client():
    try:
        import prometheus_client
    except ImportError as error:
        raise ImportError("PrometheusSink needs the prometheus-client package: pip install 'ddphooks[prometheus]'") from error
    return prometheus_client


def rules_path() -> str:
    """Path of the alerting rules file shipped with ddphooks (``ddphooks/ops/prometheus-rules.yml``),
    to copy or point Prometheus' ``rule_files`` at.

    Example::

        >>> rules_path().endswith("prometheus-rules.yml")
        True
    """
    return str(resources.files("ddphooks").joinpath("ops", "prometheus-rules.yml"))


def _number(value) -> float:
    """A record value as a gauge value: null (or anything not a finite number) becomes NaN, so a
    gauge never shows an old value as the current one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _quantile_label(q: float) -> str:
    return f"{q:g}"  # 0, 0.01, ... 0.5, ... 1: as Prometheus' own summaries write them


class PrometheusSink(Sink):
    """Serves the latest record's signals and running alert counts for Prometheus to scrape.

    Metrics (all gauges unless said; a null in a record is NaN, never the previous value):

    - ``ddphooks_step``, ``ddphooks_world_size``: the latest record's step and world size;
    - ``ddphooks_<signal>`` for each signal of ``ddphooks.sinks.scalars.SIGNALS``
      (``ddphooks_loss_mean``, ``ddphooks_grad_norm_std``, ``ddphooks_mean_cosine`` ...);
    - ``ddphooks_records_total`` (counter) and ``ddphooks_last_record_timestamp_seconds`` (Unix
      time of the latest write): records stopped arriving while the endpoint is up = training or
      the statistics are stuck;
    - ``ddphooks_alerts_total{kind, rank, host, device}`` (counter): one increment per alert of
      ``record["alerts"]``; ``rank`` is the global rank, ``host`` and ``device`` where the alert
      or the record's ``identity`` says them (else "");
    - ``ddphooks_dropped_records_total{sink}`` (counter): records a sink (``"queue"``: every sink)
      missed, from ``record["dropped_records"]``;
    - ``ddphooks_unmeasured_steps_total`` (counter) and ``ddphooks_steps_since_measured``:
      instrumented steps without statistics. A step whose statistics failed is not written at all,
      so a gap in ``step`` beyond the instrumentation period ``every`` counts its missing steps,
      and a record whose signals are all null counts one; the gauge is the training steps from the
      last record with a measured signal to the latest record (0 when the latest was measured);
    - ``ddphooks_rank_<loss|grad_norm|cosine_to_others|cosine_previous>{rank}``: per-rank values
      for the ranks below ``max_ranks`` and the last ``max_alerted_ranks`` ranks named in alerts;
      NaN on records that do not carry that rank's value (compact records above
      ``per_rank_max_world`` carry only quantiles and outliers);
    - ``ddphooks_rank_info{rank, group_rank, host, device}`` = 1 for those ranks, where the record's
      ``identity`` names them (to join a rank to its host in a query);
    - ``ddphooks_<loss|grad_norm|cosine_to_others|cosine_previous>_over_ranks{quantile}``: the
      signal's quantiles over the ranks (0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1), from the
      record's ``*_over_ranks`` or computed from its per-rank list.

    Series at most, whatever W (W = 4096 included): 16 step gauges, 36 quantile gauges, 5 x
    (``max_ranks`` + ``max_alerted_ranks``) per-rank and info gauges (160 at the defaults),
    2 x (``max_alert_series`` + one "other" per kind) alert counter series (``_total`` and
    ``_created``; 532 with the 10 kinds), 2 per sink for drops, 4 for the record and unmeasured
    counters: about 750 at the defaults.

    The endpoint (``/metrics``, and any path: prometheus_client serves metrics only) is
    prometheus_client's threaded server, one thread per scrape, started when ``SilentState`` binds
    the sink on a writing rank (``bind_rank``) or on the first write, so ranks that do not write
    open no port. A port in use does not stop training: a warning on the ``"ddphooks"`` logger names
    the port and the fix, and the sink goes on updating its metrics without an endpoint (no other
    port is tried: Prometheus scrapes a fixed address, and a sink on a port it does not know is
    as unseen as none). ``write`` only sets metric values, never waits on a scraper.

    Args:
        port: TCP port of the endpoint (0: any free port, see ``port`` after the start). No
            default: the port must be one the Prometheus scrape configuration knows and no other
            exporter on the host uses (DCGM's exporter takes 9400, node_exporter 9100).
        addr: address to listen on. Default ``"0.0.0.0"`` (every interface, as prometheus_client
            and node_exporter do): Prometheus usually scrapes from another host or pod. The
            endpoint is read-only; use ``"127.0.0.1"`` where an agent on the same host scrapes,
            or where the network is not trusted.
        port_per_local_rank: add the ``LOCAL_RANK`` environment variable (torchrun sets it; 0
            where unset) to ``port``, so that several writing ranks of one host (``log_rank=None``,
            or one log rank per data-parallel group) each get a port.
        max_ranks: ranks ``0 .. max_ranks - 1`` (in the data-parallel group) get per-rank
            series; ``None`` = every rank (W series per signal: not at large W), 0 = none.
        max_alerted_ranks: ranks named in alerts that also get per-rank series, the most
            recently named first; older ones' series are removed.
        max_alert_series: distinct (kind, rank, host, device) label sets of the alert counter;
            alerts beyond them count under ``rank="other"`` (a warning says so once).
        every: the state's instrumentation period, to tell a missing step from a step that was
            never instrumented; None: the record's ``every`` where it has one, else the smallest
            step gap seen so far.

    Raises:
        ImportError: prometheus-client is not installed.
        ValueError: a bad setting (named, with its fix).

    Example::

        import ddphooks
        from ddphooks import PrometheusSink

        state = ddphooks.attach(model, sinks=[PrometheusSink(port=9464, port_per_local_rank=True)])
        # scrape http://<host>:9464 + local rank; rules: ddphooks/ops/prometheus-rules.yml
    """

    def __init__(
        self,
        port: int,
        addr: str = "0.0.0.0",
        *,
        port_per_local_rank: bool = False,
        max_ranks: int | None = DEFAULT_MAX_RANKS,
        max_alerted_ranks: int = DEFAULT_MAX_ALERTED_RANKS,
        max_alert_series: int = DEFAULT_MAX_ALERT_SERIES,
        every: int | None = None,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
        if not isinstance(addr, str) or not addr:
            raise ValueError(f"addr must be an address to listen on, e.g. '0.0.0.0' or '127.0.0.1', got {addr!r}")
        record_scalars({}, max_ranks=max_ranks)  # validates max_ranks here, not on the writer thread
        for name, value, least in (("max_alerted_ranks", max_alerted_ranks, 0), ("max_alert_series", max_alert_series, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be None (inferred) or the state's every, an int >= 1; got {every!r}")
        _prometheus_client()  # fail here, not on the writer thread
        self.base_port = port
        self.addr = addr
        self.port_per_local_rank = port_per_local_rank
        self.max_ranks = max_ranks
        self.max_alerted_ranks = max_alerted_ranks
        self.max_alert_series = max_alert_series
        self.every = every
        self.port: int | None = None
        """The port the endpoint listens on once started (None before, or where it could not start)."""
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self.registry = None  # created on bind or the first write: the sink pickles before that
        self._metrics: dict = {}
        self._server = None
        self._thread = None
        self._start_tried = False
        self._closed = False
        self._lock = threading.Lock()
        self._identity: list[dict] = []
        self._global_ranks: list[int] | None = None
        self._alerted: OrderedDict[int, None] = OrderedDict()  # group ranks named in alerts, oldest first
        self._rank_labels: dict[int, tuple] = {}  # group rank -> its labels in ddphooks_rank_* now
        self._alert_series: set[tuple] = set()
        self._warned_alert_series = False
        self._dropped_seen: dict[str, int] = {}
        self._last_step: int | None = None
        self._first_step: int | None = None
        self._last_measured_step: int | None = None
        self._step_gap: int | None = None

    def __getstate__(self) -> dict:
        if self._server is not None:
            raise TypeError("a PrometheusSink serving its endpoint cannot be pickled; pickle it before it is bound or written to")
        keep = ("base_port", "addr", "port_per_local_rank", "max_ranks", "max_alerted_ranks", "max_alert_series", "every")
        return {key: self.__dict__[key] for key in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.port = None
        self._reset_runtime()

    @property
    def name(self) -> str:
        return f"PrometheusSink({self.addr}:{self.port if self.port is not None else self._wanted_port()})"

    def _wanted_port(self) -> int:
        if not self.port_per_local_rank:
            return self.base_port
        local_rank = os.environ.get("LOCAL_RANK", "0")
        try:
            return self.base_port + int(local_rank)
        except ValueError:
            raise ValueError(
                f"LOCAL_RANK={local_rank!r} is not an int: port_per_local_rank=True adds it to port={self.base_port}"
            ) from None

    # -- start-up -----------------------------------------------------------------------------------
    def bind_rank(self, rank: int) -> None:
        """Called by ``SilentState`` on the ranks that write: starts the endpoint now, so
        Prometheus sees the target up from the start of training."""
        self._open()

    def _open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.name} is closed")
        with self._lock:
            if self.registry is None:
                self._create_metrics()
            if not self._start_tried:
                self._start_tried = True
                self._start_server()

    def _create_metrics(self) -> None:
        client = _prometheus_client()
        registry = client.CollectorRegistry(auto_describe=True)  # its own: two sinks in one process never collide
        gauge = lambda name, doc, labels=(): client.Gauge(name, doc, labels, registry=registry)  # noqa: E731
        counter = lambda name, doc, labels=(): client.Counter(name, doc, labels, registry=registry)  # noqa: E731
        m = self._metrics
        m["step"] = gauge("ddphooks_step", "Training step of the latest ddphooks record.")
        m["world_size"] = gauge("ddphooks_world_size", "Ranks in the data-parallel group of the latest record.")
        m["signals"] = {key: gauge(f"ddphooks_{key}", SIGNAL_HELP[key]) for key in SIGNALS}
        m["records"] = counter("ddphooks_records", "Records this sink received (one per instrumented step that was measured).")
        m["last_record"] = gauge("ddphooks_last_record_timestamp_seconds", "Unix time at which this sink received the latest record.")
        m["alerts"] = counter(
            "ddphooks_alerts",
            "Alerts raised by the ddphooks detector, by kind (see docs/alerts.md#<kind>), global rank, host and device.",
            ("kind", "rank", "host", "device"),
        )
        m["dropped"] = counter("ddphooks_dropped_records", "Records a sink missed ('queue': dropped before any sink saw them).", ("sink",))
        m["dropped"].labels("queue")  # exported at 0 from the start, so an increase is seen from the first drop
        m["unmeasured"] = counter(
            "ddphooks_unmeasured_steps",
            "Instrumented steps without statistics: steps missing between records, and records whose signals are all null.",
        )
        m["since_measured"] = gauge(
            "ddphooks_steps_since_measured",
            "Training steps from the last record with a measured signal to the latest record (0: measured).",
        )
        m["rank"] = {
            suffix: gauge(f"ddphooks_rank_{suffix}", f"Per rank: {PER_RANK_HELP[suffix]} (NaN where the record does not carry it).", ("rank",))
            for _, suffix in PER_RANK
        }
        m["rank_info"] = gauge(
            "ddphooks_rank_info", "1 for each rank with per-rank series: its group rank, host and device.", ("rank", "group_rank", "host", "device")
        )
        m["over_ranks"] = {
            suffix: gauge(f"ddphooks_{suffix}_over_ranks", f"Quantiles over the ranks of {PER_RANK_HELP[suffix]}.", ("quantile",))
            for _, suffix in PER_RANK
        }
        self.registry = registry

    def _start_server(self) -> None:
        client = _prometheus_client()
        port = self._wanted_port()
        try:
            server, thread = client.start_http_server(port, addr=self.addr, registry=self.registry)
        except OSError as error:
            logger.warning(
                "ddphooks: PrometheusSink could not listen on %s:%d (%s); training goes on and the metrics are kept, but "
                "nothing serves them: give a free port (PrometheusSink(port=...)), or port_per_local_rank=True where several "
                "writing ranks share a host",
                self.addr, port, error,
            )  # fmt: skip
            return
        # A scraper that connects and then hangs holds only its own thread, and only this long.
        server.RequestHandlerClass = type("DdphooksScrapeHandler", (server.RequestHandlerClass,), {"timeout": SCRAPE_SOCKET_TIMEOUT_S})
        # socketserver prints the traceback of a failed scrape (that hung scraper timing out) to
        # stderr, into the training log: a scraper's trouble is logged at debug level instead.
        server.handle_error = _log_scrape_error
        self._server, self._thread = server, thread
        self.port = server.server_port

    # -- records ------------------------------------------------------------------------------------
    def write(self, record: dict) -> None:
        if self.registry is None or not self._start_tried:
            self._open()
        elif self._closed:
            raise ValueError(f"{self.name} is closed")
        m = self._metrics
        table = RankTable.from_record(record)
        if table is not None:
            self._identity = [identity.to_dict() for identity in table.identities]
        if record.get("global_ranks"):
            self._global_ranks = list(record["global_ranks"])
        step = int(record["step"])
        world = int(record.get("world_size") or 0)
        m["step"].set(step)
        m["world_size"].set(world)
        for key, metric in m["signals"].items():
            metric.set(_number(record.get(key)))
        self._count_unmeasured(record, step)
        for label, count in (record.get("dropped_records") or {}).items():
            new = int(count) - self._dropped_seen.get(label, 0)
            if new > 0:
                m["dropped"].labels(str(label)).inc(new)
            self._dropped_seen[label] = max(int(count), self._dropped_seen.get(label, 0))
        for alert in record.get("alerts") or ():
            self._count_alert(alert)
        self._set_per_rank(record, world)
        m["records"].inc()
        m["last_record"].set(time.time())

    def _count_unmeasured(self, record: dict, step: int) -> None:
        m = self._metrics
        measured = any(math.isfinite(_number(record.get(key))) for key in SIGNALS)
        every = self.every or record.get("every")
        last = self._last_step
        if last is None or step <= last:  # the first record, or a restarted run (the step went back): count afresh
            self._first_step, self._last_measured_step, self._step_gap = step, None, None
        else:
            gap = step - last
            if every is None:  # the smallest gap before this one: the first gap is never counted as missing steps
                every, self._step_gap = self._step_gap, gap if self._step_gap is None else min(self._step_gap, gap)
            missing = gap // int(every) - 1 if every else 0
            if missing > 0:
                m["unmeasured"].inc(missing)
        if measured:
            self._last_measured_step = step
        else:
            m["unmeasured"].inc()
        self._last_step = step
        base = self._last_measured_step if self._last_measured_step is not None else self._first_step
        m["since_measured"].set(step - base)

    # -- ranks and alerts ---------------------------------------------------------------------------
    def _who(self, group_rank: int) -> dict:
        """Global rank, host and device of a group rank, from the latest identity (or global_ranks)."""
        who = self._identity[group_rank] if 0 <= group_rank < len(self._identity) and isinstance(self._identity[group_rank], dict) else {}
        if who.get("global_rank") is not None:
            global_rank = who["global_rank"]
        elif self._global_ranks is not None and 0 <= group_rank < len(self._global_ranks):
            global_rank = self._global_ranks[group_rank]
        else:
            global_rank = group_rank
        return {"global_rank": int(global_rank), "host": str(who.get("host") or ""), "device": str(who.get("device") or "")}

    def _count_alert(self, alert: dict) -> None:
        group_rank = alert.get("rank")
        who = self._who(int(group_rank)) if isinstance(group_rank, int) else {"global_rank": None, "host": "", "device": ""}
        global_rank = alert.get("global_rank") if alert.get("global_rank") is not None else who["global_rank"]
        labels = (
            str(alert.get("kind") or "unknown"),
            "" if global_rank is None else str(global_rank),
            str(alert.get("host") or who["host"]),
            str(alert.get("device") or who["device"]),
        )
        if labels not in self._alert_series and len(self._alert_series) >= self.max_alert_series:
            if not self._warned_alert_series:
                self._warned_alert_series = True
                logger.warning(
                    "ddphooks: PrometheusSink counts alerts of more than %d (kind, rank, host, device) label sets under "
                    "rank=\"other\" (max_alert_series); every alert is in the records' \"alerts\"", self.max_alert_series,
                )  # fmt: skip
            labels = (labels[0], "other", "", "")
        self._alert_series.add(labels)
        self._metrics["alerts"].labels(*labels).inc()
        if isinstance(group_rank, int):
            self._alerted.pop(group_rank, None)
            self._alerted[group_rank] = None
            while len(self._alerted) > self.max_alerted_ranks:
                self._alerted.popitem(last=False)

    def _tracked_ranks(self, world: int) -> list[int]:
        first = world if self.max_ranks is None else min(world, self.max_ranks)
        return sorted(set(range(first)) | {r for r in self._alerted if 0 <= r < world})

    def _set_per_rank(self, record: dict, world: int) -> None:
        m = self._metrics
        tracked = self._tracked_ranks(world)
        for rank in [r for r in self._rank_labels if r not in tracked]:  # dropped from the alerted ranks
            labels = self._rank_labels.pop(rank)
            for metric in m["rank"].values():
                _remove(metric, labels[0])
            _remove(m["rank_info"], *labels)
        for key, suffix in PER_RANK:
            values = record.get(key)
            summary = record.get(f"{key}_over_ranks")
            outliers = dict((int(r), v) for r, v in (summary or {}).get("outliers") or ())
            for rank in tracked:
                if isinstance(values, list):
                    value = values[rank] if rank < len(values) else None
                else:
                    value = outliers.get(rank)
                m["rank"][suffix].labels(str(self._who(rank)["global_rank"])).set(_number(value))
            if isinstance(values, list):
                summary = over_ranks(np.array([_number(v) for v in values], dtype=np.float64))
            quantiles = (summary or {}).get("quantiles") or {}
            for name, q in OVER_RANKS_QUANTILES.items():
                m["over_ranks"][suffix].labels(_quantile_label(q)).set(_number(quantiles.get(name)))
        for rank in tracked:
            who = self._who(rank)
            labels = (str(who["global_rank"]), str(rank), who["host"], who["device"])
            old = self._rank_labels.get(rank)
            if old != labels:
                if old is not None:
                    _remove(m["rank_info"], *old)
                    if old[0] != labels[0]:
                        for metric in m["rank"].values():
                            _remove(metric, old[0])
                self._rank_labels[rank] = labels
                m["rank_info"].labels(*labels).set(1)

    # -- end ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the endpoint (the port is free again once this returns); later writes are errors."""
        self._closed = True
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            server.shutdown()  # ends serve_forever (within its 0.5 s poll); scrapes in flight finish on their own threads
            server.server_close()
            thread.join(CLOSE_TIMEOUT_S)


def _log_scrape_error(request, client_address) -> None:
    logger.debug("ddphooks: PrometheusSink: a scrape from %s failed", client_address, exc_info=True)


def _remove(metric, *labels) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
