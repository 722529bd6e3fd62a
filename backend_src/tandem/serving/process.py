"""Set-up of a Triton model's process: stack dumps on a signal, torch threads, thread priority, the
one-instance rule, and restarting a stage model."""

from __future__ import annotations

import faulthandler
import os
import threading

from ..schema import STACK_DUMP_SIGNAL


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


def reload_model(pb_utils, name: str) -> None:
    """Restart a stage model whose process died: unload it and load it again (the server runs with
    ``--model-control-mode=explicit``). Returns once it is loaded; raises what ``load_model`` raises."""
    try:
        pb_utils.unload_model(model_name=name)
    except Exception:  # noqa: BLE001 - a model already gone is fine; load_model reports what matters
        pass
    pb_utils.load_model(model_name=name)
