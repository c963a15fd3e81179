"""How a stream whose decode replica was lost waits for a replica to continue on.

The ingress (``deployments.ingress.ServeBackend``) continues a stream whose decode replica
died from the tokens already sent (``disagg.workers.tiered.continue_params``). When every decode
replica is down at once, the next call fails at once too (the handle still lists the dead
replicas) or waits in Serve's queue until the controller has started a new one. Giving up
after a fixed number of calls cut such streams short; instead the stream waits, with
backoff, until a replica answers or the outage has lasted ``deployment.stream_resume_timeout_s``:

    loss at t0 -> try  fails -> sleep 0.1 -> try fails -> sleep 0.2 -> ... (at most 2 s apart)
               -> try  waits in Serve's queue, at most until t0 + timeout
               -> a replica acknowledges the call: resumed (the clock is gone; a later loss
                  starts a new one)
               -> t0 + timeout passes first: the client gets a 503 ``stream_resume_timeout``

NOTES
1. The clock starts at the loss and stops when a replica takes a continuation: its first chunk,
   an empty acknowledgment (``GenerateParams.ack``) sent before any work. The timeout bounds an
   outage (no replica to take the stream), not the continuation's prefill, which under load
   may take long and is bounded by the request's own limits, as any request's is.
2. Only losses that follow progress count against ``deployment.max_stream_resumes`` (a
   request that kills every replica it reaches ends; failed tries during an outage are
   waiting, not resumes).
3. Pure: time is passed in, so the policy is tested without a clock or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ResumeWait:
    """The backoff and deadline of one outage of a stream (NOTE 1)."""

    timeout_s: float  # the outage may last this long (deployment.stream_resume_timeout_s)
    started: float  # monotonic time of the loss
    first_delay_s: float = 0.1  # sleep before the first retry; doubles each retry
    max_delay_s: float = 2.0  # the longest sleep between retries
    num_tries: int = 0  # retries scheduled so far

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.first_delay_s <= 0 or self.max_delay_s < self.first_delay_s:
            raise ValueError("need timeout_s > 0 and 0 < first_delay_s <= max_delay_s")

    def remaining(self, now: float) -> float:
        """Seconds left before the deadline (0 when it has passed)."""
        return max(0.0, self.started + self.timeout_s - now)

    def next_delay(self, now: float) -> float | None:
        """Seconds to sleep before the next try, never past the deadline; None once it passed."""
        left = self.remaining(now)
        if left <= 0:
            return None
        delay = min(self.max_delay_s, self.first_delay_s * 2 ** min(self.num_tries, 30), left)
        self.num_tries += 1
        return delay



def timeout_message(timeout_s: float, num_sent: int) -> str:
    """What the client reads when the outage outlasted ``timeout_s``."""
    return (f"no decode replica could continue this stream within {timeout_s:g} s "
            f"(deployment.stream_resume_timeout_s) after {num_sent} tokens were sent; retry the request")
