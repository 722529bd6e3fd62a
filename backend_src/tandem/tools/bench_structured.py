"""`make bench`'s structured-output section: what a JSON schema costs, in-process, for plain decoding and the best
speculative arm.

Per case (a prompt and a JSON schema from :data:`CASES`) four interleaved runs: plain and the best arm, each
unconstrained and under the schema (:mod:`tandem.engine.structured`). Reported: decode tokens/s after the first
token (medians over the runs; a constrained reply is short, so its prime would weigh more than an unconstrained
one's), the drafts accepted of those drafted,
constrained / unconstrained for both, best / plain under the constraint, tau with and without it, whether the
constrained speculative tokens equal the constrained plain ones (they must: the mask applies on every verify row),
and the grammar engine's mask time per row and compile time per schema.
"""

from __future__ import annotations

import statistics


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _str(n: int = 16) -> dict:
    return {"type": "string", "maxLength": n}


def _int(lo: int = 0, hi: int = 999) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


#: 20 prompts with a JSON schema each (objects, arrays, enums, integers, numbers, booleans, nesting), bounded so
#: the miniature completes each well within 200 tokens (its strings otherwise run on)
CASES = [
    ("Describe a person.", _obj({"name": _str(), "age": _int(0, 120)})),
    ("Pick a colour and a count.", _obj({"colour": {"enum": ["red", "green", "blue"]}, "count": _int()})),
    ("Give some tags.", _obj({"tags": {"type": "array", "items": _str(8), "maxItems": 3}})),
    ("Is it ok?", _obj({"ok": {"type": "boolean"}, "reason": _str(24)})),
    ("Give a point.", _obj({"point": _obj({"x": _int(-99, 99), "y": _int(-99, 99)})})),
    ("Name a film.", _obj({"title": _str(), "year": _int(1900, 2100), "genre": {"enum": ["drama", "comedy"]}})),
    (
        "List an order.",
        _obj({"items": {"type": "array", "items": _obj({"id": _int(), "qty": _int(1, 9)}), "minItems": 1}}),
    ),
    ("Name a city.", _obj({"city": _str(), "population": _int(0, 99999)})),
    ("Answer the question.", _obj({"answer": {"enum": ["yes", "no", "maybe"]}})),
    ("Give scores.", _obj({"scores": {"type": "array", "items": _int(0, 100), "maxItems": 4}})),
    ("Describe a user.", _obj({"user": _obj({"name": _str(12), "email": _str(20)}), "active": {"type": "boolean"}})),
    ("Pick a language.", _obj({"language": {"enum": ["python", "rust", "go"]}, "stars": _int()})),
    ("List the steps.", _obj({"steps": {"type": "array", "items": _str(20), "minItems": 1, "maxItems": 3}})),
    (
        "What is the weather?",
        _obj({"temperature": {"type": "number", "minimum": -50, "maximum": 50}, "unit": {"enum": ["C", "F"]}}),
    ),
    (
        "Give a small matrix.",
        _obj({"matrix": {"type": "array", "items": {"type": "array", "items": _int(0, 9), "maxItems": 2}}}),
    ),
    ("Describe a ticket.", _obj({"status": {"enum": ["open", "closed"]}, "priority": _int(1, 5), "owner": _str(10)})),
    ("Describe a book.", _obj({"book": _obj({"title": _str(), "pages": _int(1, 999)}), "read": {"type": "boolean"}})),
    ("Give a word.", _obj({"word": _str(10), "length": _int(0, 20)})),
    (
        "How do you feel?",
        _obj({"mood": {"enum": ["happy", "sad", "calm"]}, "level": {"type": "number", "minimum": 0, "maximum": 1}}),
    ),
    ("Add two numbers.", _obj({"a": _int(), "b": _int(), "sum": _int(0, 1998)})),
]


