"""The training runtime built on the library: a DQN learner, its actors and the launcher.

Three rooms, each importing only the ones before it (and the shared modules):

- ``actor/``: an actor process (``loop``: step a vector env, ship chunks), its settings,
  the chunker, and ``processes`` (actor pools and child processes that always end).
- ``learner/``: one learner rank (``loop.Learner``) and its parts: ingest and its log,
  stored ids, the DQN, evaluation, metrics, the per-iteration sync, reports, resume.
- ``launch/``: ``launcher.train``, which starts learner ranks (spawned or under torchrun).

Shared small modules stay at this level because more than one room uses them:
``settings`` (TrainSettings), ``routing`` (shard transports), ``stream_layout``,
``run_identity``, ``envs`` and ``log_lines``.
The gymnasium adapters are not part of the runtime: they live in :mod:`shardreplay.gym`.
"""
