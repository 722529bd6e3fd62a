"""The prefix cache's index: a keyed hash chain over prompt blocks of :data:`tandem.schema.PREFIX_BLOCK`
tokens, LRU-bounded in bytes, with hit / miss / collision / eviction counters.

The index lives with the scheduler (the ``tandem`` process) and is the one authority on what is
published; the state itself lives where it is computed: trunk blocks (MLA rows, KDA state at the
block's end) in the trunk stage, drafter tails (DFlash context K/V rows) in the drafter stage. Both
stores change only on the scheduler's ``publish`` and ``evict`` calls, so they mirror the index.

Block ``i`` of a prompt covers tokens ``[i*C, (i+1)*C)``. Its chain digest is a keyed BLAKE2b
(RFC 7693, ``key=`` a 32-byte secret drawn from :mod:`secrets` when the index is made, so nobody
outside the process can compute a key), 128 bits::

    d_0 = H(0x00 || len(salt) as 2 bytes || salt || tokens of block 0)
    d_i = H(0x01 || d_{i-1} || tokens of block i)

(tokens as int64 little-endian). The salt is the request's cache salt (``CACHE_SALT``; "" is the
shared namespace): only prompts with the same salt share blocks. A block's key on the wire
(``PREFIX_KEYS``, int64) is the first 8 bytes of its digest. A key is only a pointer: every entry
keeps its block's tokens, the entry it follows (and, for a root block, the salt), and a lookup counts
block ``i`` as a hit only when all of them equal the prompt's, so a hit verifies the whole prefix and a
key held by a different prefix (a hash collision) is a miss, never another prompt's state.

A prompt of ``P`` tokens can reuse at most ``floor((P - 1) / C)`` blocks: the last prompt row always
runs, it gives the first token.

Exactness: with the prefix cache on, every prime is computed in pieces that end at multiples of
``C`` (:func:`split_points`), warm or cold, and the DFlash ingest likewise, so a warm start holds
bit-for-bit the state a cold prime of the same tokens computes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import secrets

import numpy as np

from .. import schema

#: bytes of the per-index secret (BLAKE2b takes keys up to 64 bytes)
SECRET_BYTES = 32
#: bytes of a chain digest inside the index (the wire key is its first 8)
DIGEST_BYTES = 16


class KeyedHasher:
    """Keyed BLAKE2b (``digest_size`` :data:`DIGEST_BYTES`) under ``secret`` (None: :data:`SECRET_BYTES`
    fresh random bytes). Raises ``ValueError`` for a secret shorter than 16 bytes (128 bits) or longer
    than BLAKE2b's 64."""

    def __init__(self, secret: bytes | None = None) -> None:
        secret = secrets.token_bytes(SECRET_BYTES) if secret is None else bytes(secret)
        if not 16 <= len(secret) <= 64:
            raise ValueError(f"the prefix-cache secret must have 16 to 64 bytes, got {len(secret)}")
        self._secret = secret

    def digest(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._secret, digest_size=DIGEST_BYTES).digest()


