"""The prefix cache's index: a hash chain over prompt blocks of :data:`tandem.schema.PREFIX_BLOCK`
tokens, LRU-bounded in bytes, with hit / miss / eviction counters.

The index lives with the scheduler (the ``tandem`` process) and is the one authority on what is
published; the state itself lives where it is computed: trunk blocks (MLA rows, KDA state at the
block's end) in the trunk stage, drafter tails (DFlash context K/V rows) in the drafter stage. Both
stores change only on the scheduler's ``publish`` and ``evict`` calls, so they mirror the index.

Block ``i`` of a prompt covers tokens ``[i*C, (i+1)*C)``; its key is
``blake2b(key_{i-1} || tokens of block i)`` (64 bits, as a signed int64 for the wire), so a key
names the whole prefix up to the block's end. A prompt of ``P`` tokens can reuse at most
``floor((P - 1) / C)`` blocks: the last prompt row always runs, it gives the first token.

Exactness: with the prefix cache on, every prime is computed in pieces that end at multiples of
``C`` (:func:`split_points`), warm or cold, and the DFlash ingest likewise, so a warm start holds
bit-for-bit the state a cold prime of the same tokens computes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from .. import schema


def block_keys(tokens: list[int], n_blocks: int) -> list[int]:
    """Chain keys (int64) of the first ``n_blocks`` blocks of ``tokens``. Raises ``ValueError`` when
    ``tokens`` has fewer than ``n_blocks * PREFIX_BLOCK`` tokens."""
    c = schema.PREFIX_BLOCK
    if n_blocks * c > len(tokens):
        raise ValueError(f"{n_blocks} blocks of {c} need {n_blocks * c} tokens, got {len(tokens)}")
    keys, prev = [], b""
    for i in range(n_blocks):
        prev = hashlib.blake2b(prev + np.asarray(tokens[i * c:(i + 1) * c], dtype=np.int64).tobytes(),
                               digest_size=8).digest()
        keys.append(int(np.frombuffer(prev, dtype=np.int64)[0]))
    return keys


def reusable_blocks(n_prompt: int) -> int:
    """Blocks a prompt of ``n_prompt`` tokens may take from the cache (or publish): ``floor((P-1)/C)``."""
    return max(0, (n_prompt - 1) // schema.PREFIX_BLOCK)


def split_points(start: int, stop: int) -> list[int]:
    """Piece boundaries of rows ``[start, stop)`` cut at multiples of ``PREFIX_BLOCK``:
    ``[start, m1, m2, ..., stop]`` (``split_points(10, 140) == [10, 64, 128, 140]`` for C = 64)."""
    c = schema.PREFIX_BLOCK
    pts = [start] + list(range((start // c + 1) * c, stop, c)) + [stop]
    return pts if stop > start else [start]


@dataclasses.dataclass
class PrefixCapture:
    """A session's prompt-boundary capture: the chain ``keys`` of the prompt's reusable blocks
    (``boundary = len(keys) * PREFIX_BLOCK`` tokens), waiting to be published once the drafter covers
    the boundary."""

    keys: list[int]

    @property
    def boundary(self) -> int:
        return len(self.keys) * schema.PREFIX_BLOCK


@dataclasses.dataclass
class _Entry:
    trunk_bytes: int
    tails: dict[str, int] = dataclasses.field(default_factory=dict)  # arm -> drafter-tail bytes

    @property
    def nbytes(self) -> int:
        return self.trunk_bytes + sum(self.tails.values())


class PrefixIndex:
    """Published blocks by chain key, least recently used first; ``capacity_bytes`` bounds the sum of
    their trunk and drafter-tail bytes. ``stats``: ``hits``, ``misses`` (lookups of a prompt with at
    least one reusable block), ``evictions`` (blocks), ``rows_skipped`` (prime rows taken from the cache),
    ``bytes`` (held now), ``blocks`` (held now)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = int(capacity_bytes)
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "rows_skipped": 0, "bytes": 0, "blocks": 0}

    def lookup(self, keys: list[int], arm: str) -> int:
        """How many leading blocks of ``keys`` are published with what ``arm`` needs (the trunk part;
        plus a drafter tail of ``arm`` for the DFlash arms). Counts a hit or a miss and marks the
        blocks used (the chain's root most recently, so leaves are evicted first)."""
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is None or (arm in schema.DFLASH_ARMS and arm not in e.tails):
                break
            n += 1
        if keys:
            self.stats["hits" if n else "misses"] += 1
            self.stats["rows_skipped"] += n * schema.PREFIX_BLOCK
        for k in reversed(keys[:n]):
            self.entries.move_to_end(k)
        return n

    def missing(self, keys: list[int], arm: str) -> tuple[list[int], list[int]]:
        """Of ``keys``, those without a trunk block and those without a drafter tail of ``arm``."""
        trunk = [k for k in keys if k not in self.entries]
        tails = [k for k in keys if arm in schema.DFLASH_ARMS and arm not in getattr(self.entries.get(k), "tails", {})]
        return trunk, tails

    def add(self, trunk_keys: list[int], trunk_bytes: int, arm: str, tail_keys: list[int], tail_bytes: int,
            chain: list[int]) -> list[tuple[int, list[str]]]:
        """Record a publication: ``trunk_keys`` newly stored in the trunk (``trunk_bytes`` in all) and
        ``tail_keys`` stored in the drafter for ``arm`` (``tail_bytes``); ``chain`` is the whole chain
        published (marked used, root last). Returns the evicted blocks as ``(key, [arms with a tail])``
        (least recently used first) until the total fits ``capacity_bytes``; a key in the returned
        list must be dropped from the trunk store and from those arms' drafter stores."""
        per_t = trunk_bytes // max(1, len(trunk_keys))
        per_d = tail_bytes // max(1, len(tail_keys))
        for k in trunk_keys:
            self.entries[k] = _Entry(per_t)
        for k in tail_keys:
            if k in self.entries:
                self.entries[k].tails[arm] = per_d
        for k in reversed(chain):
            if k in self.entries:
                self.entries.move_to_end(k)
        gone = []
        total = sum(e.nbytes for e in self.entries.values())
        while self.entries and total > self.capacity:
            k, e = self.entries.popitem(last=False)
            total -= e.nbytes
            gone.append((k, sorted(e.tails)))
        self.stats["evictions"] += len(gone)
        self.stats["bytes"], self.stats["blocks"] = total, len(self.entries)
        return gone


