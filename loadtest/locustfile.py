"""Locust load test of the decoupled ``tandem`` model over tritonclient gRPC streaming.

Run through ``python -m loadtest.run`` (``make loadtest``), which builds the workload, starts a
server when no URL is given, runs this file headless and writes the report. Standalone::

    locust -f loadtest/locustfile.py --headless --host 127.0.0.1:8001 --ramp-max-users 4

Each :class:`TandemUser` replays ShareGPT-shaped sessions (:mod:`loadtest.workload`) back to back
(closed loop, no think time); one Locust task is one turn. Request events, all times in ms:

- ``TTFT``: request sent to the first token (``response_length`` = prompt tokens);
- ``ITL``: one event per generated token after the first: the gap between its burst and the
  previous one divided by the burst's token count (so percentiles are per token, and this row's
  requests/s is the output token throughput beyond first tokens);
- ``E2E``: request sent to the final response (``response_length`` = generated tokens); a failed
  turn is one failure event here, carrying the server's error text;
- ``tokens/s`` (type ``rate``): generated tokens / end-to-end seconds of the turn — the value
  column is tokens/s, not ms.

With ``--tandem-raw PATH`` every turn (with per-burst timestamps, ROUNDS and ACCEPTED) and every
ramp stage is also appended to a JSONL file, which :mod:`loadtest.report` turns into the summary
and plots.
"""

from __future__ import annotations

# gRPC must use gevent's event loop before any channel exists (locust has already monkey-patched).
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from locust import LoadTestShape, User, constant, events, task  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtest.common import EXIT_GRACE_S, exit_after, ramp_levels, sampling_input, parse_specs, split_host  # noqa: E402
from loadtest.faults import bad_request, judge_bad  # noqa: E402
from loadtest.workload import PlannedSession, build_sessions, load_workload  # noqa: E402
from tandem import schema  # noqa: E402

log = logging.getLogger("tandem.loadtest")

#: Locust request_type of the latency events and of the tokens/s event.
REQUEST_TYPE = "tandem"
RATE_TYPE = "rate"


class TurnFailed(Exception):
    """A turn did not complete: the server's error text, a timeout, or an empty answer."""


class Cancelled(Exception):
    """Raised from a burst callback: the client cancels its turn (``--cancel-share``)."""


class _Shared:
    """State shared by all users of this Locust process (set up by the ``init`` listener)."""

    sessions: list[PlannedSession] = []
    raw = None  # the JSONL file, line-buffered
    sampling: dict | None = None  # TEMPERATURE input's metadata when the model has one
    user_ids = itertools.count()


def _write(rec: dict) -> None:
    if _Shared.raw is not None:
        _Shared.raw.write(json.dumps(rec, separators=(",", ":")) + "\n")


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    g = parser.add_argument_group("tandem")
    g.add_argument("--ramp-max-users", type=int, default=8, help="users at the last ramp step")
    g.add_argument("--ramp-step-users", type=int, default=1, help="users added per ramp step")
    g.add_argument("--ramp-start-users", type=int, default=1, help="users at the first ramp step")
    g.add_argument("--ramp-step-seconds", type=float, default=30.0, help="seconds per ramp step")
    g.add_argument("--tandem-workload", default="", help="workload JSON from loadtest.workload (else built here)")
    g.add_argument("--tandem-raw", default="", help="append per-turn JSONL records here")
    g.add_argument("--tandem-model", default="tandem", help="Triton model name")
    g.add_argument("--checkpoint", default="", help="folder with tokenizer.json (only when building the workload)")
    g.add_argument("--max-output-tokens", type=int, default=128, help="cap on each turn's MAX_TOKENS")
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="cap on each turn's prompt tokens")
    g.add_argument(
        "--max-context-tokens", type=int, default=schema.DEFAULTS.max_ctx, help="a session's prompt + output budget"
    )
    g.add_argument("--multi-turn-share", type=float, default=0.5, help="share of multi-turn sessions")
    g.add_argument("--max-turns", type=int, default=4, help="turns per multi-turn session at most")
    g.add_argument("--sampled-share", type=float, default=0.0, help="share of sampled sessions (needs TEMPERATURE)")
    g.add_argument("--temperature", type=float, default=1.0, help="temperature of sampled requests")
    g.add_argument("--sessions", type=int, default=256, help="sessions in the workload")
    g.add_argument("--seed", type=int, default=0, help="workload and per-user seed")
    g.add_argument(
        "--spec",
        default=schema.DEFAULTS.spec,
        help="speculation method, or a comma list of specs each new session picks from at random: "
        + ", ".join(schema.SPECS),
    )
    g.add_argument("--num-draft-tokens", type=int, default=0, help="drafts per round (0: server default)")
    g.add_argument("--response-timeout", type=float, default=120.0, help="seconds to wait for each response")
    g.add_argument("--turn-timeout", type=float, default=600.0, help="seconds a turn may take in all (gRPC deadline)")
    g.add_argument("--failure-backoff", type=float, default=1.0, help="seconds a user pauses after a failed turn")
    g.add_argument("--allow-remote", action="store_true", default=False, help="allow a non-loopback --host")
    g.add_argument("--cancel-share", type=float, default=0.0, help="share of turns cancelled after their first burst")
    g.add_argument("--bad-share", type=float, default=0.0, help="share of tasks that send a bad request instead")


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    o = environment.parsed_options
    if o is None:  # library use without options: nothing to prepare
        return
    try:
        host = split_host(o.host or "", allow_remote=o.allow_remote)
    except ValueError as e:
        sys.exit(f"tandem loadtest: {e}")
    if o.tandem_workload:
        _Shared.sessions = load_workload(o.tandem_workload)
    else:
        from tandem.model.tokenizer import ChatTokenizer
        from tandem_client.client import default_checkpoint

        tok = ChatTokenizer(Path(o.checkpoint or default_checkpoint()) / "tokenizer.json")
        _Shared.sessions = build_sessions(
            tok,
            o.sessions,
            o.max_output_tokens,
            o.max_prompt_tokens,
            o.multi_turn_share,
            o.max_turns,
            o.sampled_share,
            o.max_context_tokens,
            o.seed,
        )
    if any(s.sampled for s in _Shared.sessions):
        c = grpcclient.InferenceServerClient(host)
        try:
            _Shared.sampling = sampling_input(c.get_model_metadata(o.tandem_model, as_json=True, client_timeout=30))
        finally:
            c.close()
        if _Shared.sampling is None:
            sys.exit(
                f"tandem loadtest: the workload has sampled requests but model {o.tandem_model!r} has no "
                f"TEMPERATURE input (the server decodes greedily only); use --sampled-share 0"
            )
    if o.tandem_raw:
        _Shared.raw = open(o.tandem_raw, "a", buffering=1)


