"""Shared fixtures: the shipped checkpoint and engine, fp32/bf16 trunks, tokenizer and real prompts."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

# Triton kernels run on CPU tensors in Triton's interpreter (read when a kernel module is imported,
# so set before any test imports one); a CUDA machine still runs the CUDA kernel tests natively
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.model.checkpoint import DEFAULT_CHECKPOINT, load_trunk
from tandem.model.tokenizer import ChatTokenizer

# one thread a pytest-xdist worker (`make test` runs two on two cores beside the servers), else two
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")))

#: the fixtures that are a running tritonserver
SERVER_FIXTURES = {"server", "drafter_server", "srv", "srv_off", "cluster"}
#: the test files with tests that serve (marked ``integration`` or taking a server fixture): under pytest-xdist
#: (``make test``) these files run one after another on one worker
#: (:func:`pytest_xdist_make_scheduler`)
SERVED_FILES = {
    "test_bad_requests.py",
    "test_bench_quick.py",
    "test_chat_template.py",
    "test_cluster.py",
    "test_colocated.py",
    "test_faults_served.py",
    "test_http_front.py",
    "test_lifecycle.py",
    "test_loadtest.py",
    "test_openai_front.py",
    "test_prefix_privacy.py",
    "test_readme_examples.py",
    "test_security.py",
    "test_serving.py",
    "test_tensor_parallel.py",
    "test_text_front.py",
}


def _serves(item) -> bool:
    return item.get_closest_marker("integration") is not None or bool(
        SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


def pytest_collection_modifyitems(items):
    """Refuse a test that serves outside :data:`SERVED_FILES`: it would run beside the others under xdist."""
    missing = sorted({i.path.name for i in items if _serves(i) and i.path.name not in SERVED_FILES})
    if missing:
        raise pytest.UsageError(f"tests that serve in files not in SERVED_FILES (tests/conftest.py): {missing}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for ``make test`` (``-n 2``): the tests of :data:`SERVED_FILES` are one unit of work,
    run in order on one worker (one shared server a configuration, as without xdist, and their timing checks
    beside one busy core, not two); every other file is a unit of its own (its tests in order: some read what
    an earlier test of their module-scoped engine left), spread over both workers."""
    from xdist.scheduler import LoadScopeScheduling

    class ServedInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "served" if path.rsplit("/", 1)[-1] in SERVED_FILES else path

    return ServedInOrder(config, log)


CHECKPOINT = Path(os.environ.get("TANDEM_TEST_CHECKPOINT", DEFAULT_CHECKPOINT))

#: candidates for :func:`long_turn_prompt`, tried in order
LONG_TURN_TEXTS = (
    "Tell me a long story.",
    "Write a very long essay about the history of the sea.",
    "Explain, step by step and in great detail, how a compiler works.",
)


@functools.lru_cache(maxsize=1)
def _serving_numerics_engine():
    """One in-process engine on the checkpoint for :func:`long_turn_prompt` (loaded once a run)."""
    from tandem.engine.inprocess import Engine

    return Engine(CHECKPOINT, prefix_cache_mb=0)  # dtype=auto: serving's kernel settings


@functools.lru_cache(maxsize=None)
def long_turn_prompt(tokens: int) -> tuple[int, ...]:
    """A chat prompt (token ids) whose greedy plain continuation on the checkpoint, in serving's
    numerics (``dtype=auto``), runs ``tokens`` tokens without a stop token, checked in-process: for the
    served tests that need a turn still streaming seconds later (served greedy output equals
    in-process; a fixed prompt stopped after 40 tokens once the GEMM numerics changed). Raises
    ``AssertionError`` when no candidate of :data:`LONG_TURN_TEXTS` does."""
    eng = _serving_numerics_engine()
    for text in LONG_TURN_TEXTS:
        ids = eng.tokenizer.chat_prompt(text)
        if eng.generate(ids, tokens, spec="off")["finish_reason"] == "length":
            return tuple(ids)
    raise AssertionError(f"no prompt of {LONG_TURN_TEXTS} runs {tokens} greedy tokens without a stop")


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    if not (CHECKPOINT / "model.safetensors").exists():
        pytest.fail(f"checkpoint missing: {CHECKPOINT} (run `make model`)")
    return CHECKPOINT


@pytest.fixture(scope="session")
def tokenizer(checkpoint) -> ChatTokenizer:
    return ChatTokenizer(checkpoint / "tokenizer.json")


@pytest.fixture(scope="session")
def trunk_fp32(checkpoint):
    return load_trunk(checkpoint, torch.float32)


@pytest.fixture(scope="module")
def shipped(checkpoint):
    """The shipped checkpoint, the serving defaults (the demotion policy on)."""
    from tandem.engine.inprocess import Engine

    return Engine(checkpoint)


