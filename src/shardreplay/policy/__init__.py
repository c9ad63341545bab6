"""Policy broadcast from the learner to actors: ``file:///dir`` or ``redis://``.

See :mod:`shardreplay.policy.broadcast`; redis, torch and safetensors are imported only
when first used.
"""

from __future__ import annotations

from shardreplay.policy.broadcast import (
    PolicyPublisher,
    PolicySubscriber,
    PolicyUpdate,
    SubscriberStats,
    open_publisher,
    open_subscriber,
    wait_for_policy,
)

__all__ = [
    "PolicyPublisher",
    "PolicySubscriber",
    "PolicyUpdate",
    "SubscriberStats",
    "open_publisher",
    "open_subscriber",
    "wait_for_policy",
]
