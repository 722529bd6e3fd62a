"""Stop strings and stateless detokenization, in-process: StopText against a full decode, the
postprocessing rule over any split of a turn's tokens, and greedy MTP turns cut by stop strings that
land inside accepted draft blocks or span a burst boundary (output = plain decoding cut at the stop)."""

import random

import pytest

from tandem import schema
from tandem.engine.inprocess import Engine
from tandem.engine.scheduler import Turn
from tandem.engine.stops import StopText, validate_stops
from tandem.serving.text import response_text

TEXT = 'Il était une fois, à Zürich — naïve café 😀 日本語 and "quotes"\n\nend.'


def _complete(s: str) -> str:
    return s[:-1] if s.endswith("\ufffd") else s


def test_multibyte_characters_span_tokens(tokenizer):
    """The case the detokenizer exists for: some characters of TEXT take several tokens."""
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))


def test_stop_text_follows_the_decode_and_never_shows_a_stop(tokenizer):
    """For stop strings at every character offset of TEXT: the token completing the first occurrence
    is found, the text is cut before it, and the tokens :meth:`safe` releases never decode past it."""
    ids, cases = tokenizer.encode(TEXT), 0
    for c in range(0, len(TEXT) - 2, 3):
        for n in (1, 2, 5):
            stop = TEXT[c : c + n]
            if TEXT.find(stop) != c or "\ufffd" in stop:
                continue
            st = StopText(tokenizer.decode, (stop, "never-there"))
            want = next(k for k in range(1, len(ids) + 1) if stop in _complete(tokenizer.decode(ids[:k])))
            for k, t in enumerate(ids):
                hit = st.push(t)
                if not hit:
                    assert st.text == _complete(tokenizer.decode(ids[: k + 1]))
                    shown = _complete(tokenizer.decode(ids[: st.safe()]))
                    assert TEXT[:c].startswith(shown), (stop, k)  # nothing of the stop string is released
                else:
                    assert k + 1 == want and st.matched == stop and st.cut == c
                    assert st.final_text() == TEXT[:c] and st.safe() == k + 1
                    break
            cases += 1
    assert cases > 30


@pytest.mark.parametrize("seed", range(4))
def test_stateless_postprocessing_over_any_split(tokenizer, seed):
    """Any split of a turn's tokens into responses (each with its PRECEDING_IDS window) gives back
    the whole text, characters split across responses included; with a stop string, split the way
    hold_back splits it, the text ends before the stop."""
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT)
    cuts = sorted(rng.sample(range(1, len(ids)), 6))
    parts = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
    out, sent = "", []
    for i, p in enumerate(parts):
        out += response_text(tokenizer.decode, p, sent[-schema.DETOKENIZE_WINDOW :], i == len(parts) - 1)
        sent += p
    assert out == TEXT
    stop = "café"
    st, out, sent = StopText(tokenizer.decode, (stop,)), "", []
    for p in parts:
        n = st.scan(p)
        toks, _ = st.hold_back(p[:n] if n else p, [0.0] * len(p[:n] if n else p), n is not None)
        out += response_text(tokenizer.decode, toks, sent[-schema.DETOKENIZE_WINDOW :], n is not None, st.matched or "")
        sent += toks
        if n is not None:
            break
    assert out == TEXT[: TEXT.find(stop)] and st.matched == stop
    assert tokenizer.decode(sent).startswith(TEXT[: TEXT.find(stop) + len(stop)])


def test_stop_limits_are_named():
    dec = str
    assert (
        validate_stops(("x",) * (schema.MAX_STOPS + 1), dec) == f"STOP: at most {schema.MAX_STOPS} stop strings, got 9"
    )
    assert "1 to 64 characters, got 0" in validate_stops(("",), dec)
    assert "1 to 64 characters, got 65" in validate_stops(("y" * 65,), dec)
    assert "no tokenizer" in validate_stops(("a",), None)
    assert validate_stops(("a", "bc"), dec) is None


