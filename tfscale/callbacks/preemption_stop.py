"""How the saving callbacks stop on preemption: save the agreed step, then
raise `tfscale.preemption.Preempted` on every worker."""

from absl import logging

from tfscale import agreement
from tfscale import checkpoint
from tfscale import preemption


class PreemptionStop:
    """Stops a fit after the step every worker agreed on (`tfscale.preemption`).

    The callback that owns it calls `begin` in `on_train_begin` (SIGTERM is
    taken over from there), `before_batch` and `after_batch` around each
    batch, and `at_end` in `on_train_end` after its own last save (SIGTERM
    is given back there, unless preempted: the process is leaving then).

    Args:
        model: the model being fit.
        save: a function that saves the current step (every worker calls it;
            a step already saved is skipped).
    """

    def __init__(self, model, save):
        self.model = model
        self.strategy = model.distribute_strategy
        self.watch = preemption.watch_of(self.strategy)
        self.save = save
        self._barrier = None

    def begin(self):
        self.watch.install()

    def before_batch(self):
        self.watch.before_step()

    def after_batch(self):
        self.watch.last_step = checkpoint.step(self.model)
        workers = self.watch.agreed_workers()
        if workers:
            self._stop(workers)

    def at_end(self, save=None):
        """Requests that came in the last step or after it, agreed now;
        `save`: how to save the fit's end, if not `self.save`."""
        workers = self.watch.agree_now(self.strategy)
        if workers:
            self._stop(workers, save or self.save)
        self.watch.uninstall()

    def _stop(self, workers, save=None):
        (save or self.save)()
        if self.watch.num_workers > 1:
            # No worker leaves before the chief has written: a launcher stops
            # the others once one exits.
            if self._barrier is None:
                self._barrier = agreement.barrier(self.strategy)
            self._barrier()
        stopped = preemption.Preempted(checkpoint.step(self.model), workers)
        logging.warning("tfscale: %s.", stopped)
        self.watch.reset()
        raise stopped
