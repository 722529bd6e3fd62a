"""Start-up glue shared by the ``model_repository/*/1/model.py`` adapters (Python backend): model
parameters, the checkpoint and dtype they name, and per-process torch threads."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from .. import schema
from . import internal_key


def model_parameters(model_config: dict) -> dict[str, str]:
    """``parameters { key: ... value { string_value: ... } }`` of a parsed model config as a dict."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def env_name(parameter: str) -> str:
    """The environment variable that overrides a model parameter: ``TANDEM_`` + its name in capitals."""
    return "TANDEM_" + parameter.upper()


def parameter_overrides(settings: dict[str, object]) -> dict[str, str]:
    """Model parameters given on the command line (name -> value; None: not given) as the environment
    variables the models read (:func:`tandem.serving.backend.env_name`), checked first: raises
    ``ValueError`` naming an unknown parameter or a bad value, also of a ``$TANDEM_<NAME>`` already in the
    environment (the whole config is validated; a
    CUDA ``device`` torch does not see, and ``kernels=triton`` on the CPU without ``TRITON_INTERPRET=1``,
    are refused here too, before anything starts)."""
    given = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items() if v is not None}
    taken = {p for m in schema.MODELS.values() for p in m.parameters}
    for k in given:
        if k not in taken:
            raise ValueError(f"no model takes parameter {k!r} (model parameters: {sorted(taken)})")
    from_env = {k: os.environ[env_name(k)] for k in taken - {"checkpoint"} - set(given) if os.environ.get(env_name(k))}
    for k, v in from_env.items():  # the shell's $TANDEM_* reach the models too: check them now, naming the variable
        try:
            schema.ServingConfig.from_parameters({k: v})
        except ValueError as e:
            raise ValueError(f"${env_name(k)} (from the environment): {e}") from None
    given_env = {**from_env, **given}
    schema.ServingConfig.from_parameters({k: v for k, v in given_env.items() if k != "checkpoint"})
    if given_env.get("device", "auto") not in ("auto", "cpu") or given_env.get("kernels") == "triton":
        from ..model.device import check_kernels, resolve_device  # torch: only when a GPU or the kernels are named

        check_kernels(given_env.get("kernels", "auto"), resolve_device(given_env.get("device", "auto")))
    return {env_name(k): v for k, v in given.items()}


def parse_settings(pairs: list[str]) -> dict[str, str]:
    """``["name=value", ...]`` (``tandem serve --set``) as a dict. Raises ``ValueError`` on a malformed pair."""
    out = {}
    for p in pairs:
        name, sep, value = p.partition("=")
        if not sep or not name:
            raise ValueError(f"--set takes NAME=VALUE (a model parameter, e.g. burst_rounds=1), got {p!r}")
        out[name.strip()] = value.strip()
    return out


def serving_config(model_config: dict) -> schema.ServingConfig:
    """The model's parameters over :data:`tandem.schema.DEFAULTS`, each overridden by the environment
    variable :func:`env_name` (``$TANDEM_MAX_CTX`` for ``max_ctx``; ``tandem serve`` flags set them);
    ``$TANDEM_CHECKPOINT``, ``$TANDEM_DTYPE``, ``$TANDEM_DEVICE`` and ``$TANDEM_KERNELS`` apply to every
    model (``device`` and ``kernels`` are applied at load: :func:`tandem.model.device.placement`). Raises
    ``ValueError`` on a bad parameter."""
    params = model_parameters(model_config)
    env = {name: env_name(name) for name in ("checkpoint", "dtype", "device", "kernels", *params)}
    params.update({k: os.environ[v] for k, v in env.items() if os.environ.get(v)})
    return schema.ServingConfig.from_parameters(params)


def resolve_checkpoint(config: schema.ServingConfig, model_dir: str | Path, require_weights: bool = True) -> Path:
    """The checkpoint folder; a relative path resolves against the model repository (the parent of
    ``model_dir``, the folder Triton passes as ``args["model_repository"]``).

    Raises ``FileNotFoundError`` naming the folder and the missing file (``config.json``,
    ``tokenizer.json``, and ``model.safetensors`` or the sharded ``model.safetensors.index.json`` when
    ``require_weights``).
    """
    p = Path(config.checkpoint)
    if not p.is_absolute():
        p = Path(model_dir).resolve().parent / p
    weights = "model.safetensors.index.json" if (p / "model.safetensors.index.json").exists() else "model.safetensors"
    for f in ["config.json", "tokenizer.json"] + ([weights] if require_weights else []):
        if not (p / f).exists():
            raise FileNotFoundError(
                f"checkpoint folder {p} lacks {f} (set TANDEM_CHECKPOINT or the model's "
                f"'checkpoint' parameter; `make model` trains the default)"
            )
    return p