@pytest.fixture(scope="session")
def sharegpt_prompts():
    from tandem.tools.data import sharegpt_prompts as sp

    return sp(20, seed=1234, max_chars=600)


def make_tiny_trunk(max_position_embeddings: int = 64):
    """A tiny random fp32 glm5_next trunk (vocab 512, hidden 64, 4 layers) for fast stage tests."""
    from tandem.model.checkpoint import cast_trunk, init_weights
    from tandem.model.config import TrunkConfig
    from tandem.model.trunk import Trunk

    cfg = TrunkConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=16,
        linear_head_dim=32,
        linear_num_heads=2,
        max_position_embeddings=max_position_embeddings,
    )
    return cast_trunk(init_weights(Trunk(cfg).eval().requires_grad_(False), seed=1), torch.float32)


def settled(read, interval_s: float = 1.2):
    """``read()`` once two calls ``interval_s`` apart agree: a server publishes its metrics about once a
    second, so a gauge or counter read just after a turn may not show it yet."""
    before = read()
    while True:
        time.sleep(interval_s)
        now = read()
        if now == before:
            return now
        before = now


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real tritonserver serving model_repository/ with the default configuration on free 127.0.0.1 ports,
    shared by every test that uses it: each leaves it as it found it (its sequences ended, gauges compared
    with their value before it, sequence ids of its own). Its log stays in pytest's temporary folder (it
    spans many tests). A clean stop leaves no HAProxy running (the bounded HTTP front stops with its server) and no
    model process crashes on its way out."""
    from tandem.launch.serve import running_server

    if not (CHECKPOINT / "model.safetensors").exists():
        pytest.skip(f"{CHECKPOINT} has no model.safetensors: train it (`make model`) or set TANDEM_TEST_CHECKPOINT")
    log = tmp_path_factory.mktemp("server") / "tritonserver.log"
    env = {"TANDEM_CHECKPOINT": str(CHECKPOINT.resolve())}
    with running_server(env=env, ready_timeout_s=240, log_path=log) as srv:
        yield srv
    assert srv.front.proc.poll() is not None and not srv.front.workdir.exists()
    assert "Segfault" not in log.read_text(), "a model process crashed while the server stopped (see its log)"


#: the served limits of the fault tests: an idle session closes after 3 s, a full server refuses after 1 s
LIMITS = {
    "TANDEM_IDLE_TIMEOUT_S": "3",
    "TANDEM_MAX_SESSIONS": "16",
    "TANDEM_ADMISSION_WAIT_S": "1",
    "TANDEM_ADAPTIVE_DRAFT": "false",  # (a session drafts its budget every round: the drafters are called)
}
#: ``drafter_server``'s stage deadline: above the 1-2 s the Python backend takes to answer "not healthy" for a
#: dead or stopped drafter process (it waits a second for the stub's heartbeat), so such a drafter is seen
#: dead (its sessions go on plain) rather than late (its turns fail)
STAGE_TIMEOUT_S = 3.0
#: ``drafter_server``: the drafter models loaded and called over BLS under ``STAGE_TIMEOUT_S``; the draft length
#: fixed (LIMITS), so an MTP session drafts (calls ``drafter_mtp``) every round of its turn
DRAFTER_ENV = {
    **LIMITS,
    "TANDEM_COLOCATE": "false",
    "TANDEM_STAGE_TIMEOUT_S": f"{STAGE_TIMEOUT_S:g}",
}


@pytest.fixture(scope="session")
def drafter_server():
    """A real tritonserver with ``colocate`` off (:data:`DRAFTER_ENV`): the drafters in the drafter_mtp /
    drafter_dflash models, called over BLS (one for the whole run: the tests of that configuration share it,
    the drafter fault tests too, which leave every drafter model running again). ``drafter_models`` names
    them. Its exit timeout is 3 s: after a drafter model restart Triton's stop waits the whole timeout out
    (docs/known-issues.md), and no test checks that stop."""
    from tandem.launch.serve import DRAFTER_MODELS, models_to_load, running_server

    if not (CHECKPOINT / "model.safetensors").exists():
        pytest.skip(f"{CHECKPOINT} has no model.safetensors: train it (`make model`) or set TANDEM_TEST_CHECKPOINT")
    env = {"TANDEM_CHECKPOINT": str(CHECKPOINT.resolve()), **DRAFTER_ENV}
    with running_server(env=env, ready_timeout_s=240, exit_timeout_s=3) as srv:
        srv.drafter_models = tuple(m for m in models_to_load(env) if m in DRAFTER_MODELS)
        yield srv
