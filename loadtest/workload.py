"""ShareGPT-shaped sessions for the load test.

Each ShareGPT conversation is read as a list of *exchanges* (a human message followed by the
assistant's reply). A session replays one conversation on one Triton sequence:

- turn 1 sends the first human message in the chat template (``<|user|>\\n...<|assistant|>\\n``)
  with START; later turns send the next human message the same way (the server keeps the
  session's context, including what it generated); the last turn sets END;
- each turn's ``max_tokens`` is the token length of the recorded assistant reply, capped at
  ``max_output_tokens`` (the server may stop earlier at EOS);
- a share ``multi_turn_share`` of sessions replays up to ``max_turns`` exchanges of a conversation
  that has at least two; the rest replay only the first exchange;
- a share ``sampled_share`` of sessions is marked *sampled* (every turn of it is a sampled request);
- prompts longer than ``max_prompt_tokens`` are cut, and a session's turns stop before
  prompt + output tokens could exceed ``max_context_tokens``.

The result is plain JSON (:func:`save_workload` / :func:`load_workload`) so the runner builds it
once and every Locust user reads the same file.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem import schema

#: Tokens kept free below the server's context limit (the anchor token and rounding).
CONTEXT_MARGIN = 8


@dataclass
class PlannedTurn:
    """One request of a session: the turn's new token ids and its output cap (tokens)."""

    input_ids: list[int]
    max_tokens: int


@dataclass
class PlannedSession:
    """One Triton sequence: ``turns`` in order; ``sampled`` marks every turn as a sampled request;
    ``conversation`` is the ShareGPT record index it came from."""

    turns: list[PlannedTurn]
    sampled: bool = False
    conversation: int = -1
    prompt_tokens: list[int] = field(default_factory=list)


def exchanges(conversation: list[dict]) -> list[tuple[str, str]]:
    """``(human, assistant)`` text pairs of a ShareGPT conversation, in order. Turns that are not
    a human message directly followed by a ``gpt`` reply (system notes, doubled roles) are skipped."""
    out = []
    for a, b in zip(conversation, conversation[1:]):
        if a.get("from") == "human" and b.get("from") == "gpt":
            out.append((str(a.get("value", "")), str(b.get("value", ""))))
    return out


def user_turn_ids(tokenizer, text: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of ``<|user|>\\n{text}<|assistant|>\\n``; when longer than ``max_prompt_tokens``
    the message body is cut (the template tokens are always kept)."""
    ids = tokenizer.chat_prompt(text)  # the template inserts the control ids; the text stays text
    if len(ids) <= max_prompt_tokens:
        return ids
    tail = tokenizer.message("assistant", "")
    body = tokenizer.encode("\n" + text)[: max(1, max_prompt_tokens - len(tail) - 1)]
    return [tokenizer.user_id] + body + tail


def build_sessions(
    tokenizer,
    n_sessions: int = 256,
    max_output_tokens: int = 128,
    max_prompt_tokens: int = 1024,
    multi_turn_share: float = 0.5,
    max_turns: int = 4,
    sampled_share: float = 0.0,
    max_context_tokens: int = schema.DEFAULTS.max_ctx,
    seed: int = 0,
    scan: int = 4000,
    conversations: list[list[dict]] | None = None,
) -> list[PlannedSession]:
    """Draw ``n_sessions`` sessions (with replacement) from the first ``scan`` ShareGPT
    conversations, seeded by ``seed``. Lengths are in tokens of ``tokenizer`` (a
    :class:`tandem.model.tokenizer.ChatTokenizer`). ``conversations`` replaces the dataset (tests).

    Raises ``ValueError`` on out-of-range arguments or when no usable conversation is found.
    """
    for name, v in (("multi_turn_share", multi_turn_share), ("sampled_share", sampled_share)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    if max_output_tokens < 1 or max_prompt_tokens < 8 or max_turns < 1 or n_sessions < 1:
        raise ValueError("max_output_tokens >= 1, max_prompt_tokens >= 8, max_turns >= 1 and n_sessions >= 1 required")
    if max_prompt_tokens + max_output_tokens + CONTEXT_MARGIN > max_context_tokens:
        max_prompt_tokens = max(8, max_context_tokens - max_output_tokens - CONTEXT_MARGIN)
    if conversations is None:
        from tandem.tools.data import sharegpt_conversations

        conversations = list(sharegpt_conversations(limit=scan))
    pool = [(i, ex) for i, c in enumerate(conversations) if (ex := exchanges(c)) and ex[0][0].strip()]
    if not pool:
        raise ValueError("no ShareGPT conversation with a human message followed by a reply")
    multi = [(i, ex) for i, ex in pool if len(ex) >= 2]
    rng = random.Random(seed)
    reply_len: dict[tuple[int, int], int] = {}
    sessions = []
    for _ in range(n_sessions):
        want_multi = bool(multi) and max_turns >= 2 and rng.random() < multi_turn_share
        ci, ex = rng.choice(multi if want_multi else pool)
        ex = ex[:max_turns] if want_multi else ex[:1]
        turns, prompt_lens, used = [], [], 0
        for k, (human, reply) in enumerate(ex):
            ids = user_turn_ids(tokenizer, human, max_prompt_tokens)
            if (ci, k) not in reply_len:
                reply_len[(ci, k)] = len(tokenizer.encode(reply))
            mt = max(1, min(max_output_tokens, reply_len[(ci, k)]))
            if used + len(ids) + mt + CONTEXT_MARGIN > max_context_tokens:
                break
            used += len(ids) + mt
            turns.append(PlannedTurn(ids, mt))
            prompt_lens.append(len(ids))
        sessions.append(
            PlannedSession(turns, sampled=rng.random() < sampled_share, conversation=ci, prompt_tokens=prompt_lens)
        )
    return sessions


def describe(sessions: list[PlannedSession]) -> dict:
    """Shape of a workload: session count, multi-turn share, turns, sampled share, and mean /
    p50 / p90 of prompt and output-cap lengths (tokens)."""
    turns = [t for s in sessions for t in s.turns]

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0

    p = [len(t.input_ids) for t in turns]
    o = [t.max_tokens for t in turns]
    return {
        "sessions": len(sessions),
        "multi_turn_share": sum(len(s.turns) > 1 for s in sessions) / max(1, len(sessions)),
        "turns": len(turns),
        "sampled_share": sum(s.sampled for s in sessions) / max(1, len(sessions)),
        "prompt_tokens": {"mean": sum(p) / max(1, len(p)), "p50": pct(p, 0.5), "p90": pct(p, 0.9)},
        "max_tokens": {"mean": sum(o) / max(1, len(o)), "p50": pct(o, 0.5), "p90": pct(o, 0.9)},
    }


def save_workload(path: str | Path, sessions: list[PlannedSession], meta: dict | None = None) -> Path:
    """Write sessions (and ``meta``, e.g. the flags that built them) as JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta or {}, "sessions": [asdict(s) for s in sessions]}))
    return path


def load_workload(path: str | Path) -> list[PlannedSession]:
    """Sessions written by :func:`save_workload`."""
    obj = json.loads(Path(path).read_text())
    return [
        PlannedSession(
            [PlannedTurn(**t) for t in s["turns"]],
            s.get("sampled", False),
            s.get("conversation", -1),
            s.get("prompt_tokens", []),
        )
        for s in obj["sessions"]
    ]
