"""A checkpoint's own chat template: ``chat_template`` in its ``tokenizer_config.json``, rendered as
transformers' ``apply_chat_template`` renders it (a Jinja2 ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does
not escape HTML, ``raise_exception`` and ``strftime_now``; the messages, ``add_generation_prompt``
and the tokenizer's special tokens as variables), and tokenized so that only the template inserts
control tokens: a message that spells one is encoded as ordinary text.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

#: the special-token names transformers passes to a template (``special_tokens_map``)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


class ChatTemplate:
    """A compiled chat template. ``source``: the Jinja2 text; ``special``: the special tokens it
    may read (``{"eos_token": "<|endoftext|>", ...}``). Raises ``jinja2.TemplateSyntaxError``."""

    def __init__(self, source: str, special: dict[str, str] | None = None) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source, self.special = source, dict(special or {})
        self.template = env.from_string(source)

    @classmethod
    def load(cls, folder: str | Path) -> "ChatTemplate | None":
        """The template of a checkpoint folder's ``tokenizer_config.json`` (None without one). Raises
        ``ValueError`` when ``chat_template`` is not one string (named templates are not served)."""
        p = Path(folder) / "tokenizer_config.json"
        if not p.exists():
            return None
        cfg = json.loads(p.read_text())
        src = cfg.get("chat_template")
        if src is None:
            return None
        if not isinstance(src, str):
            raise ValueError(f"{p}: chat_template must be one template string (named templates are not supported)")
        return cls(src, {k: t for k in SPECIAL_NAMES if (t := _token_text(cfg.get(k))) is not None})

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``). Raises
        ``jinja2.TemplateError`` (the template's own ``raise_exception`` too)."""
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None, **self.special
        )

    def pieces(self, messages: list[dict], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """The rendered prompt as ``(text, is_content)`` pieces: the template's own text, and each
        message's content. When the template changes a content (trims it, say), no piece can be
        attributed and the whole prompt is one template piece (tokenized as transformers does)."""
        full = self.render(messages, add_generation_prompt)
        marks = [f"\x00tandem-content-{i}\x00" for i in range(len(messages))]
        marked = self.render([{**m, "content": k} for m, k in zip(messages, marks)], add_generation_prompt)
        out: list[tuple[str, bool]] = []
        for part in re.split("(\x00tandem-content-\\d+\x00)", marked):
            if part in marks:
                out.append((messages[marks.index(part)]["content"], True))
            elif part:
                out.append((part, False))
        if "".join(t for t, _ in out) != full:
            return [(full, False)]
        return out
