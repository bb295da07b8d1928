"""When to try a request again, and how long to wait first."""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

RETRY_STATUSES = frozenset({408, 429})  # and every 5xx
MAX_RETRY_AFTER_S = 300.0  # a longer Retry-After is capped here


def is_retryable_status(status: int) -> bool:
    """408, 429 and 5xx may succeed later; any other 4xx will not."""
    return status in RETRY_STATUSES or 500 <= status <= 599


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(value)))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    now = time.time() if now is None else now
    return min(MAX_RETRY_AFTER_S, max(0.0, when.timestamp() - now))


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff ("full jitter"): before retry k (0-based) wait a uniform
    draw from [0, min(max_delay, base_delay * 2**k)], or what Retry-After says."""

    max_retries: int = 3
    base_delay: float = 0.5
    max_delay: float = 8.0

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        if retry_after is not None:
            return retry_after
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * 2**attempt))
