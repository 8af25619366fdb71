"""The evaluator role: evaluates each checkpoint training writes, as it comes.

TensorFlow's cluster roles include an `evaluator` task (Kubeflow TFJob's
Evaluator replica): it is not part of the training cluster (no training
server, not counted among the workers) and evaluates the checkpoints the
training job writes. `CheckpointEvaluator` is that task's loop for the
checkpoints of `tfscale.checkpoint` (`tfscale.callbacks.TrainingCheckpoint`,
tfscale-train's `--model_dir`):

```python
model = ...  # built and compiled as in training, with its metrics
evaluator = tfscale.evaluator.CheckpointEvaluator(
    model, eval_dataset, "/shared/model_dir", final_step=epochs * steps_per_epoch,
    tensorboard_dir="/shared/tensorboard")
for step, metrics in evaluator.evaluations():
    print(step, metrics)  # logged, and written to TensorBoard, already
```

It follows TensorFlow's `tf.train.checkpoints_iterator` (poll a directory,
yield each newer checkpoint, skip ones superseded meanwhile, give up after a
timeout) and Keras 2's `tf.keras.utils.SidecarEvaluator` (restore each new
checkpoint into a compiled model, `model.evaluate`, stop after the last
checkpoint of training). tfscale's checkpoints are found through
`state.json`, not TensorFlow's `checkpoint` file.
"""

import os
import time

import tensorflow as tf
from absl import logging

from tfscale import checkpoint

EVAL_SUBDIR = "eval"  # TensorBoard run of the evaluation scalars


class NoNewCheckpointError(TimeoutError):
    """No new checkpoint appeared within the evaluator's timeout."""


def is_evaluator_task(cluster_resolver=None):
    """Whether this process is an `evaluator` task of its cluster.

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`;
            defaults to TF_CONFIG's.
    """
    if cluster_resolver is None:
        cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return cluster_resolver.task_type == "evaluator"


def new_checkpoints(directory, *, poll_seconds=1.0, timeout_seconds=None,
                    log_seconds=60.0):
    """Yields `(step, prefix)` of each checkpoint newer than the last yielded.

    Polls `tfscale.checkpoint.latest(directory)` every `poll_seconds` (the
    directory need not exist yet). Checkpoints written while the caller was
    busy with the previous one are skipped for the newest, as
    `tf.train.checkpoints_iterator` does. While waiting it logs "Waiting for
    a new checkpoint in DIR" every `log_seconds`. The wait is `time.sleep`,
    so Ctrl-C (KeyboardInterrupt) and SIGTERM stop it at once.

    Raises:
        NoNewCheckpointError: no newer checkpoint for `timeout_seconds`
            (`None`: wait forever), counted from each request for the next.
    """
    last_step = None
    while True:
        started = time.monotonic()
        next_log = started + log_seconds
        while True:
            step, prefix = checkpoint.latest(directory)
            if prefix is not None and (last_step is None or step > last_step):
                break
            now = time.monotonic()
            if timeout_seconds is not None and now - started >= timeout_seconds:
                newest = ("none has been written yet" if last_step is None
                          else f"the newest is still step {last_step}")
                raise NoNewCheckpointError(
                    f"No new checkpoint in {directory} for {timeout_seconds:g} "
                    f"s ({newest}): training has stopped, or writes "
                    "checkpoints further apart than the timeout.")
            if now >= next_log:
                logging.info("Waiting for a new checkpoint in %s (%s).", directory,
                             "none yet" if last_step is None
                             else f"newest: step {last_step}")
                next_log = now + log_seconds
            time.sleep(poll_seconds)
        last_step = step
        yield step, prefix


class CheckpointEvaluator:
    """Evaluates each new checkpoint in `directory` until the last one.

    For each checkpoint `tfscale.checkpoint.save` writes (the newest when
    several appeared since the previous evaluation), restores the model's
    variables (`tfscale.checkpoint.restore_model`: weights and BatchNorm
    statistics), runs `model.evaluate(data)`, logs the metrics and, with
    `tensorboard_dir`, writes each as a scalar at the checkpoint's step
    under `tensorboard_dir/eval`. Training keeps only the newest checkpoints:
    one pruned before it could be read is skipped for the newer one.

    Args:
        model: a compiled Keras model of the architecture training
            checkpoints (with the metrics to report); no strategy needed.
        data: what `model.evaluate` takes as `x`, e.g. a finite
            `tf.data.Dataset` of `(inputs, labels)` batches.
        directory: the training job's checkpoint directory.
        final_step: the step of training's last checkpoint (epochs x steps
            per epoch): evaluating it ends the loop. `None`: never ends
            (until the timeout).
        steps: batches per evaluation (`None`: all of `data`).
        tensorboard_dir: where to write the scalars (`None`: nowhere).
        poll_seconds, timeout_seconds, log_seconds: see `new_checkpoints`.
        before_restore: `None`, or a function called with `(step, prefix)`
            before each checkpoint is read (it may raise to stop, e.g. on
            checkpoints trained with other settings).
    """

    def __init__(self, model, data, directory, final_step=None, *, steps=None,
                 tensorboard_dir=None, poll_seconds=1.0, timeout_seconds=3600.0,
                 log_seconds=60.0, before_restore=None):
        self.model = model
        self.data = data
        self.directory = directory
        self.final_step = final_step
        self.steps = steps
        self.tensorboard_dir = tensorboard_dir
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        self.log_seconds = log_seconds
        self.before_restore = before_restore
        self._writer = None

    def evaluations(self):
        """Yields `(step, metrics)` per checkpoint evaluated; ends after
        `final_step`'s.

        Raises:
            NoNewCheckpointError: see `new_checkpoints`.
        """
        for step, prefix in new_checkpoints(
                self.directory, poll_seconds=self.poll_seconds,
                timeout_seconds=self.timeout_seconds,
                log_seconds=self.log_seconds):
            if self.before_restore is not None:
                self.before_restore(step, prefix)
            try:
                checkpoint.restore_model(self.model, prefix)
            except (tf.errors.NotFoundError, tf.errors.DataLossError):
                if os.path.exists(os.path.dirname(prefix)):
                    raise
                # Pruned after a newer one was written: take that one.
                logging.info("The checkpoint of step %d was replaced before it "
                             "could be read; evaluating the newest.", step)
                continue
            metrics = self.model.evaluate(self.data, steps=self.steps,
                                          return_dict=True, verbose=0)
            metrics = {name: float(value) for name, value in metrics.items()}
            self._log(step, metrics)
            yield step, metrics
            if self.final_step is not None and step >= self.final_step:
                logging.info("Evaluated training's last checkpoint (step %d); "
                             "the evaluator stops.", step)
                return

    def run(self):
        """Runs `evaluations` to the end; returns the last `(step, metrics)`
        (`None` if nothing was evaluated)."""
        last = None
        for last in self.evaluations():
            pass
        return last

    def _log(self, step, metrics):
        of = f" of {self.final_step}" if self.final_step is not None else ""
        logging.info("Evaluation of the checkpoint of step %d%s: %s", step, of,
                     ", ".join(f"{name}={value:.4f}"
                               for name, value in sorted(metrics.items())))
        if self.tensorboard_dir is None:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.tensorboard_dir, EVAL_SUBDIR))
        with self._writer.as_default(step=step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        self._writer.flush()
