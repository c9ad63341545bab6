"""The typed records the ranks gather travel exactly (no float64 squeeze of 64-bit ints)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardreplay.distributed.exchange import ExchangeStats, SamplingSettings
from shardreplay.errors import ConfigError

BIG = (1 << 63) - 1  # not representable in a float64


def test_stats_rows_round_trip_exactly() -> None:
    rows = [ExchangeStats(0.1 + k, 7 * k, math.inf if k == 0 else 1e-300, 256, BIG - k, 3.5, 12345 + k,
                          np.array([k, 0, 2], np.int64)) for k in range(3)]
    got = ExchangeStats.from_rows(np.stack([r.to_row() for r in rows]))
    assert got.seed.tolist() == [BIG, BIG - 1, BIG - 2]  # float64 would round these to 2**63
    assert got.mass.tolist() == [0.1, 1.1, 2.1] and got.mass.dtype == np.float64
    assert got.min_leaf[0] == math.inf and got.min_leaf[2] == 1e-300
    assert got.samplable.tolist() == [0, 7, 14] and got.key_tag.tolist() == [12345, 12346, 12347]
    assert got.tail.tolist() == [[0, 0, 2], [1, 0, 2], [2, 0, 2]]


def test_settings_round_trip_and_refuse_a_flat_tensor() -> None:
    mine = SamplingSettings(-BIG, 40, 1, 0.6, 0.4, 1.0, 1000, 2, 1, 1, 32, 0, BIG, BIG - 5)
    row = mine.to_row()
    assert row.dtype == np.int64 and row.tolist()[-5:] == [1, 32, 0, BIG, BIG - 5]
    assert row.tolist()[0] == -BIG
    got = SamplingSettings.from_rows(np.stack([row, row]))
    assert got.host_key.tolist() == [BIG, BIG] and got.nonce.tolist() == [BIG - 5] * 2
    assert got.alpha.tolist() == [0.6, 0.6] and got.beta_steps.tolist() == [1000, 1000]
    with pytest.raises(ConfigError, match="gathered"):
        SamplingSettings.from_rows(row)
