"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) and tandem's chat template.

Special tokens: ``<|endoftext|>`` (EOS), ``<|system|>``, ``<|user|>``, ``<|assistant|>``.
A chat prompt is ``<|user|>\\n{text}<|assistant|>\\n``; generation stops at ``<|endoftext|>`` or
``<|user|>`` (both in ``stop_ids``).
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
    """Encode/decode text and chat prompts with a trained ``tokenizer.json``.

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
        self.eos_id = self.tok.token_to_id("<|endoftext|>")
        self.user_id = self.tok.token_to_id("<|user|>")
        self.stop_ids = (self.eos_id, self.user_id)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def chat_prompt(self, user_text: str, system: str | None = None) -> list[int]:
        """Token ids of a single-turn chat prompt ending with ``<|assistant|>\\n``."""
        s = (f"<|system|>\n{system}" if system else "") + f"<|user|>\n{user_text}<|assistant|>\n"
        return self.encode(s)

    def conversation(self, turns: list[dict]) -> list[int]:
        """Token ids of a whole ShareGPT conversation, ending with EOS (training documents)."""
        parts = []
        for t in turns:
            role = ROLE_TOKEN.get(t.get("from", ""), "<|user|>")
            parts.append(f"{role}\n{t.get('value', '')}")
        return self.encode("".join(parts)) + [self.eos_id]
