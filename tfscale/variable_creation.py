"""Every worker creates each variable together: a worker whose model
differs is told which variable, instead of failing or hanging in
TensorFlow's broadcasts.

MultiWorkerMirroredStrategy gives each new variable the chief's initial
value: the chief broadcasts it and every other worker receives it, one
collective per variable, in the order the variables are created
(tensorflow/python/distribute/collective_all_reduce_strategy.py,
`_get_variable_creator_initial_value`). A worker that built another model
brings another shape to one of those broadcasts (TensorFlow's error names
a collective instance number and two shapes), or waits for a broadcast the
chief never sends because it creates more variables, or others; those
broadcasts take no timeout, so it would wait forever. `CreationWatch`, a
variable creator inside the strategy's scope, counts this worker's
variables, names the one whose creation failed, and bounds the wait by the
collective timeout.
"""

import json
import sys
import threading

import tensorflow as tf

from tfscale import flight_report
from tfscale.agreement import WorkersDisagreeError

SAME_MODEL = ("Every worker must build the same model under the strategy's scope: "
              "the same layers, with the same shapes, created in the same order.")


class CreationWatch:
    """A variable creator (`tf.variable_creator_scope`) for one strategy.

    Args:
        worker: this worker's rank.
        num_workers: workers in the job (one creates nothing together).
        timeout_seconds: how long one variable's creation may wait for the
            chief's broadcast; None: forever.
        abort: `fn(message)` that fails this worker's pending collectives
            (`tf_collectives.abort_collectives`).
    """

    def __init__(self, worker, num_workers, timeout_seconds, abort):
        self.worker = worker
        self.num_workers = num_workers
        self.timeout_seconds = timeout_seconds
        self._abort = abort
        self.created = 0  # variables this worker created under the strategy
        self._timed_out = None

    def __call__(self, next_creator, **kwargs):
        if self.num_workers < 2:
            return next_creator(**kwargs)
        self.created += 1
        what = f"variable {self.created} ('{kwargs.get('name') or 'unnamed'}')"
        timer = None
        if self.timeout_seconds is not None:
            timer = threading.Timer(self.timeout_seconds, self._time_out, args=(what,))
            timer.daemon = True
            timer.start()
        try:
            return next_creator(**kwargs)
        except tf.errors.OpError as error:
            raise WorkersDisagreeError(self._explain(what, error)) from None
        finally:
            if timer is not None:
                timer.cancel()

    def _explain(self, what, error):
        if self._timed_out:
            return self._timed_out
        mismatch = flight_report.peer_mismatch(str(error))
        cause = mismatch or (f"TensorFlow: {type(error).__name__}: "
                             f"{str(error).strip().splitlines()[0]}")
        return (f"Worker {self.worker} could not create its {what} together with "
                f"the other workers ({cause}). {SAME_MODEL}")

    def _time_out(self, what):
        self._timed_out = (
            f"Worker {self.worker} waited {self.timeout_seconds:g} s to create its "
            f"{what}, whose initial value the chief sends to every worker: a worker "
            f"built a model with other variables (more, fewer, or in another "
            f"order), or the chief is stuck. {SAME_MODEL}")
        print(f"tfscale: {self._timed_out}", file=sys.stderr, flush=True)
        position = {"worker": self.worker, "completed": None, "pending": {
            "purpose": f"creating {what}", "op": "broadcast_recv"}}
        print(flight_report.LINE_PREFIX + json.dumps(position), file=sys.stderr, flush=True)
        self._abort(self._timed_out)