def publish_ready(index: PrefixIndex, sessions, trunk, drafters: dict) -> int:
    """Publish the capture of every session in ``sessions`` that is :meth:`prefix_capture_ready`:
    one trunk ``publish`` call, one per DFlash drafter stage, then (when the index is over its bound)
    one ``evict`` per stage. ``drafters``: arm -> stage. Returns the sessions published. A stage error
    propagates after the blocks this call may have stored are evicted again (the captures are
    drained: a failed publication is not retried; ``index.stats["errors"]`` counts them)."""
    ready = [s for s in sessions if s.prefix_capture_ready()]
    if not ready:
        return 0
    claimed_t: set[int] = set()
    claimed_d: set[tuple[str, int]] = set()
    plans = []
    for s in ready:
        keys = s.take_prefix_capture().keys
        mt, md = index.missing(keys, s.arm)
        mt = [k for k in mt if k not in claimed_t]
        md = [k for k in md if (s.arm, k) not in claimed_d]
        claimed_t.update(mt)
        claimed_d.update((s.arm, k) for k in md)
        plans.append((s, keys, mt, md))
    d_bytes: dict[int, int] = {}
    by_stage: dict[int, tuple] = {}
    for s, keys, _, _ in plans:
        if s.arm in schema.DFLASH_ARMS:
            by_stage.setdefault(id(drafters[s.arm]), (drafters[s.arm], []))[1].append((s.sid, keys))
    try:
        t_bytes = trunk.publish([(s.sid, keys) for s, keys, _, _ in plans])
        for stage, items in by_stage.values():
            d_bytes.update(zip([sid for sid, _ in items], stage.publish(items)))
    except Exception:
        # undo what the stores may hold that the index does not know (best effort), then report
        new_t = sorted(claimed_t)
        for st in [trunk] + [st for st, _ in by_stage.values()]:
            try:
                st.evict(new_t if st is trunk else sorted({k for _, k in claimed_d}))
            except Exception:  # noqa: BLE001 - the stage is failing already
                pass
        index.stats["errors"] = index.stats.get("errors", 0) + 1
        raise
    gone: list[int] = []
    for (s, keys, mt, md), tb in zip(plans, t_bytes):
        gone += [k for k, _ in index.add(mt, tb, s.arm, md, d_bytes.get(s.sid, 0), keys)]
    if gone:
        trunk.evict(gone)
        for stage in {id(d): d for a, d in drafters.items() if a in schema.DFLASH_ARMS}.values():
            stage.evict(gone)
    return len(plans)
