"""gymnasium adapters over the buffer, numpy only (gymnasium itself is never imported here).

``steps.GymStepConverter`` turns vector-env steps into dm_env steps, ``writer.GymStepWriter``
writes them straight into a ReplayBuffer and ``modes``
reads gymnasium's autoreset modes. The public names are exported from :mod:`shardreplay`.
"""
