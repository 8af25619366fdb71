"""Preemption: a SIGTERM to any worker, and every worker saves the same step.

Kubernetes evicting a pod, `docker stop`, SLURM's preemption and spot
instances send SIGTERM, then SIGKILL once a grace period is over (30 s by
default on Kubernetes). The worker that gets it must not simply stop: its
peers would lose contact and the steps since the last checkpoint would be
lost. Nor may it save alone: a checkpoint is of one step of every worker.
As TensorFlow's `tf.distribute.experimental.PreemptionCheckpointHandler`
does, the workers agree on one step, each saves it, and all exit with one
code that says "preempted, relaunch me".

How they agree here costs no collective of its own: each step of
`tfscale.Strategy` already sums every worker's example count once
(`tfscale.uneven_data`); that all-reduce carries one more number, whether
this worker has had a SIGTERM. Every worker so learns in the same step that
some worker asked, and the saving callbacks
(`tfscale.callbacks.TrainingCheckpoint`, `BackupAndRestore`) save after that
step and raise `Preempted`. A worker whose SIGTERM came while a step ran
says so in the next step's all-reduce, so the step saved is at most one or
two after the signal, and nothing trained is lost.

The exit code, 143, is what a shell reports for a process ended by SIGTERM
(128 + 15); Kubeflow's training operator with `restartPolicy: ExitCode`
restarts the pods of codes 128-255 and fails the job on 1-127
(kubeflow/training-operator, `pkg/util/train`, `IsRetryableExitCode`), and
`tfscale-launch --max_restarts` relaunches it as a preemption, never
dropping the worker's slot for it. (TensorFlow's handler exits with 42
unless given another `exit_fn`.)
"""

import os
import signal
import threading

import numpy as np
import tensorflow as tf

from tfscale import agreement

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
_NOT_INSTALLED = object()


class Preempted(SystemExit):
    """Every worker saved `step` after a SIGTERM and exits with code 143.

    A `SystemExit`, so that a training script that does not catch it ends
    with that code (its `finally` blocks run); catch it to do more first.

    Attributes:
        step: the step saved, the one a relaunch resumes from.
        workers: how many workers had a SIGTERM.
    """

    def __init__(self, step, workers):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.workers = workers

    def __str__(self):
        return (f"preempted: {self.workers} worker(s) had a SIGTERM; every "
                f"worker saved step {self.step} and exits with code "
                f"{PREEMPTED_EXIT_CODE}; a relaunch resumes from step {self.step}")


class PreemptionWatch:
    """One worker's view of preemption: its own SIGTERM, and what all
    workers agreed on.

    `install()` (from the main thread; the saving callbacks do, for each
    fit) takes over SIGTERM; until `uninstall()`, a SIGTERM is logged at
    once and raises this worker's request. The step
    function carries `local_request()` in its all-reduce of example counts
    and records the sum with `record_agreed(total)`; between steps
    `agreed_workers()` says how many workers have asked, the same number on
    every worker after the same step.

    Args:
        worker_index: this worker's index, for the log line.
        num_workers: workers in the job; with one, no step carries the
            request and `agreed_workers` reads it directly.
    """

    def __init__(self, worker_index=0, num_workers=1):
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.last_step = None  # the last step finished, for the log line
        self._signalled = threading.Event()
        self._previous = _NOT_INSTALLED  # else SIGTERM's handler before `install`
        with tf.init_scope():
            self._requested = tf.Variable(0.0, trainable=False,
                                          name="tfscale_preemption_requested")
            self._agreed = tf.Variable(0.0, trainable=False,
                                       name="tfscale_preemption_agreed")

    @property
    def signalled(self):
        """Whether this worker has had a SIGTERM since `install`."""
        return self._signalled.is_set()

    def install(self):
        """Takes over SIGTERM until `uninstall` (a no-op outside the main
        thread, where Python cannot set handlers, and when installed)."""
        if self._previous is not _NOT_INSTALLED or (
                threading.current_thread() is not threading.main_thread()):
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self):
        """Gives SIGTERM back to its handler before `install` (one set
        outside Python, such as TensorFlow's preemption notifier, cannot be
        put back: SIGTERM then ends the process, its default)."""
        if self._previous is _NOT_INSTALLED:
            return
        previous, self._previous = self._previous, _NOT_INSTALLED
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous if previous is not None
                          else signal.SIG_DFL)

    def _on_sigterm(self, signum, frame):
        again = self.signalled
        self._signalled.set()
        at = "" if self.last_step is None else f" after step {self.last_step}"
        message = (
            f"tfscale: worker {self.worker_index} got SIGTERM{at}"
            + (" again; already stopping" if again else
               f": every worker saves a checkpoint after the next step and exits "
               f"with code {PREEMPTED_EXIT_CODE} (preempted)") + "\n")
        # os.write: a print here could re-enter a print the signal interrupted.
        os.write(2, message.encode())

    def before_step(self):
        """Puts this worker's request where the next step reads it."""
        if self.signalled and not self._requested.numpy():
            self._requested.assign(1.0)

    def local_request(self):
        """In a step: 1.0 if this worker asks to stop, else 0.0."""
        return self._requested.read_value()

    def record_agreed(self, total):
        """In a step: records `total`, the requests summed over the workers."""
        return self._agreed.assign(tf.maximum(self._agreed, total))

    def agreed_workers(self):
        """Workers that asked, as the last step's all-reduce summed them (0:
        go on); with one worker, its own request."""
        if self.num_workers == 1:
            return int(self.signalled)
        return int(self._agreed.numpy())

    def reset(self):
        """Forgets the requests, once acted on (a process that catches
        `Preempted` and fits again starts clean)."""
        self._signalled.clear()
        self._requested.assign(0.0)
        self._agreed.assign(0.0)

    def agree_now(self, strategy):
        """Workers that asked, agreed by one all-gather now (every worker must
        call it at the same point): for the end of a fit, after which no step
        carries the requests."""
        if self.num_workers == 1:
            return int(self.signalled)
        everyone = agreement.gather(strategy, np.array([float(self.signalled)], np.float32))
        return max(int(everyone.sum()), self.agreed_workers())


_fallback = None


def watch_of(strategy):
    """The `PreemptionWatch` of `strategy` (`tfscale.Strategy.preemption`),
    or, under another strategy (one process), this process's own."""
    watch = getattr(strategy, "preemption", None)
    if isinstance(watch, PreemptionWatch):
        return watch
    global _fallback
    if _fallback is None:
        _fallback = PreemptionWatch()
    return _fallback
