"""Workers with unequal data: each worker's share of a step is the examples
it really holds.

The workers' parts of a global batch differ in size when the batch does not
divide among them (32 on 3 workers: tf.distribute gives 11, 11 and 10), when
it is the partial last batch, or when a worker has run out of data
(tf.distribute then hands it an empty batch, so that it still joins every
collective, as Horovod's `hvd.join` and PyTorch's `Join` make a finished rank
do). Keras assumes equal parts: it scales each worker's loss by
`1 / num_workers` before the gradients are summed
(`keras.src.losses.loss.scale_loss_for_distribution`), which averages the
workers' means instead of the examples.

Under `tfscale.Strategy`, every `strategy.run` with a batch (Keras's train,
test and predict steps, and custom training loops) counts this worker's
examples, `n_w`: the leading dimension of its first tensor argument, as Keras
counts a batch for its loss metric. The first Keras loss of the step sums the
counts over the workers once (`n`, one scalar all-reduce), and Keras's
`1 / num_workers` becomes `n_w / n`:

- a mean loss (`"sum_over_batch_size"`, Keras's default) is this worker's sum
  of per-example losses divided by `n`, so the summed gradient is the gradient
  of the mean over the `n` examples that took part, as on one worker over the
  same global batch;
- losses added by layers (`model.losses`, e.g. weight regularizers), equal on
  every worker, are weighted `n_w / n`, which adds up to one copy of them;
- Keras's loss metric weights each worker's mean by `n_w`, so the reported
  loss is the mean over all examples.

Losses Keras does not scale (`reduction="sum"`) and losses a custom loop
scales itself (`tf.nn.compute_average_loss(..., global_batch_size=...)`) are
left as they are.

A worker without examples: TensorFlow's oneDNN kernels, the default on x86
CPUs, cannot run convolutions or BatchNormalization on an empty batch (wrong
shapes, or a crash, in the forward or the backward pass). So Keras's steps
give such a worker one row of zeros instead: its loss share is 0 (so are its
gradients), its metrics (the loss metric included) are set back to what they
were before the step, and `predict` drops its output row. Only
BatchNormalization's moving statistics on that worker see the row. A custom
training loop's step is not Keras's, so its batch is not padded: on CPU, a
step where some worker's batch is empty stops every worker with one line that
says so (give every worker the same number of batches, e.g.
`Dataset.repeat()` and a fixed number of steps).

Workers whose own pipelines (`distribute_datasets_from_function`) hold
different numbers of batches agree on the longest (`agreed_cardinality`), so
that Keras runs as many steps on each and those that run out first get empty
batches until the last one is done.
"""

import contextlib
import functools
import threading

import numpy as np

import tensorflow as tf

# The Keras steps whose batches are padded (see the module docstring).
KERAS_STEPS = ("train", "test", "predict")

_local = threading.local()


class _StepExamples:
    """The examples of this worker's batch in the `strategy.run` under way."""

    def __init__(self, count, note=None, preemption=None):
        self.count = count  # float32 scalar tensor
        self._note = note
        self._preemption = preemption
        # graph -> (examples, workers without any[, workers with a SIGTERM])
        # summed over all workers
        self._sums = {}

    def _sum(self):
        # One all-reduce per graph that asks: the step's, or a control-flow
        # branch of it (a tensor cannot leave its branch).
        graph = tf.compat.v1.get_default_graph()
        if graph not in self._sums:
            mine = [self.count, tf.cast(self.count == 0, tf.float32)]
            if self._preemption:  # a third number: has this worker a SIGTERM?
                mine.append(self._preemption.local_request())
            with (self._note(purpose="examples per worker") if self._note
                  else contextlib.nullcontext()):
                summed = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, tf.stack(mine))
            if self._preemption:
                self._preemption.record_agreed(summed[2])
            self._sums[graph] = summed
        return self._sums[graph]

    def total(self):
        """The step's examples on all workers."""
        return self._sum()[0]

    def workers_without_examples(self):
        return self._sum()[1]


def _stack():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _current():
    stack = _stack()
    if not stack or tf.distribute.in_cross_replica_context():
        return None
    return stack[-1]


def local_example_count(args, kwargs=None):
    """The leading dimension of the first tensor of rank >= 1 in `args` and
    `kwargs` (float32), or None when there is none."""
    for value in tf.nest.flatten((args, kwargs or {})):
        if isinstance(value, tf.Tensor) and value.shape.rank:
            return tf.cast(tf.shape(value)[0], tf.float32)
    return None