def response_format(schema: dict) -> dict:
    """``schema`` as an OpenAI ``response_format`` object (the ``RESPONSE_FORMAT`` wire's shape)."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def run_structured(plain, best, spec: str, tokenizer, cases: list, max_tokens: int, reps: int = 1, on_step=None):
    """The section's figures. ``plain`` and ``best``: in-process :class:`~tandem.engine.inprocess.Engine`\\ s (they
    may be one); ``spec``: the best arm; ``cases``: ``(prompt text, JSON schema)`` pairs; each run generates up to
    ``max_tokens``. ``on_step()`` is called after each run (progress). Returns ``tokens_per_s`` medians by row
    (``plain``, ``plain_json``, ``best``, ``best_json``; after each reply's first token), the ratios ``json_over_free_plain``,
    ``json_over_free_best``, ``best_over_plain_json``, ``tau_free`` / ``tau_json`` and ``accept_free`` / ``accept_json`` (accepted of drafted; the best arm), ``identical``
    of ``cases`` constrained runs, ``mask_us_per_row`` and ``compile_ms``."""
    grammars = [e.sched.admission.grammars for e in {id(plain): plain, id(best): best}.values()]
    for g in grammars:
        g.load()
    before = [dict(g.stats) for g in grammars]
    rows = {"plain": [], "plain_json": [], "best": [], "best_json": []}
    same = 0
    for _ in range(reps):
        for text, sch in cases:
            ids = tokenizer.chat_prompt(text)
            got = {}
            for name, eng, sp, fmt in (
                ("plain", plain, "off", None),
                ("plain_json", plain, "off", response_format(sch)),
                ("best", best, spec, None),
                ("best_json", best, spec, response_format(sch)),
            ):
                got[name] = r = eng.generate(ids, max_tokens, spec=sp, response_format=fmt)
                rows[name].append(r)
                if on_step is not None:
                    on_step()
            same += got["plain_json"]["token_ids"] == got["best_json"]["token_ids"]
    d = {k: sum(g.stats[k] - b[k] for g, b in zip(grammars, before)) for k in before[0]}
    med = statistics.median

    def tps(name):  # after the first token: a constrained reply is short, and its prime would weigh more
        return med(
            (len(r["token_ids"]) - 1) / (r["elapsed_s"] - r["ttft_s"]) for r in rows[name] if len(r["token_ids"]) > 1
        )

    def accept(name):
        acc, drafted = sum(r["accepted"] for r in rows[name]), sum(r["drafted"] for r in rows[name])
        return acc / drafted if drafted else None

    def tau(name):
        acc, rounds = sum(r["accepted"] for r in rows[name]), sum(r["rounds"] for r in rows[name])
        return 1 + acc / rounds if rounds else None

    t = {name: tps(name) for name in rows}
    return {
        "spec": spec,
        "cases": len(cases) * reps,
        "tokens_per_s": t,
        "json_over_free_plain": t["plain_json"] / t["plain"],
        "json_over_free_best": t["best_json"] / t["best"],
        "best_over_plain_json": t["best_json"] / t["plain_json"],
        "best_over_plain_free": t["best"] / t["plain"],
        "tau_free": tau("best"),
        "tau_json": tau("best_json"),
        "accept_free": accept("best"),
        "accept_json": accept("best_json"),
        "identical": same,
        "mask_us_per_row": 1e6 * d["mask_s"] / d["mask_rows"] if d["mask_rows"] else None,
        "compile_ms": 1e3 * d["compile_s"] / d["compiles"] if d["compiles"] else None,
        "tokens_json": med(len(r["token_ids"]) for r in rows["plain_json"]),
    }


def print_structured(console, s: dict) -> None:
    """The section's lines (``s``: :func:`run_structured`'s figures)."""
    t = s["tokens_per_s"]
    console.print(
        f"{'structured output (JSON schema)':>30}: decode plain {t['plain']:.0f} -> {t['plain_json']:.0f} tok/s constrained "
        f"([bold]{s['json_over_free_plain']:.2f}x[/]); {s['spec']} {t['best']:.0f} -> {t['best_json']:.0f} tok/s "
        f"([bold]{s['json_over_free_best']:.2f}x[/])"
    )
    tau = " / ".join("-" if x is None else f"{x:.2f}" for x in (s["tau_free"], s["tau_json"]))
    acc = " / ".join("-" if x is None else f"{x:.0%}" for x in (s["accept_free"], s["accept_json"]))
    console.print(
        f"{'':>30}  {s['spec']} / plain under the schema [bold]{s['best_over_plain_json']:.2f}x[/] "
        f"(unconstrained {s['best_over_plain_free']:.2f}x); tau free / constrained {tau}, drafts accepted {acc}; "
        f"identical {s['identical']}/{s['cases']}; mask {s['mask_us_per_row']:.1f} us/row, "
        f"compile {s['compile_ms']:.1f} ms/schema; median {s['tokens_json']:.0f} tokens a reply"
    )
