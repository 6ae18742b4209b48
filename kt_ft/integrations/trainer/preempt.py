"""Preemption: SIGTERM or SIGINT during training ends the run with a complete checkpoint.

Slurm's time limit, a spot instance's notice and Ctrl-C send SIGTERM or SIGINT; without a handler
the process dies and every step since the last ``save_steps`` checkpoint is lost. ``Preemption``
(installed by ``KTCallback`` for the training loop of a kt-ft run, main thread only) turns the
first signal into a request: the optimizer step under way finishes, the Trainer saves a checkpoint
(the manifest last, as every kt-ft checkpoint: ``callback.py``), and the process exits with
128 + the signal's number and a line naming that checkpoint. Resuming from it is an ordinary
resume (``resume_from_checkpoint``, or the same command with ``overwrite_output_dir: false``).

A second signal exits at once (``os._exit``): a save cut short has no manifest, so every kt-ft
loader refuses it and the previous complete checkpoint is the one a resume takes.
"""

from __future__ import annotations

import os
import signal
import threading

from kt_ft.base.log import get_logger

logger = get_logger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """The signal handlers of one training loop; ``requested`` is the first signal's number (0: none)."""

    def __init__(self) -> None:
        self.requested = 0
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        """Install the handlers (False where this is not the main thread: Python allows it there only)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            logger.warning(
                f"second signal ({name}): exiting now; the last complete checkpoint stays as it was"
            )
            os._exit(128 + signum)
        self.requested = signum
        logger.warning(
            f"received {name}: finishing this optimizer step, then saving a checkpoint and exiting "
            "(send it again to exit at once)"
        )

    def exit_code(self) -> int:
        return 128 + self.requested
