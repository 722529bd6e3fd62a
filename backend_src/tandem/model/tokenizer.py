"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) and a checkpoint's chat template.

A checkpoint folder holds ``tokenizer.json``, and ``tokenizer_config.json`` with its ``chat_template``
(rendered as transformers renders it: :mod:`tandem.model.chat_template`) and ``generation_config.json``
with its stop ids (``eos_token_id``). The shipped miniature's special tokens: ``<|endoftext|>`` (EOS),
``<|system|>``, ``<|user|>``, ``<|assistant|>``; its template renders a chat prompt as
``<|user|>\\n{text}<|assistant|>\\n``, and generation stops at ``<|endoftext|>`` or ``<|user|>``
(:data:`MINIATURE_TEMPLATE`, written by :func:`write_tokenizer_config`; a folder without a template
falls back to it). Only the template inserts control ids (:class:`ChatTokenizer`).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
ROLE_TOKEN = {
    "human": "<|user|>",
    "user": "<|user|>",
    "gpt": "<|assistant|>",
    "assistant": "<|assistant|>",
    "system": "<|system|>",
}
#: roles as templates name them (ShareGPT's ``human`` / ``gpt`` too)
ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
#: the shipped miniature's chat template (its ``tokenizer_config.json``)
MINIATURE_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}"
)


def write_tokenizer_config(folder: str | Path, stop_ids: list[int]) -> None:
    """Write the miniature's ``tokenizer_config.json`` (its chat template, for tandem and
    transformers' ``AutoTokenizer``) and ``generation_config.json`` (``eos_token_id``: ``stop_ids``)."""
    folder = Path(folder)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": MINIATURE_TEMPLATE,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(stop_ids)}, indent=2) + "\n")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Train a byte-level BPE of ``vocab_size`` entries (special tokens get ids 0..3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


class ChatTokenizer:
    """Encode/decode text and chat prompts with a checkpoint's ``tokenizer.json``, its chat
    template and its stop ids (``generation_config.json``'s ``eos_token_id``; without one, the
    miniature's ``<|endoftext|>`` and ``<|user|>``). Only the template inserts control ids: text,
    user text included, is always encoded as ordinary text, so a message that spells
    ``<|assistant|>`` or ``<|endoftext|>`` cannot end its turn or forge another.

    Raises ``FileNotFoundError`` when the file is missing, ``ValueError`` on a bad template config.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.exists():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        from .chat_template import ChatTemplate

        self.tok = Tokenizer.from_file(str(p))
        self.tok.encode_special_tokens = True  # control tokens spelled in text stay text
        added = sorted((t.content for t in self.tok.get_added_tokens_decoder().values()), key=len, reverse=True)
        self._added = re.compile("(" + "|".join(re.escape(a) for a in added) + ")") if added else None
        self.eos_id = self.tok.token_to_id("<|endoftext|>")
        self.user_id = self.tok.token_to_id("<|user|>")
        self.role_ids = {r: self.tok.token_to_id(t) for r, t in ROLE_TOKEN.items()}
        self.template = ChatTemplate.load(p.parent) or ChatTemplate(MINIATURE_TEMPLATE)
        gen = p.parent / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
        if eos is None:
            self.stop_ids = (self.eos_id, self.user_id)
        else:
            self.stop_ids = tuple(int(x) for x in (eos if isinstance(eos, list) else [eos]))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token covers (an upper bound), so that a text of more than
        ``n * max_token_bytes`` bytes is known to exceed ``n`` tokens without encoding it: a byte-level
        vocabulary spells each byte as one character, so a token covers as many bytes as its string has
        characters; otherwise a token's UTF-8 length bounds it (text is encoded without a normalizer
        that could shrink it; with one, the bound is taken 4 times)."""
        spec = json.loads(self.tok.to_str())
        vocab = self.tok.get_vocab(with_added_tokens=False)
        byte_level = (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel" or (spec.get("decoder") or {}).get(
            "type"
        ) == "ByteLevel"
        longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
        return longest * (1 if spec.get("normalizer") is None else 4)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as ordinary text (``"<|user|>"`` in it gives the characters' ids,
        never the control id)."""
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def message(self, role: str, text: str) -> list[int]:
        """One message as the template renders it alone (no generation prompt): for the miniature,
        the control id of ``role`` (``user``/``human``, ``assistant``/``gpt``, ``system``), then a
        newline and ``text``, as text."""
        return self.render([(role, text)], add_generation_prompt=False)

    def chat_prompt(self, user_text: str, system: str | None = None, later: bool = False) -> list[int]:
        """Token ids of a chat turn ending with the template's generation prompt
        (``<|assistant|>\\n``): an optional system message, then the user message. A ``later`` turn
        of a session leaves out the template's preamble (its rendering of no messages, e.g. GLM's
        ``[gMASK]<sop>``; the miniature has none), which the session holds already; the previous
        reply's stop token is not context (the session drops it), so this turn's ``<|user|>`` is the
        one boundary token between the turns."""
        ids = self.render(([("system", system)] if system else []) + [("user", user_text)])
        pre = self.render([], add_generation_prompt=False) if later else []
        return ids[len(pre) :] if pre and ids[: len(pre)] == pre else ids

    def render(self, messages: list[tuple[str, str]], add_generation_prompt: bool | None = None) -> list[int]:
        """Token ids of the template's rendering of a conversation ``[(role, text), ...]`` (no stop
        token after a reply), with the generation prompt after a final user message unless
        ``add_generation_prompt`` says otherwise: the reference a multi-turn session's context must
        equal. Message text is encoded as ordinary text, the template's own text with its control
        tokens; the rendered text is :meth:`ChatTemplate.render`'s, transformers' own."""
        msgs = [{"role": ROLE[r], "content": t} for r, t in messages]
        if add_generation_prompt is None:
            add_generation_prompt = bool(msgs) and msgs[-1]["role"] == "user"
        out: list[int] = []
        text = ""  # the text between two of the template's control tokens (as transformers splits it)
        for piece, content in self.template.pieces(msgs, add_generation_prompt):
            for part in [piece] if content or self._added is None else self._added.split(piece):
                if not content and self._added is not None and self._added.fullmatch(part):
                    out += self.encode(text) + [self.tok.token_to_id(part)]
                    text = ""
                else:
                    text += part
        return out + self.encode(text)

    def conversation(self, turns: list[dict]) -> list[int]:
        """Token ids of a whole ShareGPT conversation, ending with EOS (training documents)."""
        return [
            i
            for t in turns
            for i in self.message(t.get("from") if t.get("from") in ROLE_TOKEN else "user", str(t.get("value", "")))
        ] + [self.eos_id]
