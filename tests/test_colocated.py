"""Where the drafters run (``colocate``): by default in the engine core's process, beside the trunk, and no
drafter model is loaded; with ``colocate`` off in the ``drafter_mtp`` / ``drafter_dflash`` models, called over
BLS by the engine core, with the same tokens. The accept walk runs once per round: nothing is replayed."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from tandem import schema
from tandem.engine.inprocess import Engine

from conftest import settled
from test_prefix import _run

PKG = Path(__file__).resolve().parents[1] / "backend_src" / "tandem"


@pytest.mark.parametrize("spec", [schema.OFF, schema.DFLASH2])
def test_a_burst_ends_after_burst_ms(shipped, tokenizer, sharegpt_prompts, spec):
    """``burst_ms``: a burst ends at the first round boundary after it: with ~0 ms every burst is one round,
    with a long one a burst holds several; the tokens never change."""
    ids = tokenizer.chat_prompt(sharegpt_prompts[3])
    plain = shipped.generate(ids, 40, spec="off")["token_ids"]
    dflash = {a: shipped.drafters[a].drafters[a] for a in schema.DFLASH_SPECS}
    for ms, one_round in ((1e-3, True), (1e4, False)):
        eng = Engine(model=shipped.model, tokenizer=tokenizer, dflash=dflash, burst_ms=ms, burst_rounds=8)
        out, receipts = _run(eng.sched, 1, ids, 40, spec)
        assert out == plain and (max(r.rounds for r in receipts) == 1) == one_round
    with pytest.raises(ValueError, match="burst_ms must be >= 0"):
        schema.ServingConfig(burst_ms=-1.0)


def test_the_accept_walk_has_one_call_site():
    """Every round's accept walk is the engine core's (its one call, in
    :class:`~tandem.engine.spec_round.SpecRound`): no other module of the package calls it, so no process
    replays or re-derives a walk. (The Triton kernels' bench cases, ``tools/kernel_cases.py``, run the walk
    and its kernel side by side on made-up rows: no session's.)"""
    calls = []
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).as_posix() == "tools/kernel_cases.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "accept_walk"
            ):
                calls.append(str(path.relative_to(PKG)))
    assert calls == ["engine/spec_round.py"]


def _counter(srv, name: str) -> float:
    from tandem.launch.observe import scrape

    return scrape(srv.metrics_port).get((f"tandem_{name}", frozenset({("model", "tandem")})), 0.0)


def test_a_served_turn_walks_once_per_round_and_loads_no_drafter_model(server, tokenizer):
    """A served dflash2 turn on the default server: the accept walks the engine core counted
    (``tandem_accept_walks_total``) are at most the turn's rounds (its usage: one walk a verify round, none in
    the compiled plain rounds of a resting session), its drafting rounds ran in compiled calls
    (``tandem_compiled_spec_rounds_total``), and no drafter model is loaded (the drafters run in the ``tandem``
    model's process)."""
    from tandem.launch.serve import model_states
    from tandem_client.client import generate

    states = model_states(server.internal_http_port)
    assert states.get("tandem") == "READY"
    assert all(states.get(m) != "READY" for m in (schema.DRAFTER_MTP.name, schema.DRAFTER_DFLASH.name)), states
    ids = tokenizer.chat_prompt("Write a short poem about the sea.")
    before = _counter(server, "accept_walks_total")
    compiled0 = _counter(server, "compiled_spec_rounds_total")
    got = generate(ids, 48, url=server.grpc_url, spec=schema.DFLASH2)
    deadline, walks = time.monotonic() + 10, -1.0  # (the metrics publisher exports counts within a second or so)
    while time.monotonic() < deadline:  # until the count holds for 1.5 s
        time.sleep(1.5)
        last, walks = walks, _counter(server, "accept_walks_total") - before
        if walks == last:
            break
    assert got["rounds"] > 1 and got["accepted"] <= got["drafted"]
    assert walks <= got["rounds"], (walks, got["rounds"])
    # its drafting rounds ran compiled (the turn alone: one DFlash spec, greedy), counted among the walks
    compiled = _counter(server, "compiled_spec_rounds_total") - compiled0
    assert got["drafted"] > 0 and 0 < compiled <= walks, (got["drafted"], compiled, walks)
    assert "round costs plain_1_ms" in server.log()  # measured at load (the adaptive draft length's costs)


def test_served_with_colocate_off_takes_the_drafter_models(server, drafter_server, shipped, tokenizer):
    """A real tritonserver with ``colocate=false`` (``$TANDEM_COLOCATE``): the drafter models are loaded and
    draft (Triton counts the engine core's BLS calls to each), and every spec's greedy tokens equal the
    default server's and the engine's."""
    from tandem.launch.observe import scrape
    from tandem.launch.serve import model_states
    from tandem_client.client import generate

    def drafter_calls() -> dict[str, float]:
        got = scrape(drafter_server.metrics_port, prefix="nv_inference_request_success")
        return {m: v for (_, labels), v in got.items() if "drafter" in (m := dict(labels)["model"])}

    prompts = [tokenizer.chat_prompt(t) for t in ("Write a short poem about the sea.", "Explain a hash map.")]
    srv = drafter_server
    states = model_states(srv.internal_http_port)
    assert states.get(schema.DRAFTER_MTP.name) == states.get(schema.DRAFTER_DFLASH.name) == "READY", states
    before = drafter_calls()
    for ids in prompts:
        for spec in (schema.DFLASH2, schema.MTP, schema.DFLASH):
            got = generate(ids, 24, url=srv.grpc_url, spec=spec)
            default = generate(ids, 24, url=server.grpc_url, spec=spec)
            assert got["token_ids"] == default["token_ids"] == shipped.generate(ids, 24, spec=spec)["token_ids"]
            assert got["accepted"] > 0, spec
    after = settled(drafter_calls)
    assert all(after[m] > before.get(m, 0) for m in (schema.DRAFTER_MTP.name, schema.DRAFTER_DFLASH.name)), after
