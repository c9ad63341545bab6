"""Policy broadcast from the learner to actors: ``file:///dir`` or ``redis://``.

See :mod:`shardreplay.policy.broadcast`. The modules import redis, torch and safetensors
only when they are first used.
"""

from __future__ import annotations

from shardreplay.policy.broadcast import (
    PolicyPublisher,
    PolicySubscriber,
    PolicyUpdate,
    SubscriberStats,
    wait_for_policy,
)
from shardreplay.policy.factory import open_publisher, open_subscriber

__all__ = [
    "PolicyPublisher",
    "PolicySubscriber",
    "PolicyUpdate",
    "SubscriberStats",
    "open_publisher",
    "open_subscriber",
    "wait_for_policy",
]
