"""The training runtime built on the library (``shardreplay train``): ``actor/`` (an actor
process, actor pools and child processes that always end), ``algos/`` (DQN, SAC, R2D2),
``learner/`` (one learner rank, ``loop.Learner``, and its parts: ingest and its log,
sync, checkpoints, metrics) and ``launch/`` (``launcher.train``: learner ranks spawned
or under torchrun). The modules at this level are shared by several of them; the
gymnasium adapters live in :mod:`shardreplay.gym`.
"""
