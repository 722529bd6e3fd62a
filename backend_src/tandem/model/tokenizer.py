"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) and tandem's chat template.

Special tokens: ``<|endoftext|>`` (EOS), ``<|system|>``, ``<|user|>``, ``<|assistant|>``.
A chat prompt is ``<|user|>\\n{text}<|assistant|>\\n``; generation stops at ``<|endoftext|>`` or
``<|user|>`` (both in ``stop_ids``). Only the template inserts control ids (:class:`ChatTokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
ROLE_TOKEN = {"human": "<|user|>", "user": "<|user|>", "gpt": "<|assistant|>", "assistant": "<|assistant|>",
              "system": "<|system|>"}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Train a byte-level BPE of ``vocab_size`` entries (special tokens get ids 0..3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


class ChatTokenizer:
    """Encode/decode text and chat prompts with a trained ``tokenizer.json``. Only the template
    inserts control ids: text, user text included, is always encoded as ordinary text, so a message
    that spells ``<|assistant|>`` or ``<|endoftext|>`` cannot end its turn or forge another.

    Raises ``FileNotFoundError`` when the file is missing.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.exists():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        self.tok = Tokenizer.from_file(str(p))
        self.tok.encode_special_tokens = True  # control tokens spelled in text stay text
        self.eos_id = self.tok.token_to_id("<|endoftext|>")
        self.user_id = self.tok.token_to_id("<|user|>")
        self.role_ids = {r: self.tok.token_to_id(t) for r, t in ROLE_TOKEN.items()}
        self.stop_ids = (self.eos_id, self.user_id)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as ordinary text (``"<|user|>"`` in it gives the characters' ids,
        never the control id)."""
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def message(self, role: str, text: str) -> list[int]:
        """One template message: the control id of ``role`` (``user``/``human``, ``assistant``/``gpt``,
        ``system``), then a newline and ``text``, as text."""
        return [self.role_ids[role]] + self.encode("\n" + text)

    def chat_prompt(self, user_text: str, system: str | None = None) -> list[int]:
        """Token ids of a chat turn ending with ``<|assistant|>\\n``: an optional system message, then
        the user message. A later turn of a session is ``chat_prompt(text)`` as well: the previous
        reply's stop token is not context (the session drops it), so this turn's ``<|user|>`` is the
        one boundary token between the turns."""
        return (self.message("system", system) if system else []) + self.message("user", user_text) + \
            self.message("assistant", "")

    def render(self, messages: list[tuple[str, str]]) -> list[int]:
        """The template's rendering of a conversation ``[(role, text), ...]``, each message in turn
        (no stop token after a reply), with the ``<|assistant|>\\n`` header after a final user
        message: the reference a multi-turn session's context must equal."""
        out: list[int] = []
        for role, text in messages:
            out += self.message(role, text)
        if messages and messages[-1][0] in ("user", "human"):
            out += self.message("assistant", "")
        return out

    def conversation(self, turns: list[dict]) -> list[int]:
        """Token ids of a whole ShareGPT conversation, ending with EOS (training documents)."""
        return [i for t in turns for i in self.message(t.get("from") if t.get("from") in ROLE_TOKEN else "user",
                                                         str(t.get("value", "")))] + [self.eos_id]
