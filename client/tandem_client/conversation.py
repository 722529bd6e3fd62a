"""A multi-turn conversation that survives losing its server.

With replicas behind a proxy, a session lives on one server; when that server dies, the turn gets
:class:`~tandem_client.client.SessionLost`. :class:`Conversation` keeps the transcript (every token the
server's session context holds), so its next turn re-primes: a first turn under a new sequence id
that carries the whole transcript plus the new prompt, which the proxy routes to a live server. The
session's context is then the same tokens, so greedy output equals an uninterrupted run.
"""

from __future__ import annotations

from tandem_client.client import DEFAULT_URL, SessionLost, TandemClientError, generate


class Conversation:
    """One conversation over the ``tandem`` model, re-primed under a new sequence id when its session is lost.

    Args: ``url`` — gRPC ``host:port`` (a proxy or one server); ``stop_ids`` — the checkpoint's
    template stop tokens (``ChatTokenizer.stop_ids``: a reply that ends at one does not keep it as
    context, as the server does); ``start_retries`` — a first turn refused ``AtCapacity`` is retried
    under new sequence ids this many times; ``defaults`` — keyword arguments of
    :func:`~tandem_client.client.generate` for every turn (``spec``, ``sampling``, ...).

    Attributes: ``transcript`` (token ids of the context the session holds), ``sequence_id`` (None
    before the first turn and after a loss), ``reprimes`` (turns sent as a re-prime).
    """

    def __init__(
        self, url: str = DEFAULT_URL, stop_ids: tuple[int, ...] = (), start_retries: int = 2, **defaults
    ) -> None:
        self.url, self.stop_ids, self.start_retries, self.defaults = url, tuple(stop_ids), start_retries, defaults
        self.transcript: list[int] = []
        self.sequence_id: int | None = None
        self.reprimes = 0

    def turn(self, prompt_ids: list[int], max_tokens: int, end: bool = False, **kw) -> dict:
        """Send one turn (``prompt_ids``: this turn's tokens, e.g. ``chat_prompt(text, later=True)``) and
        return :func:`~tandem_client.client.generate`'s result plus ``reprimed`` (True when it was sent as a
        re-prime: a new sequence carrying the transcript). ``end``: end the sequence with this turn.

        Raises :class:`~tandem_client.client.SessionLost` when the server lost the session (the transcript
        is unchanged; call again to re-prime), and any other
        :class:`~tandem_client.client.TandemClientError` of ``generate``.
        """
        start = self.sequence_id is None
        ids = self.transcript + list(prompt_ids) if start else list(prompt_ids)
        try:
            res = generate(
                ids,
                max_tokens,
                url=self.url,
                sequence_id=self.sequence_id,
                sequence_start=start,
                sequence_end=end,
                start_retries=self.start_retries if start else 0,
                **{**self.defaults, **kw},
            )
        except SessionLost:
            self.sequence_id = None
            raise
        except TandemClientError:
            if start:  # a failed first turn leaves nothing on the server
                self.sequence_id = None
            raise
        res["reprimed"] = start and bool(self.transcript)
        self.reprimes += res["reprimed"]
        reply = list(res["token_ids"])
        if res["finish_reason"] == "stop" and reply and reply[-1] in self.stop_ids:
            reply = reply[:-1]  # the template's stop token is not context: the next prompt's first token is
        self.transcript += list(prompt_ids) + reply
        self.sequence_id = None if end else res["sequence_id"]
        return res

    def close(self) -> None:
        """End the open sequence, if any (one token, best effort: a lost session holds nothing anyway)."""
        if self.sequence_id is None:
            return
        sid, self.sequence_id = self.sequence_id, None
        try:
            generate([], 1, url=self.url, sequence_id=sid, sequence_start=False, sequence_end=True)
        except TandemClientError:
            pass
