"""Imported once by the learners' fork server (:func:`~shardreplay.runtime.forkserver.preloaded_context`):
what every learner imports, so that each forked learner starts with it.

Two things make that cheaper than importing the same modules in a plain process:

- Python's cyclic garbage collector is paused while importing: the imports create many
  long-lived objects and no garbage, so every collection they would trigger is work
  wasted walking them.
- Afterwards every object imported is frozen (:func:`gc.freeze`): the forked learners'
  collections skip them, and do not touch (copy) the pages they share with the server.

torch._dynamo is imported with the rest: DDP's constructor and ``torch.optim``'s
optimizers import it, so a learner imports it anyway, also a single one.
"""

from __future__ import annotations

import importlib

from shardreplay.runtime.forkserver import collector_paused, mark_ready

MODULES = ("torch", "torch.distributed", "torch._dynamo", "shardreplay.runtime.learner.loop",
           "shardreplay.kernels.keys", "shardreplay.kernels.ready")


def import_paused(names: tuple[str, ...]) -> None:
    """Import ``names`` with the cyclic garbage collector paused, then freeze every object
    alive (:func:`~shardreplay.runtime.forkserver.collector_paused`). Raises what an import
    raises (the collector is back on)."""
    with collector_paused():
        for name in names:
            importlib.import_module(name)


try:
    import_paused(MODULES)
finally:
    # The launcher waits for this with its stop signals free to run (forkserver.start_server);
    # also after a failed import, which the server ignores (ImportError) or dies of.
    mark_ready()