def test_stop_strings_cut_inside_accepted_blocks(trunk_fp32, tokenizer):
    """Greedy MTP turns with a stop string taken from plain decoding's text: the emitted ids equal
    plain decoding's through the token completing the stop, the streamed text (postprocessing each
    response) equals plain text cut before the stop, the trunk cache holds exactly the emitted
    context (the rest of an accepted block rolled back), and usage counts the emitted ids. Cases
    where the completing token sits inside an accepted block, and where the stop starts in an
    earlier burst than it completes, are both exercised."""
    eng = Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=3, burst_rounds=1, adaptive_draft=False)
    ids = tokenizer.chat_prompt("Write a Python function that reverses a string.")
    ref = eng.generate(ids, 60, spec="off")["token_ids"]
    text = tokenizer.decode(ref)
    rounds: list[list[int]] = []
    eng.generate(ids, 60, spec="mtp", on_burst=lambda r: rounds.append(list(r.tokens)))
    round_of = [i for i, r in enumerate(rounds) for _ in r]  # the round that emitted each token
    ends = {len(sum(rounds[: i + 1], [])) - 1 for i in range(len(rounds))}
    inside = spanning = cases = 0
    for c in range(2, min(len(text) - 12, 120), 5):
        for n in (2, 9):
            stop = text[c : c + n]
            if text.find(stop) != c or not stop.strip():
                continue
            j = next(k for k in range(len(ref)) if stop in _complete(tokenizer.decode(ref[: k + 1])))
            first = next(k for k in range(len(ref)) if len(_complete(tokenizer.decode(ref[: k + 1]))) > c)
            sid, got = 9800 + cases, []
            eng.sched.admit(
                [
                    Turn(
                        sid,
                        ids,
                        60,
                        lambda r, e, f: got.append((r, e, f)),
                        spec="mtp",
                        end=False,
                        stop=(stop, "\x00never"),
                    )
                ]
            )
            while sid in eng.sched.turns:
                eng.sched.burst()
            assert all(e is None for _, e, _ in got)
            out = [t for r, _, _ in got for t in r.tokens]
            assert out == ref[: j + 1] and got[-1][0].finish_reason == "stop" and got[-1][0].stop_string == stop
            shown, sent = "", []
            for r, _, final in got:
                shown += response_text(
                    tokenizer.decode, r.tokens, sent[-schema.DETOKENIZE_WINDOW :], final, r.stop_string
                )
                sent += r.tokens
                assert text[:c].startswith(shown) or final, (stop, shown)
            assert shown == text[:c], stop
            s = eng.sched.sessions[sid]
            eng.sched.settle()
            assert s.committed == ids + ref[:j] and s.anchor == ref[j] and eng.trunk.cache(sid).pos == len(s.committed)
            assert sum(len(r.tokens) for r, _, _ in got) == j + 1 and sum(r.rounds for r, _, _ in got) == s.rounds
            inside += j not in ends
            spanning += round_of[first] < round_of[j]
            cases += 1
            eng.sched.close(sid)
    assert cases >= 10 and inside >= 2 and spanning >= 2, (cases, inside, spanning)


def test_a_turn_without_stream_is_one_response(trunk_fp32, tokenizer):
    """stream=False (the ensemble's generate endpoint): the front merges a turn's bursts into one
    final response; its tokens and counts equal the streamed turn's (checked in the served tests;
    here the receipt merge itself)."""
    from tandem.engine.session import Receipt

    a = Receipt(
        tokens=[1, 2], rounds=1, drafted=3, accepted=1, accepted_at=[1, 0, 0], spec_rounds=1, top2_gaps=[0.1, 0.2]
    )
    a.merge(
        Receipt(
            tokens=[3],
            rounds=1,
            drafted=3,
            accepted=0,
            accepted_at=[0, 0, 0],
            finish_reason="stop",
            spec_rounds=1,
            top2_gaps=[0.3],
            stop_string="x",
        )
    )
    assert (
        a.tokens,
        a.rounds,
        a.drafted,
        a.accepted,
        a.accepted_at,
        a.spec_rounds,
        a.finish_reason,
        a.stop_string,
    ) == ([1, 2, 3], 2, 6, 1, [1, 0, 0], 2, "stop", "x")