def counting_examples(fn, keras_step=None, model=None, on_cpu=True, note=None,
                      preemption=None):
    """`fn` (a replica function), counting its batch's examples while it runs.

    Args:
        fn: the function given to `strategy.run`.
        keras_step: `"train"`, `"test"` or `"predict"` when `fn` is that step
            of Keras's `fit`, `evaluate` or `predict` (an empty batch is then
            padded with a row that counts for nothing); `None` for any other
            function.
        model: the Keras model whose step `fn` is (train and test steps).
        on_cpu: whether this worker computes on a CPU, where a custom loop's
            step with an empty batch on some worker is refused.
        note: `None`, or `fn(**fields)` returning a context manager inside
            which the step's collectives are traced
            (`FlightRecorder.context`): told the step (the optimizer's
            `iterations` of a train step) and what runs, and the step's
            span of the timeline.
        preemption: `None`, or the `tfscale.preemption.PreemptionWatch` whose
            request the step's all-reduce carries (train steps and custom
            loops always issue that all-reduce then, even without a loss
            Keras scales).
    """
    if keras_step not in (None, *KERAS_STEPS):
        raise ValueError(f"Argument `keras_step` must be None or one of "
                         f"{KERAS_STEPS}. Received: keras_step={keras_step!r}")

    @functools.wraps(fn)
    def replica_fn(*args, **kwargs):
        count = local_example_count(args, kwargs)
        if count is None:
            return fn(*args, **kwargs)
        step = _StepExamples(count, note, preemption)
        if keras_step is None and on_cpu:
            args, kwargs = _refuse_empty_batches(step, args, kwargs)
        elif keras_step is not None:
            # One row of zeros where there is none (see the module docstring).
            rows = tf.cast(count == 0, tf.int32)
            args = tf.nest.map_structure(lambda t: _padded(t, rows), args)
        if keras_step in ("train", "test"):
            metrics = [v for metric in model.metrics for v in metric.variables]
            before = [tf.identity(v.value) for v in metrics]
        stack = _stack()
        stack.append(step)
        optimizer = getattr(model, "optimizer", None)
        described = dict(purpose=f"Keras {keras_step} step" if keras_step
                         else "strategy.run")
        # The step's span of the timeline, if it is on (`FlightRecorder.context`).
        described.update(span=f"{keras_step} step" if keras_step else "strategy.run",
                         lane="step", after=(args, kwargs))
        if keras_step == "train" and optimizer is not None:
            described["step"] = optimizer.iterations
        try:
            with note(**described) if note else contextlib.nullcontext():
                outputs = fn(*args, **kwargs)
        finally:
            stack.pop()
        if preemption and keras_step in (None, "train"):
            step.total()  # the step's all-reduce, if no loss has issued it
        if keras_step in ("train", "test"):
            for variable, value in zip(metrics, before):
                variable.assign(tf.where(count == 0, value, variable.value))
            results = model.get_metrics_result()
            if isinstance(outputs, dict) and outputs.keys() == results.keys():
                outputs = results  # as Keras's step returns them, restored
        elif keras_step == "predict":  # drop a padding row
            rows = tf.cast(count, tf.int32)
            outputs = tf.nest.map_structure(lambda t: t[:rows], outputs)
        return outputs

    return replica_fn


def _padded(tensor, rows):
    """`tensor` with `rows` rows of zeros appended (dense tensors only)."""
    if not isinstance(tensor, tf.Tensor) or not tensor.shape.rank:
        return tensor
    shape = tf.concat([[rows], tf.shape(tensor)[1:]], axis=0)
    return tf.concat([tensor, tf.zeros(shape, tensor.dtype)], axis=0)


def _refuse_empty_batches(step, args, kwargs):
    """`(args, kwargs)`, which every worker may only use once no worker's
    batch is empty; all workers stop at the same step if one is."""
    empty = step.workers_without_examples()
    workers = tf.distribute.get_replica_context().num_replicas_in_sync
    message = tf.strings.format(
        "tfscale: this step of a custom training loop has {} example(s) "
        "for %d workers, and {} worker(s) get none (this worker "
        "holds {}); a model cannot run on an empty batch on CPU (TensorFlow's "
        "oneDNN convolutions and BatchNormalization fail). Give every worker "
        "the same number of batches (e.g. Dataset.repeat() and a fixed number "
        "of steps), or train with Keras's fit, which pads such a batch." % workers,
        [tf.cast(step.total(), tf.int32), tf.cast(empty, tf.int32),
         tf.cast(step.count, tf.int32)])
    check = tf.debugging.Assert(empty == 0, [message])
    with tf.control_dependencies([check]):
        return tf.nest.map_structure(
            lambda v: tf.identity(v) if isinstance(v, tf.Tensor) else v,
            (args, kwargs))


def scale_loss(value, keras_scale):
    """Keras's `scale_loss_for_distribution`: `value * n_w / n` inside a
    counted replica function (`counting_examples`), else
    `keras_scale(value)`."""
    step = _current()
    if step is None:
        return keras_scale(value)
    share = tf.math.divide_no_nan(step.count, step.total())
    return value * tf.cast(share, value.dtype)


def unscale_loss(value, keras_unscale):
    """Keras's `unscale_loss_for_distribution`, the inverse of `scale_loss`:
    `value * n / n_w` (0 where this worker has no examples)."""
    step = _current()
    if step is None:
        return keras_unscale(value)
    inverse = tf.math.divide_no_nan(step.total(), step.count)
    return value * tf.cast(inverse, value.dtype)


def agreed_cardinality(cardinalities):
    """The number of global batches of workers whose own pipelines hold
    `cardinalities` batches (tf.data's values: >= 0, or `INFINITE`,
    `UNKNOWN`), or None when they are all the same.

    The longest, when all are finite; `UNKNOWN` when any is unknown, or some
    are infinite and others not (Keras then iterates until every worker has
    run out).
    """
    cardinalities = [int(c) for c in np.ravel(cardinalities)]
    if len(set(cardinalities)) == 1:
        return None
    if all(c >= 0 for c in cardinalities):
        return max(cardinalities)
    return int(tf.data.UNKNOWN_CARDINALITY)
