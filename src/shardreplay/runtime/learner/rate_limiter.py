"""A samples-per-insert rate limiter (Reverb's ``SampleToInsertRatio``), as plain counters.

The limiter keeps the replay ratio -- items sampled per item inserted -- near
``samples_per_insert`` once ``min_size_to_sample`` items were inserted. With ``I`` items
inserted and ``N`` sampled so far, let ``diff = I * samples_per_insert - N``:

- inserting ``n`` items is allowed while ``I + n <= min_size_to_sample`` (filling up), or
  when ``(I + n) * samples_per_insert - N <= max_diff``;
- sampling ``m`` items is allowed when ``I >= min_size_to_sample`` and
  ``diff - m >= min_diff``.

``error_buffer`` sets ``[min_diff, max_diff]`` around ``min_size_to_sample *
samples_per_insert`` (a number ``e`` gives ``offset -+ e``; a pair is taken as is). Timeline
for ``samples_per_insert=2``, ``min_size_to_sample=2``, ``error_buffer=4`` (diff in 0..8)::

    insert 1, insert 1        I=2 N=0  diff=4   sampling now allowed
    sample 4                  I=2 N=4  diff=0   sampling blocked (diff - 1 < 0)
    insert 1 x 4              I=6 N=4  diff=8   inserting blocked (diff + 2 > 8)

The learner asks ``can_sample`` before each batch and ``can_insert`` before draining its
transport; while it does not drain, the transport's own bound pushes back on actors, so
memory never grows. Variants are settings of this one mechanism, e.g. :meth:`min_size`
(only a warm-up, no ratio).

The constructor rejects settings that can block both sides forever (Reverb's rule,
extended to batches): with inserts of up to ``n`` items and samples of up to ``m``, the
window must satisfy ``max_diff - min_diff >= n * samples_per_insert + m``, and batched
filling must not overshoot ``max_diff`` before sampling is allowed.
"""

from __future__ import annotations

import math
from typing import Any

from shardreplay.errors import ConfigError

