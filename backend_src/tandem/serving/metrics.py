"""Prometheus metrics of a Triton model's process (Python-backend custom metrics on the metrics port):
per-model gauges, and the ``tandem`` model's counters and histograms drained from its
:class:`~tandem.serving.telemetry.Telemetry`."""

from __future__ import annotations


class Gauges:
    """Prometheus gauges of one model process (Python-backend custom metrics on the metrics port),
    labelled ``model=<name>``; :meth:`set` sends only the values that changed (each set is an IPC to
    the server). ``pb_utils``: the ``triton_python_backend_utils`` module; ``names``: metric name
    (``tandem_`` + it) -> description."""

    def __init__(self, pb_utils, model: str, names: dict[str, str]) -> None:
        gauge = pb_utils.MetricFamily.GAUGE
        self.families = [pb_utils.MetricFamily(name=f"tandem_{n}", description=d, kind=gauge) for n, d in names.items()]
        self.metrics = {n: f.Metric(labels={"model": model}) for n, f in zip(names, self.families)}
        self.last: dict[str, float] = {}

    def release(self) -> None:
        """Drop the metrics, then their families (at the model's finalize; see :meth:`MetricsPublisher.stop`)."""
        self.metrics.clear()
        self.families.clear()

    def set(self, values: dict[str, float]) -> None:
        """Set each named gauge (unknown names raise ``KeyError``)."""
        for n, v in values.items():
            if self.last.get(n) != v:
                self.metrics[n].set(float(v))
                self.last[n] = v


#: the gauge every stage model exports: sequences whose state it holds
STAGE_GAUGES = {"stage_sequences": "sequences whose state a stage model's process holds (trunk caches, drafter states)"}


class MetricsPublisher:
    """Drains a :class:`~tandem.serving.telemetry.Telemetry` into Prometheus counters and histograms
    (Python-backend custom metrics, labelled ``model=tandem``) every ``interval_s`` seconds, on a
    thread of its own so that no metric call (an IPC each) runs on the worker's hot path."""

    def __init__(self, pb_utils, telemetry, interval_s: float = 1.0) -> None:
        import threading

        from .telemetry import COUNTERS, HISTOGRAMS, initial_series

        fam = pb_utils.MetricFamily
        self.telemetry, self.interval_s = telemetry, interval_s
        self.counters = {n: fam(name=f"tandem_{n}", description=d, kind=fam.COUNTER) for n, d in COUNTERS.items()}
        # a family must outlive its metrics: both are kept
        self.histogram_families = {
            n: fam(name=f"tandem_{n}", description=d, kind=fam.HISTOGRAM) for n, (d, _) in HISTOGRAMS.items()
        }
        self.histograms = {
            n: self.histogram_families[n].Metric(labels={"model": "tandem"}, buckets=list(b))
            for n, (_, b) in HISTOGRAMS.items()
        }
        self.log = pb_utils.Logger.log_error
        self._metrics: dict = {}
        for key in initial_series():  # every series in the scrape from the start, at 0
            self._metric(key)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-metrics", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Send everything accumulated so far."""
        counts, samples = self.telemetry.drain()
        for key, v in counts.items():
            self._metric(key).increment(v)
        for name, values in samples.items():
            for v in values:
                self.histograms[name].observe(v)

    def _metric(self, key: tuple[str, tuple]):
        """The counter metric of ``(name, labels)``, made on first use."""
        if key not in self._metrics:
            name, labels = key
            self._metrics[key] = self.counters[name].Metric(labels={"model": "tandem", **dict(labels)})
        return self._metrics[key]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - a lost flush must not end the metrics
                self.log(f"metrics: {type(e).__name__}: {e}")

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop publishing (waits up to ``timeout_s`` seconds for a flush under way) and release the metrics, then
        their families, now: left to the interpreter's exit, their destructors crash the Python backend's stub
        once the grammar engine's native library is loaded (its exit order changes)."""
        self._stop.set()
        self._thread.join(timeout_s)
        for held in (self._metrics, self.histograms, self.counters, self.histogram_families):
            held.clear()
