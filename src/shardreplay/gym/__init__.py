"""gymnasium adapters over the buffer, numpy only (gymnasium itself is never imported here).

``steps.GymStepConverter`` turns vector-env steps into dm_env steps, ``writer.GymStepWriter``
writes them straight into a ReplayBuffer, ``modes`` reads gymnasium's autoreset modes and
``spaces.spec_from_env`` an env's Spec. The public names are exported from :mod:`shardreplay`.
"""
