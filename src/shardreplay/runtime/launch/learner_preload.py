"""Imported once by the learners' fork server (:func:`~shardreplay.runtime.forkserver.preloaded_context`):
what every learner imports, with the garbage collector paused and everything frozen after
(:func:`~shardreplay.runtime.forkserver.collector_paused`), so that each forked learner
starts with it. torch._dynamo is among them: DDP and ``torch.optim`` import it anyway.
"""

from __future__ import annotations

import importlib

from shardreplay.runtime.forkserver import collector_paused, mark_ready

MODULES = ("torch", "torch.distributed", "torch._dynamo", "shardreplay.runtime.learner.loop",
           "shardreplay.kernels.keys", "shardreplay.kernels.ready")


def import_paused(names: tuple[str, ...]) -> None:
    """Import ``names`` inside :func:`~shardreplay.runtime.forkserver.collector_paused`.
    Raises what an import raises (the collector is back on)."""
    with collector_paused():
        for name in names:
            importlib.import_module(name)


try:
    import_paused(MODULES)
finally:
    # The launcher waits for this with its stop signals free to run (forkserver.start_server);
    # also after a failed import, which the server ignores (ImportError) or dies of.
    mark_ready()
