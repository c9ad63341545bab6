"""When to save: periodic, requested (agreed by all ranks), on SIGTERM, on a crash. How a
training loop uses a :class:`CheckpointTrigger`, and which rank saves under which id:
docs/semantics.md, "When to save".
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from shardreplay import _signals
from shardreplay.checkpoint.manifest import checkpoint_dir, is_complete
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import ConfigError

log = logging.getLogger(__name__)

REQUEST_FILE = "checkpoint.request"
REQUEST_SIGNALS = (signal.SIGUSR1,)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class CheckpointTrigger:
    """Decides at every training step whether this rank saves a checkpoint now (signal
    handlers only set flags: saves happen in the loop). ``run_dir``: the checkpoint root;
    ``interval_steps``: save every this many steps (None: only on request, stop or crash);
    ``collectives``: whom requests are agreed with, every ``poll_interval_steps`` steps (a
    ``ShardedReplayBuffer``'s group, a :class:`~shardreplay.distributed.group.Collectives`,
    or None: this process alone); the request file is ``checkpoint.request`` in
    ``request_dir`` (None: ``run_dir``).

    Raises:
        ConfigError: a non-positive interval, or ``collectives`` of another type.
    """

    def __init__(self, run_dir: str | Path, *, interval_steps: int | None = None,
                 collectives: Any = None, poll_interval_steps: int = 1,
                 request_dir: str | Path | None = None) -> None:
        for name, value in (("interval_steps", interval_steps), ("poll_interval_steps", poll_interval_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        comm = internals_of(collectives).collectives if isinstance(collectives, ShardedReplayBuffer) \
            else collectives
        if comm is not None and not isinstance(comm, Collectives):
            raise ConfigError("collectives must be a ShardedReplayBuffer, a Collectives or None, "
                              f"got {type(collectives).__name__}")
        self.run_dir = Path(run_dir)
        self._request_dir = self.run_dir if request_dir is None else Path(request_dir)
        self.interval_steps = interval_steps
        self.poll_interval_steps = poll_interval_steps
        self._comm: Collectives | None = comm
        self._request = threading.Event()
        self._stop = threading.Event()
        self._stop_saved = False
        self._interrupts = 0
        self._start_step: int | None = None
        self._periodic_from: int | None = None  # the step of the last periodic save, or the first
        self._repeat_interrupt = True
        self._restores: list[Callable[[], None]] = []  # newest last
        self.last_step: int | None = None
        self.reason = ""

    # -- flags (safe from signal handlers: no I/O, no collective) --------------------------
    def request_save(self) -> None:
        """Ask for a checkpoint at the next agreed step (what SIGUSR1 does)."""
        self._request.set()

    def request_stop(self) -> None:
        """Ask this rank to save its part at the next step and stop (what SIGTERM does)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        """True once a stop was asked for (SIGTERM, SIGINT or :meth:`request_stop`)."""
        return self._stop.is_set()

    @property
    def request_file(self) -> Path:
        """``<request_dir>/checkpoint.request``: create it to ask every rank for a checkpoint."""
        return self._request_dir / REQUEST_FILE

    def request_pending(self) -> bool:
        """Whether this rank was asked for a checkpoint (:meth:`request_save`, SIGUSR1 or
        the request file). It stays asked until :meth:`request_served`."""
        return self._request.is_set() or self.request_file.exists()

    def request_served(self, *, remove_file: bool = True) -> None:
        """The ranks agreed on a requested checkpoint: clear the flag and (``remove_file``)
        the request file, so that neither asks again.

        Raises:
            OSError: the request file exists but cannot be removed (a read-only folder).
        """
        self._request.clear()
        if remove_file:
            with contextlib.suppress(FileNotFoundError):
                self.request_file.unlink()

    def periodic_due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due at ``step``: a multiple of ``interval_steps``
        was passed since the last step this answered True for, or since the first step it
        was asked about (a restored loop does not save again where it starts). A loop that
        checks between batches of steps rarely sits exactly on a multiple."""
        step = int(step)
        if self._periodic_from is None:
            self._periodic_from = step
        interval = self.interval_steps
        if interval is None or step // interval <= self._periodic_from // interval:
            return False
        self._periodic_from = step
        return True

    # -- the decision ------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``; call it on every rank at every step.

        Sets :attr:`reason` (``"periodic"``, ``"request"`` or ``"stop"``) when True.

        Raises:
            CollectiveTimeout: a peer did not join the agreement in time (it may have
                died; a surrounding :meth:`save_on_exception` then saves this rank's part).
        """
        step = int(step)
        self.last_step = step
        if self._start_step is None:
            self._start_step = step
        if self._stop.is_set():
            if self._stop_saved:
                return False
            self._stop_saved = True
            self.reason = "stop"
            return True  # no collective: peers may be gone
        requested = self._agree_request(step)
        periodic = self.periodic_due(step)
        if not (requested or periodic):
            return False
        if is_complete(checkpoint_dir(self.run_dir, step), hashes=False):
            log.info("step %d: checkpoint already complete, not saved again", step)
            return False
        self.reason = "request" if requested else "periodic"
        return True

    def _agree_request(self, step: int) -> bool:
        if self._comm is not None and (step - (self._start_step or 0)) % self.poll_interval_steps:
            return False  # ranks poll at the same steps, so they still call collectives alike
        local = self.request_pending()
        if self._comm is None:
            agreed = local
        else:
            flags = self._comm.all_gather(np.array([int(local)], np.int64),
                                          "CheckpointTrigger.should_save(agree request)")
            agreed = bool(flags.max())
        if agreed:
            self.request_served()  # every rank tries: none can see it again next step
        return agreed

    def maybe_save(self, step: int, save: Callable[[int], object]) -> bool:
        """:meth:`should_save`, then ``save(step)`` when it says so; True when the loop must
        stop: a stop was requested and this rank's part is saved (a stop signal that lands
        after this call's decision is acted on at the next call)."""
        if self.should_save(step):
            log.info("step %d: saving checkpoint (%s)", step, self.reason)
            save(step)
        return self._stop_saved

    # -- signals ---------------------------------------------------------------------------------
    def install_signal_handlers(self, request_signals: tuple[int, ...] = REQUEST_SIGNALS,
                                stop_signals: tuple[int, ...] = STOP_SIGNALS, *,
                                repeat_interrupt: bool = True) -> None:
        """Route ``request_signals`` to :meth:`request_save` and ``stop_signals`` to
        :meth:`request_stop`. A second SIGINT raises ``KeyboardInterrupt`` unless
        ``repeat_interrupt`` is False (a loop that must finish its agreed stop and save,
        whatever else arrives, as the learner ranks of a run).

        Raises:
            ConfigError: not called from the main thread (Python's rule for handlers).
        """
        handlers = {**dict.fromkeys(request_signals, lambda *_: self._request.set()),
                    **dict.fromkeys(stop_signals, self._on_stop)}
        self._restores.append(_signals.install(handlers))
        self._repeat_interrupt = repeat_interrupt

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that :meth:`install_signal_handlers` replaced."""
        while self._restores:
            self._restores.pop()()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._repeat_interrupt:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        self._stop.set()

    # -- crashes ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def save_on_exception(self, save: Callable[[int], object]) -> Iterator[None]:
        """Save this rank's part (no collective) if an exception leaves the block.

        The checkpoint id is the step of the latest :meth:`should_save` call. Nothing is
        saved before the first call, when that checkpoint is already complete, or for
        ``SystemExit``. A failing save is logged; the original exception is re-raised.
        """
        try:
            yield
        except (Exception, KeyboardInterrupt) as exc:
            self._save_after_crash(save, exc)
            raise

    def _save_after_crash(self, save: Callable[[int], object], exc: BaseException) -> None:
        step = self.last_step
        if step is None:
            log.error("no step seen yet; nothing saved after %r", exc)
            return
        if is_complete(checkpoint_dir(self.run_dir, step), hashes=False):
            log.warning("checkpoint %d already complete; not saved again after %r", step, exc)
            return
        log.warning("saving this rank's part of checkpoint %d after %r", step, exc)
        try:
            save(step)
        except Exception:
            log.exception("saving after %r failed", exc)
