"""Miss accounting: one reason for every prompt token an infinite cache would have reused.

A request's prompt of ``L`` tokens reused ``r`` of them (``realized``). The
ledger (``disagg.reuse.ledger``) says how far an infinite cache would have
gone: ``bound`` (this tenant's salt) and ``bound_any_salt`` (any tenant), both
at most ``L - 1`` (the last prompt token is always computed: its logits give
the first output). Every token of ``[r, bound_any_salt)`` gets exactly one
reason, furthest resume points first::

    0        r          c_pub     c_pend    c_race       bound   bound_any
    |--------|----------|---------|---------|------------|-------|
     reused   evicted /   in_flight raced_     no_checkpoint tenant_salt
              load_* /              publish
              not_looked_up

- ``c_pub``: furthest checkpoint ``<= bound`` published before the lookup began.
  Tokens below it were lost because the state was gone by then
  (``evicted``), its lookup or load ran out of time (``load_deadline``) or
  failed (``load_failed``), or it was there and not used (``not_looked_up``:
  routed away from where it lives, a resident consumed by another request,
  a preemption).
- ``c_pend``: furthest checkpoint whose publish was in flight at the lookup.
- ``c_race``: furthest checkpoint published after the lookup began.
- The rest up to ``bound`` had no KDA checkpoint at all (``no_checkpoint``);
  tokens only another tenant's salt saw are ``tenant_salt``.

So ``sum(classify(m).values()) == max(0, m.bound_any_salt - m.realized)``.
A client that counts more reusable tokens than the server ever saw (another
tokenization, other hash blocks) shows that gap in ``disagg bench``'s table as
``hash_mismatch``.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONS = ("evicted", "load_deadline", "load_failed", "not_looked_up", "in_flight", "raced_publish",
           "no_checkpoint", "tenant_salt")
FAILURES = ("", "load_deadline", "load_failed")


@dataclass(slots=True)
class MissInputs:
    """What one request's accounting needs (plain data, gathered by the worker)."""

    num_prompt: int  # prompt tokens
    realized: int  # prompt tokens whose state was reused (what the client is told)
    bound: int  # longest prefix seen under this salt before the request (<= num_prompt - 1)
    bound_any_salt: int  # the same over every salt (>= bound)
    published: tuple[int, ...] = ()  # checkpoint positions <= bound published before the lookup
    pending: tuple[int, ...] = ()  # positions whose publish was in flight at the lookup
    raced: tuple[int, ...] = ()  # positions published after the lookup began
    still_held: bool = True  # the furthest published point was still resumable after the prefill
    failure: str = ""  # "load_deadline" | "load_failed": what this request's lookup or load hit

    def __post_init__(self) -> None:
        if self.failure not in FAILURES:
            raise ValueError(f"failure must be one of {FAILURES}, got {self.failure!r}")
        if not 0 <= self.bound <= self.bound_any_salt:
            raise ValueError(f"need 0 <= bound ({self.bound}) <= bound_any_salt ({self.bound_any_salt})")


def classify(m: MissInputs) -> dict[str, int]:
    """Missed tokens by reason (only reasons with tokens); see the module docstring."""
    out: dict[str, int] = {}

    def add(reason: str, n: int) -> None:
        if n > 0:
            out[reason] = out.get(reason, 0) + n

    lo, hi = m.realized, m.bound
    add("tenant_salt", m.bound_any_salt - max(hi, lo))
    if hi <= lo:
        return out
    c = max((p for p in m.published if lo < p <= hi), default=0)
    if c:
        add(m.failure or ("not_looked_up" if m.still_held else "evicted"), c - lo)
        lo = c
    for reason, points in (("in_flight", m.pending), ("raced_publish", m.raced)):
        c = max((p for p in points if lo < p <= hi), default=0)
        if c:
            add(reason, c - lo)
            lo = c
    add("no_checkpoint", hi - lo)
    return out