@events.test_stopping.add_listener
def _on_stopping(**_kw) -> None:
    _write({"kind": "end", "t": time.time()})


@events.quitting.add_listener
def _on_quitting(**_kw) -> None:
    if _Shared.raw is not None:
        _Shared.raw.close()
        _Shared.raw = None


@events.quit.add_listener
def _on_quit(exit_code: int = 0, **_kw) -> None:
    # Locust's --csv writer rewrites the files every second and closes them right after this event
    # without a last write; give it one more pass so the CSVs include the turns users finished
    # while stopping (the HTML report and the printed summary already do).
    import gevent

    from locust import stats

    exit_after(EXIT_GRACE_S, exit_code)  # first: a blocked hub would never end the sleep below
    gevent.sleep(stats.CSV_STATS_INTERVAL_SEC + 0.25)


class StepRamp(LoadTestShape):
    """1 -> ``--ramp-max-users`` users in steps of ``--ramp-step-users``, each held
    ``--ramp-step-seconds`` s; then the test stops (headless: Locust quits). Each new step is
    written to the raw file as ``{"kind": "stage", "users": n, "t": epoch_s}``."""

    def __init__(self) -> None:
        super().__init__()
        self._stage = -1

    def tick(self):
        o = self.runner.environment.parsed_options
        levels = ramp_levels(o.ramp_max_users, o.ramp_step_users, o.ramp_start_users)
        i = int(self.get_run_time() // o.ramp_step_seconds)
        if i >= len(levels):
            return None
        if i != self._stage:
            self._stage = i
            _write({"kind": "stage", "users": levels[i], "t": time.time()})
        return levels[i], 100.0


class TandemUser(User):
    """Replays sessions turn by turn on one gRPC client (created in ``on_start``, closed in
    ``on_stop``); one stream per turn, always closed (cancelled when the turn did not complete).
    A session left open when the user stops, or broken by a failed turn, is ended with a one-token
    END request whose outcome is not reported."""

    wait_time = constant(0)
    host = "127.0.0.1:8001"

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.opts = o
        self.uid = next(_Shared.user_ids)
        self.rng = random.Random(o.seed * 1_000_003 + self.uid)
        self.url = split_host(self.host, allow_remote=o.allow_remote)
        self.client = grpcclient.InferenceServerClient(self.url)
        self.session: PlannedSession | None = None
        self.spec = schema.DEFAULTS.spec
        self.turn_index = 0
        self.sid = 0
        self.sequence_open = False

    def on_stop(self) -> None:
        try:
            self._end_sequence()
        finally:
            self.client.close()

    # --- one turn -------------------------------------------------------------------------------
    def _inputs(self, ids: list[int], max_tokens: int, sampled: bool, spec: str) -> list:
        inputs = []

        def add(name, arr, dtype):
            x = grpcclient.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            inputs.append(x)

        if ids:
            add(schema.INPUT_IDS, np.asarray(ids, dtype=np.int32), "INT32")
        add(schema.MAX_TOKENS, np.array([max_tokens], dtype=np.int32), "INT32")
        add(schema.SPEC, np.array([spec.encode()], dtype=np.object_), "BYTES")
        if self.opts.num_draft_tokens > 0:
            add(schema.NUM_DRAFT_TOKENS, np.array([self.opts.num_draft_tokens], dtype=np.int32), "INT32")
        if sampled and _Shared.sampling is not None:
            s = _Shared.sampling
            add(s["name"], np.full(s["shape"], self.opts.temperature, dtype=s["numpy"]), s["datatype"])
        return inputs

    def _stream(self, inputs: list, start: bool, end: bool, timeout_s: float, on_burst=None) -> dict:
        """Send one request on a fresh stream and read it to its final response. Returns
        ``bursts`` (``[t_epoch_s, tokens, rounds, accepted, drafted]`` per non-empty response),
        ``finish_reason``, ``t0`` (epoch s) and ``sent`` (perf_counter s). Raises :class:`TurnFailed`."""
        q: queue.Queue = queue.Queue()
        out = {"bursts": [], "finish_reason": "", "t0": time.time()}
        completed = False
        try:
            # the routing key a proxy sticks the session to (README, "Deploying replicas")
            self.client.start_stream(
                callback=lambda result, error: q.put((result, error)),
                stream_timeout=self.opts.turn_timeout,
                headers={schema.ROUTING_HEADER: str(self.sid)},
            )
            out["sent"] = time.perf_counter()
            self.client.async_stream_infer(
                self.opts.tandem_model,
                inputs,
                sequence_id=self.sid,
                sequence_start=start,
                sequence_end=end,
                enable_empty_final_response=True,
            )
            deadline = out["sent"] + self.opts.turn_timeout
            while True:
                wait = min(timeout_s, deadline - time.perf_counter())
                try:
                    result, error = q.get(timeout=max(0.0, wait))
                except queue.Empty:
                    raise TurnFailed(f"no response within {wait:.3g} s (after {len(out['bursts'])} bursts)") from None
                if error is not None:  # an error response is the request's last: nothing left to cancel (a
                    # cancel right after it, under load, left Triton 2.51 unable to unload tandem at exit)
                    completed = True
                    msg = error.message() if isinstance(error, InferenceServerException) else str(error)
                    raise TurnFailed(f"server error: {msg}")
                resp = result.get_response()
                final = (
                    resp.parameters["triton_final_response"].bool_param
                    if "triton_final_response" in resp.parameters
                    else False
                )
                if resp.outputs:
                    now = time.time()
                    ids = result.as_numpy(schema.OUTPUT_IDS)
                    fr = result.as_numpy(schema.FINISH_REASON)[0]
                    fr = fr.decode() if isinstance(fr, bytes) else str(fr)
                    if fr:
                        out["finish_reason"] = fr
                    if ids is not None and len(ids):
                        b = [
                            now,
                            int(len(ids)),
                            int(result.as_numpy(schema.ROUNDS)[0]),
                            int(result.as_numpy(schema.ACCEPTED)[0]),
                            int(result.as_numpy(schema.DRAFTED)[0]),
                        ]
                        out["bursts"].append(b)
                        if on_burst is not None:
                            on_burst(b, time.perf_counter(), out["sent"])
                if final:
                    completed = True
                    return out
        except InferenceServerException as e:
            raise TurnFailed(f"server error: {e.message() or e}") from None
        finally:
            self.client.stop_stream(cancel_requests=not completed)

    def _fire(
        self, name: str, value: float, length: int = 0, exc: Exception | None = None, rtype: str = REQUEST_TYPE
    ) -> None:
        self.environment.events.request.fire(
            request_type=rtype, name=name, response_time=value, response_length=length, exception=exc, context={}
        )

    def _bad(self) -> None:
        """Send one bad request on a fresh sequence: a success when refused naming its field (``BAD``)."""
        req = bad_request(self.rng)
        inputs = []
        for name, a in req.arrays.items():
            x = grpcclient.InferInput(name, list(a.shape), {np.int32: "INT32", np.object_: "BYTES"}[a.dtype.type])
            x.set_data_from_numpy(a)
            inputs.append(x)
        sid, self.sid = self.sid, self.rng.getrandbits(62) + 1
        t0, err = time.perf_counter(), None
        try:
            self._stream(inputs, req.start, req.end, self.opts.response_timeout)
        except TurnFailed as e:
            err = str(e)
        finally:
            self.sid = sid
        wrong = judge_bad(req, err)
        self._fire("BAD", (time.perf_counter() - t0) * 1000.0, 0, TurnFailed(wrong) if wrong else None)
        _write({"kind": "bad", "t0": time.time(), "name": req.name, "error": err, "wrong": wrong})

    @task
    def turn(self) -> None:
        """One turn of the current session (a new session starts when none is open)."""
        if self.session is None and self.rng.random() < self.opts.bad_share:
            return self._bad()
        if self.session is None:
            self.session = self.rng.choice(_Shared.sessions)
            self.spec = self.rng.choice(parse_specs(self.opts.spec))
            self.turn_index = 0
            self.sid = self.rng.getrandbits(62) + 1
        s, k = self.session, self.turn_index
        planned = s.turns[k]
        start, end = k == 0, k == len(s.turns) - 1
        rec = {
            "kind": "turn",
            "user": self.uid,
            "sid": self.sid,
            "turn": k,
            "turns": len(s.turns),
            "sampled": s.sampled,
            "spec": self.spec,
            "prompt_tokens": len(planned.input_ids),
            "max_tokens": planned.max_tokens,
            "users": self.environment.runner.user_count if self.environment.runner else 0,
        }
        state = {"last": None, "first": None}
        cancel = self.rng.random() < self.opts.cancel_share

        def on_burst(b, t, sent):
            if cancel:  # the client walks away after the first burst: the stream is cancelled
                raise Cancelled()
            # fire TTFT / ITL as bursts arrive, so Locust's live stats stay current. The first
            # response carries the prime's token alone; should it carry more, only TTFT is reported.
            if state["first"] is None:
                state["first"] = t - sent
                self._fire("TTFT", (t - sent) * 1000.0, len(planned.input_ids))
            else:
                per_tok = (t - state["last"]) * 1000.0 / b[1]
                for _ in range(b[1]):
                    self._fire("ITL", per_tok)
            state["last"] = t

        self.sequence_open = True
        t_start = time.perf_counter()
        try:
            res = self._stream(
                self._inputs(planned.input_ids, planned.max_tokens, s.sampled, self.spec),
                start,
                end,
                self.opts.response_timeout,
                on_burst,
            )
            if not res["bursts"]:
                raise TurnFailed(f"final response without tokens (finish_reason {res['finish_reason']!r})")
        except Cancelled:
            el = (time.perf_counter() - t_start) * 1000.0
            self._fire("CANCEL", el, 0)
            rec.update(kind="cancel", t0=time.time() - el / 1000.0, e2e_ms=el)
            _write(rec)
            self.session, self.sequence_open = None, False  # the server closes a cancelled sequence
            return
        except Exception as e:  # noqa: BLE001 - every way a turn can go wrong is reported as its failure
            if not isinstance(e, TurnFailed):
                log.exception(f"user {self.uid}: turn failed on the client side")
                e = TurnFailed(f"client error: {type(e).__name__}: {e}")
            el = (time.perf_counter() - t_start) * 1000.0
            self._fire("E2E", el, 0, e)
            rec.update(t0=time.time() - el / 1000.0, e2e_ms=el, error=str(e), bursts=[])
            _write(rec)
            self.session = None
            self._end_sequence(broken=True)
            time.sleep(self.opts.failure_backoff)  # gevent-patched; no hot loop against a failing server
            return
        e2e = (time.perf_counter() - res["sent"]) * 1000.0
        n = sum(b[1] for b in res["bursts"])
        self._fire("E2E", e2e, n)
        self._fire("tokens/s", n / (e2e / 1000.0), n, rtype=RATE_TYPE)
        rec.update(
            t0=res["t0"],
            e2e_ms=e2e,
            ttft_ms=state["first"] * 1000.0,
            tokens=n,
            finish_reason=res["finish_reason"],
            error=None,
            bursts=res["bursts"],
        )
        _write(rec)
        if end:
            self.sequence_open = False
            self.session = None
        else:
            self.turn_index += 1

    def _end_sequence(self, broken: bool = False) -> None:
        """End an open sequence with END and MAX_TOKENS 1 (best effort; errors only logged: after a
        failed turn the server has already dropped the session and answers so)."""
        if not self.sequence_open:
            return
        self.sequence_open = False
        self.session = None
        try:
            self._stream(self._inputs([], 1, False, self.spec), False, True, min(15.0, self.opts.response_timeout))
            log.info(f"user {self.uid}: ended open sequence {self.sid}")
        except (TurnFailed, InferenceServerException) as e:
            # expected after a failed or cancelled turn: the server has already dropped the sequence
            (log.debug if broken else log.info)(f"user {self.uid}: sequence {self.sid} was already closed ({e})")