def drafter_dirs(config: schema.ServingConfig, model_dir: str | Path, checkpoint: Path) -> dict:
    """The DFlash drafter folders by arm (:func:`tandem.model.checkpoint.drafter_dirs`): the
    ``dflash_checkpoint`` / ``dflash2_checkpoint`` parameters (relative to the model repository, like
    ``checkpoint``) where set, else ``<checkpoint>/<arm>``. Raises ``FileNotFoundError``."""
    from ..model.checkpoint import drafter_dirs as dirs

    repo = Path(model_dir).resolve().parent
    given = {
        a: (p if Path(p).is_absolute() else repo / p)
        for a in schema.DFLASH_ARMS
        if (p := getattr(config, f"{a}_checkpoint"))
    }
    return dirs(checkpoint, given)


#: the signal on which a stage process writes every thread's Python stack to the server log
STACK_DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """Make this model process write every thread's Python stack to its stderr (the server log) on
    :data:`STACK_DUMP_SIGNAL` (``faulthandler``): ``running_server`` sends it to the stub processes
    when a server does not become ready in time, so the log shows where a model's start-up waits."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)


def set_torch_threads(n: int = 1) -> None:
    """One intra-op (and, if still possible, inter-op) thread per model process: the models share
    a 2-core machine."""
    import torch  # here: the text models (preprocessing, postprocessing) run without torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass


_ONE_PROCESS = (
    "tandem keeps each sequence's state in one process per model (Triton would route a sequence's calls "
    "to any instance)"
)
#: why ``postprocessing`` runs one instance
IN_ORDER = "two instances could finish a stream's responses out of order"


def set_thread_nice(nice: int) -> str:
    """Set the calling thread's nice value (on Linux a thread's own; threads it starts later inherit it) to
    ``nice`` (-20..19: lower is served first when threads compete for a core). Returns what happened, for
    the log: ``"nice -10"``, or ``"nice 0 (nice -10 refused: ...)"`` when the process may not (below its
    current value it needs CAP_SYS_NICE); never raises for a refusal. ``0`` leaves the thread as it is."""
    tid = threading.get_native_id()
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as e:
            return f"nice {os.getpriority(os.PRIO_PROCESS, tid)} (nice {nice} refused: {e.strerror or e}; it needs CAP_SYS_NICE)"
    return f"nice {os.getpriority(os.PRIO_PROCESS, tid)}"


def require_one_instance(model_config: dict, reason: str = _ONE_PROCESS) -> None:
    """Refuse a model config whose ``instance_group`` asks for more than one instance.

    Sessions live inside one process per model: ``tandem``'s worker batches every session, and each
    stage model keys its state by sequence id. Triton routes a BLS call (and, without a sequence
    batcher, a client request) to any instance, so a second instance would see sequences it never
    opened (``postprocessing`` passes :data:`IN_ORDER` as ``reason``). Raises ``ValueError`` saying
    why and what to do instead.
    """
    count = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1
    if count > 1:
        raise ValueError(
            f"model {model_config.get('name', '?')!r}: instance_group asks for {count} instances, but {reason}; "
            f"keep count: 1 and scale out with replicas of the whole repository (README, 'Deploying safely')"
        )


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

    def set(self, values: dict[str, float]) -> None:
        """Set each named gauge (unknown names raise ``KeyError``)."""
        for n, v in values.items():
            if self.last.get(n) != v:
                self.metrics[n].set(float(v))
                self.last[n] = v


#: the gauge every stage model exports: sequences whose state it holds
STAGE_GAUGES = {"stage_sequences": "sequences whose state a stage model's process holds (trunk caches, drafter states)"}


@dataclasses.dataclass
class CallStats:
    """Per ``model.op``: number of calls and total seconds (the bench's figures: BLS round trips in
    ``tandem``, time inside ``handle`` in a stage model)."""

    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, key: str, dt: float) -> None:
        self.calls[key] = self.calls.get(key, 0) + 1
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"model.op": {"calls": n, "mean_ms": ...}}``."""
        return {k: {"calls": n, "mean_ms": 1e3 * self.seconds[k] / n} for k, n in sorted(self.calls.items())}