def _turn(eng, sid, ids, max_tokens, **kw):
    got = []
    eng.sched.admit([Turn(sid, ids, max_tokens, lambda r, e, f: got.append((r, e)), spec="mtp", end=False, **kw)])
    while sid in eng.sched.turns:
        eng.sched.burst()
    assert all(e is None for _, e in got)
    s = eng.sched.sessions[sid]
    eng.sched.settle()
    return [t for r, _ in got for t in r.tokens], [r for r, _ in got], s


def test_max_tokens_cut_inside_accepted_blocks(trunk_fp32, tokenizer):
    """MAX_TOKENS landing inside an accepted draft block: the output is plain decoding's first
    max_tokens ids, the trunk cache holds exactly the emitted context and usage the emitted ids."""
    eng = Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=3, burst_rounds=1, adaptive_draft=False)
    ids = tokenizer.chat_prompt("Write a Python function that reverses a string.")
    ref = eng.generate(ids, 40, spec="off")["token_ids"]
    inside = 0
    for n in range(2, 24):
        out, receipts, s = _turn(eng, 9900 + n, ids, n)
        assert out == ref[:n] and receipts[-1].finish_reason == "length", n
        assert (
            s.committed == ids + ref[: n - 1]
            and s.anchor == ref[n - 1]
            and eng.trunk.cache(s.sid).pos == len(s.committed)
        )
        assert sum(len(r.tokens) for r in receipts) == n
        last = receipts[-1]
        inside += last.rounds == 1 and last.accepted == len(last.tokens)  # the cut took drafts only: mid-block
        eng.sched.close(s.sid)
    assert inside >= 2, inside


def test_eos_inside_accepted_blocks(trunk_fp32, tokenizer):
    """The checkpoint's EOS ids (the scheduler's stop ids) accepted as a draft, with the rest of its
    block dropped. The shipped miniature rarely ends a reply within a test's budget, so the scheduler
    is given, as its EOS, a token plain decoding produces at position k: the output equals plain
    decoding's through it, the cache holds exactly the emitted context, usage the emitted ids, and,
    being EOS, it is not context for the next turn (unlike a STOP_TOKEN_IDS stop)."""
    eng = Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=3, burst_rounds=1, adaptive_draft=False)
    ids = tokenizer.chat_prompt("Write a Python function that reverses a string.")
    ref = eng.generate(ids, 40, spec="off")["token_ids"]
    inside = 0
    for k in range(1, 30):
        x = ref[k]
        if ref.index(x) != k:
            continue
        eng.sched.stop_ids = (x,)
        out, receipts, s = _turn(eng, 9950 + k, ids, 40)
        assert out == ref[: k + 1] and receipts[-1].finish_reason == "stop", k
        assert s.committed == ids + ref[:k] and s.anchor == x and eng.trunk.cache(s.sid).pos == len(s.committed)
        assert sum(len(r.tokens) for r in receipts) == k + 1
        last = receipts[-1]
        if last.rounds == 1 and last.accepted == len(last.tokens):  # the stop token was an accepted draft
            inside += 1
            if inside == 1:  # EOS is dropped: the next turn's first token follows ref[k - 1]
                nxt = tokenizer.chat_prompt("Thanks")
                eng.sched.admit([Turn(s.sid, nxt, 2, lambda r, e, f: None, start=False)])
                assert s.committed == ids + ref[:k] + nxt
                while s.sid in eng.sched.turns:
                    eng.sched.burst()
        eng.sched.close(s.sid)
    eng.sched.stop_ids = tokenizer.stop_ids
    assert inside >= 2, inside


def test_a_stop_token_first_with_stop_strings(trunk_fp32, tokenizer):
    """A turn with stop strings whose very first token is a stop token id: it ends there, and the
    stop-string tracker has seen that token (its response is released, not refused by hold_back)."""
    eng = Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=3, burst_rounds=1, adaptive_draft=False)
    ids = tokenizer.chat_prompt("Write a Python function that reverses a string.")
    first = eng.generate(ids, 4, spec="off")["token_ids"][0]
    out = eng.generate(ids, 20, spec="mtp", stop_token_ids=(first,), stop=("never-in-text",))
    assert out["token_ids"] == [first] and out["finish_reason"] == "stop" and out["stop_string"] == ""
