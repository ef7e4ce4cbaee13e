"""The device share of mirrored (shadow) requests: a token bucket of device seconds.

Mirrors run at the lowest tier, in the gaps callers' batches leave (`Node._yield_to_callers`). On a busy
device those gaps are few and short, so without a share a shadow compares only a sliver of what it is sent.
With a share, mirrors also earn `share` device seconds per second, saved up to `burst` seconds' worth:
a batch of mirrors the bucket can pay for runs on the next free device even when a callers' batch is due
(which then waits for it: a mirror batch is at most the rows that compute within the candidate's batch
window, `shadow.stack_rows`), and admission judges a mirror by how soon its share drains the mirrors queued
ahead of it, not by the callers' backlog. What runs in a gap costs the bucket nothing.

Plain Python, the clock passed in.
"""

from __future__ import annotations

MAX_SHARE = 0.5  # mirrors never get more than half of the device: callers' work comes first


class MirrorShare:
    """Device seconds mirrors may take ahead of callers: `share` of each second, kept up to `burst` seconds'
    worth (`share` 0: none, mirrors run only in gaps)."""

    def __init__(self, share: float, *, burst: float = 0.25, now: float = 0.0) -> None:
        if not 0.0 <= share <= MAX_SHARE:
            raise ValueError(f"a mirror share is between 0 and {MAX_SHARE}, not {share}")
        self.share = share
        self.cap = share * burst
        self._tokens = self.cap
        self._at = now

    @property
    def enabled(self) -> bool:
        return self.share > 0.0

    def credit(self, now: float) -> float:
        """Device seconds saved up now."""
        if now > self._at:
            self._tokens = min(self.cap, self._tokens + (now - self._at) * self.share)
            self._at = now
        return self._tokens

    def affordable(self, estimates: list[float], now: float) -> int:
        """How many of a batch's prefixes the bucket pays for: the longest whose estimate (`estimates[i]`, the
        seconds of the first i + 1 requests, rising) is within the credit; 0 when not even the first."""
        credit = self.credit(now)
        fits = 0
        for seconds in estimates:
            if seconds > credit:
                break
            fits += 1
        return fits

    def spend(self, seconds: float, now: float) -> None:
        self.credit(now)
        self._tokens -= seconds


def admit(*, now: float, deadline: float, queued_work: float, own: float, share: float, headroom: float) -> bool:
    """Whether a mirror is admitted on its share: the mirrors' work queued ahead of it (`queued_work`, device
    seconds) and its own (`own`), run at `share` of the device, finish within `headroom` of its time left."""
    if share <= 0.0:
        return False
    return (queued_work + own) / share <= (deadline - now) * headroom