__all__ = ["RateLimiter"]


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class RateLimiter:
    """Keeps samples per insert within bounds.

    Args:
        samples_per_insert: target replay ratio, > 0.
        min_size_to_sample: items inserted before the first sample is allowed, >= 1.
        error_buffer: allowed deviation: a number ``e`` (``diff`` within ``offset -+ e``,
            ``offset = min_size_to_sample * samples_per_insert``) or ``(min_diff, max_diff)``.
        max_insert_size: the largest ``n`` ever passed to :meth:`can_insert` / :meth:`insert`.
        max_sample_size: the largest ``m`` ever passed to :meth:`can_sample` / :meth:`sample`.

    Raises:
        ConfigError: a non-positive ratio or size, or a configuration that can deadlock.
    """

    def __init__(self, samples_per_insert: float, *, min_size_to_sample: int,
                 error_buffer: float | tuple[float, float], max_insert_size: int = 1,
                 max_sample_size: int = 1) -> None:
        if isinstance(samples_per_insert, bool) or not isinstance(samples_per_insert, int | float) \
                or not math.isfinite(samples_per_insert) or samples_per_insert <= 0:
            raise ConfigError(f"samples_per_insert must be a finite number > 0, got {samples_per_insert!r}")
        self.samples_per_insert = float(samples_per_insert)
        self.min_size_to_sample = _positive_int("min_size_to_sample", min_size_to_sample, 1)
        self.max_insert_size = _positive_int("max_insert_size", max_insert_size, 1)
        self.max_sample_size = _positive_int("max_sample_size", max_sample_size, 1)
        self.min_diff, self.max_diff = self._window(error_buffer)
        self._check_no_deadlock()
        self.inserts = 0
        self.samples = 0

    def _window(self, error_buffer: float | tuple[float, float]) -> tuple[float, float]:
        if isinstance(error_buffer, tuple) and len(error_buffer) == 2:
            lo, hi = (float(x) for x in error_buffer)
        elif isinstance(error_buffer, int | float) and not isinstance(error_buffer, bool) \
                and error_buffer >= 0:
            offset = self.min_size_to_sample * self.samples_per_insert
            lo, hi = offset - float(error_buffer), offset + float(error_buffer)
        else:
            raise ConfigError(f"error_buffer must be a number >= 0 or a (min_diff, max_diff) pair, "
                              f"got {error_buffer!r}")
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise ConfigError(f"error_buffer gives an empty or infinite window [{lo}, {hi}]")
        return lo, hi

    def _check_no_deadlock(self) -> None:
        spi, n, m = self.samples_per_insert, self.max_insert_size, self.max_sample_size
        need = n * spi + m
        if self.max_diff - self.min_diff < need:
            raise ConfigError(
                f"error_buffer window [{self.min_diff}, {self.max_diff}] is narrower than "
                f"max_insert_size * samples_per_insert + max_sample_size = {need}: inserts and "
                "samples could both block forever; widen error_buffer")
        overshoot = (self.min_size_to_sample - 1 + n) * spi
        if n > 1 and overshoot > self.max_diff:
            raise ConfigError(
                f"a batch of {n} inserts just before min_size_to_sample={self.min_size_to_sample} "
                f"would need diff {overshoot} > max_diff {self.max_diff} while sampling is not yet "
                "allowed: raise max_diff or lower max_insert_size")

    @classmethod
    def min_size(cls, min_size_to_sample: int, *, max_insert_size: int = 1,
                 max_sample_size: int = 1) -> RateLimiter:
        """Only a minimum size before sampling; the ratio is free.

        Raises:
            ConfigError: a size below 1.
        """
        huge = 1e300
        return cls(1.0, min_size_to_sample=min_size_to_sample, error_buffer=(-huge, huge),
                   max_insert_size=max_insert_size, max_sample_size=max_sample_size)

    # -- questions ------------------------------------------------------------------------
    @property
    def diff(self) -> float:
        """``inserts * samples_per_insert - samples``."""
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, n: int = 1) -> bool:
        """True when inserting ``n`` items keeps the ratio within bounds.

        Raises:
            ConfigError: ``n`` outside ``1..max_insert_size``.
        """
        self._check_size("insert", n, self.max_insert_size)
        if self.inserts + n <= self.min_size_to_sample:
            return True
        return (self.inserts + n) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, n: int = 1) -> bool:
        """True when sampling ``n`` items keeps the ratio within bounds.

        Raises:
            ConfigError: ``n`` outside ``1..max_sample_size``.
        """
        self._check_size("sample", n, self.max_sample_size)
        if self.inserts < self.min_size_to_sample:
            return False
        return self.diff - n >= self.min_diff

    # -- records --------------------------------------------------------------------------
    def insert(self, n: int = 1) -> None:
        """Record ``n`` inserted items (whether or not :meth:`can_insert` allowed them).

        Raises:
            ConfigError: ``n`` outside ``1..max_insert_size``.
        """
        self._check_size("insert", n, self.max_insert_size)
        self.inserts += n

    def sample(self, n: int = 1) -> None:
        """Record ``n`` sampled items.

        Raises:
            ConfigError: ``n`` outside ``1..max_sample_size``.
        """
        self._check_size("sample", n, self.max_sample_size)
        self.samples += n

    @staticmethod
    def _check_size(what: str, n: Any, limit: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
            raise ConfigError(f"{what} size must be an integer in 1..{limit} (max_{what}_size), got {n!r}")

    def __repr__(self) -> str:
        return (f"RateLimiter(samples_per_insert={self.samples_per_insert}, min_size_to_sample="
                f"{self.min_size_to_sample}, window=[{self.min_diff}, {self.max_diff}], "
                f"inserts={self.inserts}, samples={self.samples})")