def tensors_by_name(tensors, names) -> dict:
    """The arrays of the ``tensors`` (a request's ``inputs()`` or a response's ``output_tensors()``:
    objects with ``name()`` and ``as_numpy()``) whose names are in ``names``, in the order of
    ``names``; absent names are left out. One pass over the tensors: ``pb_utils``'
    ``get_input_tensor_by_name`` rebuilds the request's tensor list and scans it for every name (the
    trunk's schema has ~20 inputs, a ``draft_verify`` sends ~11)."""
    by = {t.name(): t for t in tensors}
    return {n: by[n].as_numpy() for n in names if n in by}


def stage_execute(
    pb_utils,
    spec: schema.ModelSpec,
    stage,
    requests,
    gauges: Gauges | None = None,
    unavailable: str | None = None,
    with_sequence: bool = False,
    on_cancelled=None,
    stats: CallStats | None = None,
) -> list:
    """The ``execute`` of a stage model: one :func:`stage_response` per request, in order. Afterwards
    the ``stage_sequences`` gauge is set to ``len(stage.states)``."""
    responses = [
        stage_response(pb_utils, spec, stage, r, unavailable, with_sequence, on_cancelled, stats) for r in requests
    ]
    if gauges is not None and stage is not None:
        gauges.set({"stage_sequences": len(stage.states)})
    return responses


def stage_response(
    pb_utils,
    spec: schema.ModelSpec,
    stage,
    r,
    unavailable: str | None = None,
    with_sequence: bool = False,
    on_cancelled=None,
    stats: CallStats | None = None,
    only_requested: bool = False,
):
    """One request of a stage model: its tensors -> ``stage.handle`` -> its response. A
    :class:`~tandem.schema.WireError` answers with its text (naming the field), anything else with
    ``internal error: ...``; ``unavailable`` (a reason) answers with it; ``with_sequence`` passes the
    request's correlation id and flags to ``handle`` too; ``on_cancelled(arrays)`` is called first for
    a request its client cancelled, which is then answered as usual (an ensemble step answered with an
    error when its ensemble request was cancelled leaves that ensemble request in flight in Triton
    2.51 for good: the server's exit then times out, measured). ``stats`` gets the seconds inside
    ``handle`` as ``<model>.<OP>`` (the bench subtracts them from ``tandem``'s BLS round trips).
    A model whose inputs include ``AUTH`` (the stage models) refuses a request without this server's key
    (:func:`tandem.serving.internal_key.check`) before anything else.
    ``only_requested`` (a decoupled model's response, sent by ``ResponseSender.send``): leave out the
    outputs the caller did not request, since ``send`` would drop them itself, freeing their arrays
    without the GIL in Triton 2.51's Python backend (python_backend #390, fixed after 2.51)."""
    try:
        if unavailable is not None:
            raise schema.WireError(unavailable)
        arrays = tensors_by_name(r.inputs(), spec.input_names)
        if internal_key.AUTH in spec.input_names:  # an internal model: tandem's own calls only, checked first
            internal_key.check(arrays, spec.name, internal_key.server_key())
            del arrays[internal_key.AUTH]
        if on_cancelled is not None and r.is_cancelled():
            on_cancelled(arrays)
        t0 = time.perf_counter()
        out = stage.handle(arrays, r.correlation_id(), r.flags()) if with_sequence else stage.handle(arrays)
        if stats is not None:
            stats.add(f"{spec.name}.{schema.get_op(arrays, spec)}", time.perf_counter() - t0)
        if only_requested:
            out = requested_only(out, r.requested_output_names())
        return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()])
    except Exception as e:  # noqa: BLE001 - a wire error names its field; anything else is reported
        msg = (
            str(e)
            if isinstance(e, (schema.WireError, internal_key.Unauthorized))
            else f"internal error: {type(e).__name__}: {e}"
        )
        return pb_utils.InferenceResponse([], error=pb_utils.TritonError(msg))


def requested_only(arrays: dict, requested) -> dict:
    """``arrays`` restricted to the ``requested`` output names (none requested: all, as Triton reads it)."""
    names = set(requested)
    return {k: v for k, v in arrays.items() if k in names} if names else arrays