def reusable_blocks(n_prompt: int) -> int:
    """Blocks a prompt of ``n_prompt`` tokens may take from the cache (or publish): ``floor((P-1)/C)``."""
    return max(0, (n_prompt - 1) // schema.PREFIX_BLOCK)


def split_points(start: int, stop: int) -> list[int]:
    """Piece boundaries of rows ``[start, stop)`` cut at multiples of ``PREFIX_BLOCK``:
    ``[start, m1, m2, ..., stop]`` (``split_points(10, 140) == [10, 64, 128, 140]`` for C = 64)."""
    c = schema.PREFIX_BLOCK
    pts = [start] + list(range((start // c + 1) * c, stop, c)) + [stop]
    return pts if stop > start else [start]


def _blocks(tokens: list[int], n_blocks: int) -> list[bytes]:
    c = schema.PREFIX_BLOCK
    if n_blocks * c > len(tokens):
        raise ValueError(f"{n_blocks} blocks of {c} need {n_blocks * c} tokens, got {len(tokens)}")
    return [np.asarray(tokens[i * c : (i + 1) * c], dtype="<i8").tobytes() for i in range(n_blocks)]


@dataclasses.dataclass
class PrefixCapture:
    """A session's prompt-boundary capture: the chain ``keys`` (wire int64) of the prompt's reusable
    blocks (``boundary = len(keys) * PREFIX_BLOCK`` tokens), each block's tokens (``blocks``: int64
    bytes) and the ``salt`` of its namespace, waiting to be published once the drafter covers the
    boundary."""

    keys: list[int]
    blocks: list[bytes] = dataclasses.field(default_factory=list)
    salt: str = ""

    @property
    def boundary(self) -> int:
        return len(self.keys) * schema.PREFIX_BLOCK


@dataclasses.dataclass
class _Entry:
    uid: int  # unique over the index's life: what a child names as its parent
    parent: int  # the uid of the entry of block i-1 (0: a root block)
    tokens: bytes  # the block's tokens (int64 bytes)
    salt: str | None  # a root block's namespace (None below the root)
    trunk_bytes: int
    tails: dict[str, int] = dataclasses.field(default_factory=dict)  # spec -> drafter-tail bytes

    @property
    def nbytes(self) -> int:
        return self.trunk_bytes + sum(self.tails.values())

    def holds(self, tokens: bytes, parent: int, salt: str) -> bool:
        """Whether this entry is the block ``tokens`` following entry ``parent`` (the root of ``salt``)."""
        return self.tokens == tokens and self.parent == parent and (parent != 0 or self.salt == salt)


@dataclasses.dataclass
class Reservation:
    """What one capture publishes (:meth:`PrefixIndex.reserve`): ``trunk`` keys new to the index, ``tails``
    keys lacking the spec's drafter tail, and ``chain``: the capture's keys up to the first one held by a
    different prefix (the keys the stores are asked to publish)."""

    spec: str
    trunk: list[int]
    tails: list[int]
    chain: list[int]


class PrefixIndex:
    """Published blocks by wire key, least recently used first; ``capacity_bytes`` bounds the sum of
    their trunk and drafter-tail bytes. ``hasher`` (an object with ``digest(bytes) -> bytes``; None: a
    :class:`KeyedHasher` with a fresh secret) makes the chain digests. ``stats``: ``hits``, ``misses``
    (lookups of a prompt with at least one reusable block), ``collisions`` (lookups that met a key held by
    a different prefix: counted as misses from that block on), ``evictions`` (blocks), ``rows_skipped``
    (prime rows taken from the cache), ``bytes`` (held now), ``blocks`` (held now)."""

    def __init__(self, capacity_bytes: int, hasher=None) -> None:
        self.capacity = int(capacity_bytes)
        self.hasher = KeyedHasher() if hasher is None else hasher
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._uids = itertools.count(1)
        self.stats = {
            "hits": 0,
            "misses": 0,
            "collisions": 0,
            "evictions": 0,
            "rows_skipped": 0,
            "bytes": 0,
            "blocks": 0,
        }

    def _chain(self, blocks: list[bytes], salt: str) -> list[int]:
        s = salt.encode("utf-8")
        if len(s) >= 1 << 16:
            raise ValueError(f"a cache salt has at most {(1 << 16) - 1} bytes, got {len(s)}")
        keys, prev = [], b"\x00" + len(s).to_bytes(2, "little") + s
        for b in blocks:
            d = self.hasher.digest(prev + b)
            keys.append(int(np.frombuffer(d[:8], dtype="<i8")[0]))
            prev = b"\x01" + d
        return keys

    def keys(self, tokens: list[int], n_blocks: int, salt: str = "") -> list[int]:
        """Wire keys (int64) of the first ``n_blocks`` blocks of ``tokens`` in namespace ``salt`` (see the
        module docstring). Raises ``ValueError`` when ``tokens`` has fewer than ``n_blocks * PREFIX_BLOCK``
        tokens."""
        return self._chain(_blocks(tokens, n_blocks), salt)

    def capture(self, tokens: list[int], salt: str = "") -> PrefixCapture:
        """The capture of a prompt ``tokens``: its :func:`reusable_blocks` with their keys and tokens."""
        blocks = _blocks(tokens, reusable_blocks(len(tokens)))
        return PrefixCapture(self._chain(blocks, salt), blocks, salt)

    def lookup(self, cap: PrefixCapture, spec: str) -> int:
        """How many leading blocks of ``cap`` are published, verified (each entry's tokens, parent entry
        and root salt equal the prompt's), with what ``spec`` needs (the trunk part; plus a drafter tail of
        ``spec`` for the DFlash specs). Counts a hit or a miss (and a collision) and marks the blocks used
        (the chain's root most recently, so leaves are evicted first)."""
        n, parent = 0, 0
        for k, blk in zip(cap.keys, cap.blocks):
            e = self.entries.get(k)
            if e is None:
                break
            if not e.holds(blk, parent, cap.salt):
                self.stats["collisions"] += 1
                break
            if spec in schema.DFLASH_SPECS and spec not in e.tails:
                break
            n, parent = n + 1, e.uid
        if cap.keys:
            self.stats["hits" if n else "misses"] += 1
            self.stats["rows_skipped"] += n * schema.PREFIX_BLOCK
        for k in reversed(cap.keys[:n]):
            self.entries.move_to_end(k)
        return n

    def reserve(self, cap: PrefixCapture, spec: str) -> Reservation:
        """Enter the blocks of ``cap`` the index lacks (no bytes yet: :meth:`fill` sets them, :meth:`release`
        takes them back) and say what to publish. The chain stops before the first key held by a different
        prefix: that key's stored state stays, and nothing after it is published (its blocks would hang
        off another prefix's entry)."""
        trunk, tails, chain, parent = [], [], [], 0
        for k, blk in zip(cap.keys, cap.blocks):
            e = self.entries.get(k)
            if e is None:
                e = self.entries[k] = _Entry(next(self._uids), parent, blk, cap.salt if parent == 0 else None, 0)
                trunk.append(k)
            elif not e.holds(blk, parent, cap.salt):
                break
            if spec in schema.DFLASH_SPECS and spec not in e.tails:
                tails.append(k)
            chain.append(k)
            parent = e.uid
        return Reservation(spec, trunk, tails, chain)

    def release(self, r: Reservation) -> None:
        """Take back the entries :meth:`reserve` made for ``r`` (its publication failed)."""
        for k in r.trunk:
            self.entries.pop(k, None)
        self.stats["blocks"] = len(self.entries)

    def fill(self, r: Reservation, trunk_bytes: int, tail_keys: list[int], tail_bytes: int) -> None:
        """Record a publication: ``r.trunk`` newly stored in the trunk (``trunk_bytes`` in all) and
        ``tail_keys`` stored in the drafter for ``r.spec`` (``tail_bytes``); the whole ``r.chain`` is marked
        used, root last."""
        per_t = trunk_bytes // max(1, len(r.trunk))
        per_d = tail_bytes // max(1, len(tail_keys))
        for k in r.trunk:
            if k in self.entries:
                self.entries[k].trunk_bytes = per_t
        for k in tail_keys:
            if k in self.entries:
                self.entries[k].tails[r.spec] = per_d
        for k in reversed(r.chain):
            if k in self.entries:
                self.entries.move_to_end(k)

    def shrink(self) -> list[tuple[int, list[str]]]:
        """Evict least recently used blocks until the total fits ``capacity_bytes``. Returns them as
        ``(key, [specs with a tail])``, least recently used first; a key in the list must be dropped from
        the trunk store and from those specs' drafter stores."""
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
    one ``evict`` per stage. ``drafters``: spec -> stage. Each session's chain stops before a key held by
    a different prefix (:meth:`PrefixIndex.reserve`), so a store never overwrites another prefix's
    state. Returns the sessions published. A stage error propagates after the blocks this call may have
    stored are evicted again and the index's reservations released (the captures are drained: a failed
    publication is not retried; ``index.stats["errors"]`` counts them)."""
    ready = [s for s in sessions if s.prefix_capture_ready()]
    if not ready:
        return 0
    claimed_d: set[tuple[str, int]] = set()
    plans = []
    for s in ready:
        r = index.reserve(s.take_prefix_capture(), s.spec)
        md = [k for k in r.tails if (s.spec, k) not in claimed_d]
        claimed_d.update((s.spec, k) for k in md)
        plans.append((s, r, md))
    d_bytes: dict[int, int] = {}
    by_stage: dict[int, tuple] = {}
    for s, r, _ in plans:
        if s.spec in schema.DFLASH_SPECS:
            by_stage.setdefault(id(drafters[s.spec]), (drafters[s.spec], []))[1].append((s.sid, r.chain))
    try:
        t_bytes = trunk.publish([(s.sid, r.chain) for s, r, _ in plans])
        for stage, items in by_stage.values():
            d_bytes.update(zip([sid for sid, _ in items], stage.publish(items)))
    except Exception:
        # undo what the stores may hold that the index does not know (best effort), then report
        new_t = sorted(k for _, r, _ in plans for k in r.trunk)
        for _, r, _ in reversed(plans):
            index.release(r)
        for st in [trunk] + [st for st, _ in by_stage.values()]:
            try:
                st.evict(new_t if st is trunk else sorted({k for _, k in claimed_d}))
            except Exception:  # noqa: BLE001 - the stage is failing already
                pass
        index.stats["errors"] = index.stats.get("errors", 0) + 1
        raise
    for (s, r, md), tb in zip(plans, t_bytes):
        index.fill(r, tb, md, d_bytes.get(s.sid, 0))
    gone = [k for k, _ in index.shrink()]
    if gone:
        trunk.evict(gone)
        for stage in {id(d): d for a, d in drafters.items() if a in schema.DFLASH_SPECS}.values():
            stage.evict(gone)
    return len(plans)
