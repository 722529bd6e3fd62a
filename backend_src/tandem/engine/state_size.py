"""What one session's state costs in memory, estimated from the checkpoint's shapes, for admission by
bytes (``max_state_mb``, :meth:`~tandem.engine.scheduler.Scheduler.admit`) and the ``state_bytes`` gauge.

A session at a context of ``n`` tokens holds, in the trunk's process:

- per ``indexed_attention`` layer (MLA / DSA) and token: the latent (``kv_lora_rank``), the
  decompressed keys and values (``H * (qk_nope + qk_rope)`` and ``H * v_head_dim``), the indexer key
  and pool gate (``index_head_dim`` each), and per ``index_kpool`` tokens one compressed pool key;
  each buffer starts with :data:`~tandem.model.cache.MIN_ENTRIES` entries (rows; pools);
- per ``linear_attention`` layer (KDA), whatever the context: the recurrent state ``H * dk * dk``
  and the conv tail ``3 * H * dk * (K - 1)``;
- its drafter: the MTP layer's own MLA rows (spec ``mtp``), or the DFlash drafter's context keys and
  values (``layers * 2 * H * head_dim`` a token, specs ``dflash`` / ``dflash2``);
- until its drafter ingests them (its first round), its prompt rows' trunk outputs: the hidden row,
  and on the DFlash specs the target-layer features.

Every buffer is counted at 4 bytes an element (the CPU caches are float32; bf16 on CUDA holds less,
so the estimate errs high there).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .. import schema
from ..model.cache import MIN_ENTRIES

#: bytes an element (float32)
ELEMENT = 4


@dataclasses.dataclass(frozen=True)
class StateSize:
    """Bytes of one session's state as a function of its spec and context (see the module).

    ``mla_row``: bytes a token over every trunk MLA layer; ``mla_pool``: bytes a compressed pool key
    over those layers, one per ``kpool`` tokens; ``kda``: bytes over every KDA layer (fixed);
    ``hidden``: bytes of one trunk output row (``hidden_size``); ``features``: bytes of one row's DFlash
    target-layer features; ``drafter_row``: spec -> bytes a token of that spec's drafter state."""

    mla_row: int
    mla_pool: int
    kpool: int
    kda: int
    hidden: int
    features: int
    drafter_row: dict[str, int]

    @classmethod
    def from_configs(cls, trunk: dict, dflash: dict[str, dict] | None = None) -> "StateSize":
        """From a trunk ``config.json`` dict (transformers field names) and the DFlash drafters' by spec.
        Raises ``KeyError`` naming a missing field."""
        t = trunk
        H = t["num_attention_heads"]
        row = (
            t["kv_lora_rank"]
            + H * (t["qk_nope_head_dim"] + t["qk_rope_head_dim"])
            + H * t["v_head_dim"]
            + 2 * t["index_head_dim"]
        )
        types = t["layer_types"]
        n_mla, n_kda = types.count("indexed_attention"), types.count("linear_attention")
        lh, ld, K = t["linear_num_heads"], t["linear_head_dim"], t["linear_conv_kernel_dim"]
        kda = lh * ld * ld + 3 * lh * ld * (K - 1)
        drafters = {schema.MTP: row * ELEMENT * t.get("num_nextn_predict_layers", 1)}
        feats = 0
        for spec, d in (dflash or {}).items():
            drafters[spec] = d["num_hidden_layers"] * 2 * d["num_attention_heads"] * d["head_dim"] * ELEMENT
            feats = max(feats, len(d["target_layer_ids"]) * d["hidden_size"] * ELEMENT)
        return cls(
            mla_row=n_mla * row * ELEMENT,
            mla_pool=n_mla * t["index_head_dim"] * ELEMENT,
            kpool=t["index_kpool"],
            kda=n_kda * kda * ELEMENT,
            hidden=t["hidden_size"] * ELEMENT,
            features=feats,
            drafter_row=drafters,
        )

    @classmethod
    def from_folders(cls, checkpoint: str | Path, dflash: dict[str, str | Path] | None = None) -> "StateSize":
        """From a checkpoint folder's ``config.json`` and the DFlash drafter folders by spec (each with a
        ``config.json``; missing ones are skipped). Raises ``OSError`` / ``KeyError``."""
        read = lambda p: json.loads(Path(p, "config.json").read_text())  # noqa: E731
        return cls.from_configs(
            read(checkpoint), {a: read(p) for a, p in (dflash or {}).items() if Path(p, "config.json").exists()}
        )

    def session(self, spec: str, tokens: int, unread: int = 0) -> int:
        """Bytes of a session of spec ``spec`` holding ``tokens`` tokens of context, ``unread`` of them
        primed but not yet ingested by its drafter (their trunk output rows are kept until then)."""
        n = self.mla_row * max(MIN_ENTRIES, tokens) + self.mla_pool * max(MIN_ENTRIES, tokens // self.kpool) + self.kda
        if spec != schema.OFF:
            n += self.drafter_row.get(spec, 0) * tokens
            n += unread * (self.hidden + (self.features if spec in schema.DFLASH_SPECS else 0))
        return n