def reload_model(pb_utils, name: str) -> None:
    """Restart a stage model whose process died: unload it and load it again (the server runs with
    ``--model-control-mode=explicit``). Returns once it is loaded; raises what ``load_model`` raises."""
    try:
        pb_utils.unload_model(model_name=name)
    except Exception:  # noqa: BLE001 - a model already gone is fine; load_model reports what matters
        pass
    pb_utils.load_model(model_name=name)


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
        """Stop publishing (waits up to ``timeout_s`` seconds for a flush under way)."""
        self._stop.set()
        self._thread.join(timeout_s)


class SendQueue:
    """A decoupled model's responses sent by one thread of their own, in the order they were queued.

    In the Python backend ``ResponseSender.send`` and ``ResponseSender.is_cancelled`` are each a
    round trip to the server process (~0.6 ms apiece here: on the engine core's thread they would hold up
    the next burst). Here the worker only queues: :meth:`stream` gives a request's ``send``
    (queues ``(arrays, error, final)``) and ``is_cancelled(sync=False)`` (a flag this thread refreshes
    after each non-final send of that stream, so a client's cancel is seen one burst later; before the
    stream's first response ``sync`` True asks the server on the caller's thread, and False has this
    thread ask, for a later call to see). ``make(arrays,
    error)`` builds the response; ``final_flag`` is the backend's final-response flag. A send that
    raises marks its stream cancelled (the worker then ends the turn) and is logged with ``log``.
    """

    def __init__(self, make: Callable, final_flag: int, log: Callable[[str], None]) -> None:
        self.make, self.final_flag, self.log = make, final_flag, log
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tandem-sender", daemon=True)
        self._thread.start()

    def stream(self, sender, requested=()) -> tuple[Callable, Callable[[], bool]]:
        """``(send(arrays, error, final), is_cancelled(sync=False))`` of one request's response ``sender``;
        ``requested``: the request's requested output names (each response carries only those, see
        :func:`stage_response`; none: all)."""
        state = {"cancelled": False, "sent": False, "probing": False}

        def send(arrays, error, final) -> None:
            self._q.put((sender, requested_only(arrays, requested) if arrays else arrays, error, final, state))

        def is_cancelled(sync: bool = False) -> bool:
            if state["cancelled"] or state["sent"]:  # (refreshed after each non-final send)
                return state["cancelled"]
            if sync:
                state["cancelled"] = bool(sender.is_cancelled())
            elif not state["probing"]:
                state["probing"] = True
                self._q.put((sender, state))
            return state["cancelled"]

        return send, is_cancelled

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait until everything queued so far has been sent (at most ``timeout_s`` seconds); returns
        whether it was. (A stage restart calls it first: ``pb_utils.load_model`` holds the GIL until
        the model is loaded, seconds in which no thread of this process runs, this one included.)"""
        done = threading.Event()
        self._q.put(done)
        return done.wait(timeout_s)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if isinstance(item, threading.Event):  # a flush mark
                item.set()
                continue
            if len(item) == 2:  # a look at a stream that has sent nothing yet (see stream)
                sender, state = item
                try:
                    state["cancelled"] = state["cancelled"] or bool(sender.is_cancelled())
                except Exception as e:  # noqa: BLE001
                    self.log(f"could not ask whether a request was cancelled: {type(e).__name__}: {e}")
                state["probing"] = False
                continue
            sender, arrays, error, final, state = item
            try:
                sender.send(self.make(arrays, error), flags=self.final_flag if final else 0)
                if not final and not state["cancelled"]:  # (a cancel, or a failed send, stays)
                    state["cancelled"] = bool(sender.is_cancelled())
                    state["sent"] = True
            except Exception as e:  # noqa: BLE001 - a broken client must not stop the others' responses
                state["cancelled"] = True
                self.log(f"could not send a response: {type(e).__name__}: {e}")

    def close(self, timeout_s: float = 2.0) -> bool:
        """Send what is queued, then stop the thread (waits up to ``timeout_s`` seconds: a model's
        ``finalize`` must end inside the server's exit timeout); returns whether everything was sent."""
        self._q.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.log(f"responses still unsent after {timeout_s:g} s at shutdown")
            return False
        return True
