"""Expected output tokens of a request, learned from the requests that finished (router step 0).

The decode scorer weighs a placement's hand-off and the step in progress
(paid once) against the request's decode steps (paid per token), so it needs
how many tokens the request will generate. A client rarely says: the API's
``max_tokens`` is a cap (often 4-32x what an agent's turn produces), and the
router cannot see the future. So it learns::

    expect(r) = the request's own hint                    if the client gave one (``output_len_hint``)
              = min(session_mean(r), cap)                 the session's finished turns
              = min(global_mean, cap)                     no finished turn of the session yet
              = 0                                         nothing finished yet: the scorers' default
    cap       = r.max_output_tokens (``max_tokens``), or none

    session_mean: exponential mean of a session's finished outputs, weight ``session_alpha``
    global_mean:  exponential mean of every finished output, weight ``global_alpha``

A session's turns are one agent's answers (tool calls, diffs, replies of a
kind), so its own recent outputs predict its next better than the
cluster's; a new session starts from the cluster's.

NOTES
1. ``_booked`` maps a routed request to its session until it finishes; a
   request that ends without a result (None: abandoned, failed) teaches
   nothing. Both tables are bounded: the oldest entries go first.
2. ``expect`` never returns more than the cap, and 0 means "unknown" to the
   scorers (their ``default_output_tokens``).
"""

from __future__ import annotations

from collections import OrderedDict


class OutputPredictor:
    def __init__(self, session_alpha: float = 0.5, global_alpha: float = 0.02, max_entries: int = 1 << 16):
        if not (0.0 < session_alpha <= 1.0 and 0.0 < global_alpha <= 1.0):
            raise ValueError("output alphas must be in (0, 1]")
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.session_alpha = session_alpha
        self.global_alpha = global_alpha
        self.max_entries = max_entries
        self._booked: OrderedDict[str, str] = OrderedDict()  # request id -> session key (NOTE 1)
        self._session: OrderedDict[str, float] = OrderedDict()  # session key -> mean output tokens
        self._global = 0.0
        self.finished = 0  # outputs learned from

    def expect(self, session: str, hint: int = 0, cap: int = 0) -> float:
        """Expected output tokens of a request of ``session`` (NOTE 2)."""
        if hint > 0:
            return float(min(hint, cap) if cap > 0 else hint)
        mean = self._session.get(session) if session else None
        if mean is None:
            mean = self._global if self.finished else 0.0
        return min(mean, float(cap)) if cap > 0 else mean

    def book(self, request_id: str, session: str) -> None:
        """A request was routed; its output is learned when it finishes."""
        self._booked[request_id] = session
        if len(self._booked) > self.max_entries:
            self._booked.popitem(last=False)

    def learn(self, request_id: str, output_tokens: int | None) -> None:
        """The request finished with ``output_tokens`` generated (None: without a result)."""
        session = self._booked.pop(request_id, None)
        if session is None or output_tokens is None or output_tokens < 0:
            return
        n = float(output_tokens)
        self._global = n if not self.finished else self._global + self.global_alpha * (n - self._global)
        self.finished += 1
        if session:
            old = self._session.pop(session, None)
            self._session[session] = n if old is None else old + self.session_alpha * (n - old)
            if len(self._session) > self.max_entries:
                self._session.popitem(last=False)
