"""Keys that are not keys of this buffer are refused; its own keys, stale ones too, are not.

A key carries its buffer's key tag (spec/keys.py). The cases of the issue: ``torch.arange``
(TorchRL's habit of passing indices), keys of another buffer with the same layout and
data, and random int64 must raise ``InvalidKeyError`` and change nothing; keys of this
buffer are applied, and keys whose slot was overwritten since sampling are counted as
stale, as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardreplay import Field, ReplayBuffer, Spec, testing
from shardreplay.errors import InvalidKeyError
from shardreplay.spec.keys import NUM_TAGS, new_key_tag, unpack_keys
from tests.kernels import reference as ref
from tests.support.buffers import assert_same, snapshot

SPEC = Spec({"obs": Field((2,), np.float32)})
S, C, B = 4, 64, 32


def _filled(seed: int = 0) -> ReplayBuffer:
    """A prioritized buffer whose every slot holds a valid window start (no wrap yet)."""
    buf = ReplayBuffer(SPEC, num_streams=S, stream_capacity=C, window=2, sampler="prioritized",
                       seed=seed)
    for t in range(C):
        buf.add({"obs": np.full((S, 2), t, np.float32), "step_type": np.full(S, 0 if t == 0 else 1)})
    return buf


def _refused(buf: ReplayBuffer, keys: object) -> str:
    """The message of the InvalidKeyError that ``keys`` raise; asserts nothing changed."""
    before = snapshot(buf)
    with pytest.raises(InvalidKeyError) as info:
        buf.update_priorities(keys, np.full(len(keys), 7.0, np.float32))  # type: ignore[arg-type]
    assert_same(before, snapshot(buf))
    return str(info.value)


def test_arange_keys_are_refused_and_change_nothing() -> None:
    buf = _filled()
    message = _refused(buf, torch.arange(B))
    assert "keys must come from this buffer's sample()" in message
    assert isinstance(InvalidKeyError(message), ValueError)
    # Every small integer, not just the first ones: tag 0 is never a buffer's tag.
    for keys in (np.arange(S * C), np.arange(S * C) << 11, np.array([1, 2, 3]) << 39):
        _refused(buf, keys)


def test_keys_of_another_buffer_with_the_same_layout_and_data_are_refused() -> None:
    a, b = _filled(seed=0), _filled(seed=0)  # equal content, equal draws, another tag
    assert a.info().key_tag != b.info().key_tag
    keys_b = b.sample(B).keys
    keys_a = a.sample(B).keys
    assert (unpack_keys(keys_a.numpy())[2] == unpack_keys(keys_b.numpy())[2]).all()  # same places
    _refused(a, keys_b)
    _refused(a, torch.cat([keys_a[:-1], keys_b[-1:]]))  # one foreign key spoils the call


def test_random_int64_keys_are_refused() -> None:
    buf = _filled()
    before = snapshot(buf)
    rng = np.random.default_rng(0)
    keys = np.concatenate([rng.integers(0, 2**63 - 1, 2000, dtype=np.int64),
                           rng.integers(-2**63, 0, 200, dtype=np.int64)])
    refused = 0
    for k in keys:
        with pytest.raises(InvalidKeyError):
            buf.update_priorities([k], [7.0])
        refused += 1
    assert refused == keys.size
    # Right tag, shard 0 and a place past the end: still not a key of this buffer.
    with pytest.raises(InvalidKeyError):
        past_end = ref.encode_keys(*(np.array([v], np.int64) for v in (0, buf.info().key_tag, S * C, 1)))
        buf.update_priorities(past_end, [7.0])
    assert_same(before, snapshot(buf))


def test_own_keys_are_applied_and_stale_ones_counted() -> None:
    buf = _filled()
    batch = buf.sample(B)
    assert buf.update_priorities(batch.keys, np.full(B, 5.0, np.float32)) == B
    places = unpack_keys(batch.keys.numpy())[2]
    assert (testing.stored(buf, "priority")[places] == 5.0).all()
    # Overwrite every slot once: the same keys are now stale, counted, not an error.
    for _ in range(C):
        buf.add({"obs": np.zeros((S, 2), np.float32), "step_type": np.ones(S, np.int64)})
    stale_before = buf.info().stale_updates
    assert buf.update_priorities(batch.keys, np.full(B, 9.0, np.float32)) == 0
    assert buf.info().stale_updates - stale_before == B
    assert not (testing.stored(buf, "priority") == 9.0).any()


def test_a_state_dict_carries_the_key_tag() -> None:
    a = _filled(seed=0)
    keys = a.sample(B).keys
    b = ReplayBuffer(SPEC, num_streams=S, stream_capacity=C, window=2, sampler="prioritized", seed=3)
    assert b.info().key_tag != a.info().key_tag
    b.load_state_dict(a.state_dict())
    assert b.info().key_tag == a.info().key_tag
    assert b.update_priorities(keys, np.full(B, 2.0, np.float32)) == B  # a's keys are b's now


def test_tags_are_never_zero_and_differ_between_buffers_of_a_process() -> None:
    tags = [new_key_tag() for _ in range(NUM_TAGS - 1)]
    assert min(tags) >= 1 and max(tags) <= NUM_TAGS
    assert len(set(tags)) == len(tags)

