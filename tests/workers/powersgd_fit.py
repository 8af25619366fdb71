"""First runs `tfscale.collectives.powersgd.PowerSGD` alone, summing over
the real workers through the strategy's `collective_group`, on known
gradients (for the test's float64 NumPy reference); then trains a small
classifier with LARS three times: uncompressed, with PowerSGD, and with
PowerSGD interrupted and resumed from a backup.

Then once more with PowerSGD, 2 micro-batches per update and 2 steps per
execution. Each phase and training is its own tfscale.Strategy (every
worker builds them in the same order). Reports this worker's PowerSGD
outputs and error feedback after each step of the first phase and, per
training, the weights after every step and this worker's PowerSGD error
feedback at the end.

Flags: --backup_dir (shared by the workers), --steps, --start_step (both
phases), --stop_after (step at which the interrupted training raises).
"""

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
from report import report

flags.DEFINE_string("backup_dir", None, "BackupAndRestore directory.")
flags.DEFINE_integer("steps", 6, "Optimizer steps.")
flags.DEFINE_integer("start_step", 2, "powersgd_start_step.")
flags.DEFINE_integer("stop_after", 4, "Steps the interrupted training takes.")
FLAGS = flags.FLAGS

FEATURES = 12
CLASSES = 4
GLOBAL_BATCH = 16
RANK = 2
# First phase: gradients of these shapes (12x8 compressed; a vector; 6x3
# too small), drawn by np.random.default_rng(REFERENCE_SEED) with shape
# (workers, steps, total size), this worker's row; the test draws the same.
REFERENCE_SHAPES = [(4, 3, 8), (8,), (6, 3)]
REFERENCE_SEED = 1


class Interrupted(Exception):
    pass


class RecordWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = {}

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        self.steps[step] = [v.numpy().ravel().tolist()
                            for v in self.model.trainable_variables]


class StopAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.steps:
            raise Interrupted()


def dataset(num_workers, worker):
    """The same batches each time it is iterated; this worker's share."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(FLAGS.steps, GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(FLAGS.steps, GLOBAL_BATCH)).astype("int64")
    per_worker = GLOBAL_BATCH // num_workers
    share = slice(worker * per_worker, (worker + 1) * per_worker)
    return tf.data.Dataset.from_tensor_slices((x[:, share], y[:, share]))


def reference_steps():
    """PowerSGD on its own, summing each tensor over the real workers with
    `strategy.collective_group.all_reduce`: this worker's outputs and error
    feedback after each of `--steps` steps."""
    strategy = tfscale.Strategy(
        communication=tfscale.CommunicationOptions(timeout_seconds=120))
    group = strategy.collective_group
    compressor = tfscale.collectives.powersgd.PowerSGD(
        lambda tensors: [group.all_reduce(t) for t in tensors],
        strategy.num_workers, rank=RANK, start_step=FLAGS.start_step)
    variables = [tf.Variable(tf.zeros(s)) for s in REFERENCE_SHAPES]
    optimizer = object()  # only the key of this state
    with strategy.scope():
        state = compressor.state(optimizer, variables)

    def replica_fn(grads, step):
        return compressor.all_reduce(grads, optimizer, variables, step)

    step_fn = tf.function(
        lambda grads, step: strategy.run(replica_fn, args=(grads, step)))
    sizes = [int(np.prod(s)) for s in REFERENCE_SHAPES]
    draws = np.random.default_rng(REFERENCE_SEED).normal(
        size=(strategy.num_workers, FLAGS.steps, sum(sizes)))
    outputs, errors = [], []
    for step, flat in enumerate(draws[strategy.worker_index]):
        grads = [tf.constant(g.reshape(s), tf.float32) for g, s in
                 zip(np.split(flat, np.cumsum(sizes)[:-1]), REFERENCE_SHAPES)]
        out = step_fn(grads, tf.constant(step))
        out = [strategy.experimental_local_results(o)[0] for o in out]
        outputs.append([o.numpy().ravel().tolist() for o in out])
        errors.append(state.error[0].numpy().ravel().tolist())
    return {"shapes": [list(s) for s in REFERENCE_SHAPES],
            "compressed_shapes": [[m.rows, m.cols] for m in state.matrices],
            "outputs": outputs, "error": errors}


def train(powersgd, callbacks=(), seed=0, accumulation_steps=None,
          steps_per_execution=1):
    options = dict(timeout_seconds=120)
    if powersgd:
        options.update(compression="powersgd", powersgd=tfscale.PowerSGDOptions(
            rank=RANK, start_step=FLAGS.start_step))
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(**options))
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),  # 12 x 32: compressed
            keras.layers.Dense(CLASSES),  # 32 x 4: too small, uncompressed
        ])
        model.compile(
            optimizer=tfscale.optimizers.LARS(
                learning_rate=5.0, momentum=0.9,
                gradient_accumulation_steps=accumulation_steps),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution)
    data = strategy.distribute_datasets_from_function(
        lambda context: dataset(strategy.num_workers, strategy.worker_index))
    record = RecordWeights()
    try:
        model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0,
                  callbacks=[*callbacks, record])
    except Interrupted:
        pass
    result = {"steps": record.steps}
    state = strategy.worker_state(model)
    if state is not None:
        result["error"] = [e.numpy().ravel().tolist() for e in state.error]
        result["compressed_shapes"] = [list(m.shape) for m in state.matrices]
    return result


def main(argv):
    results = {"reference": reference_steps()}
    results["uncompressed"] = train(powersgd=False)
    results["powersgd"] = train(powersgd=True)
    backup = lambda: tfscale.callbacks.BackupAndRestore(FLAGS.backup_dir, save_freq=1)
    results["interrupted"] = train(
        powersgd=True, callbacks=[backup(), StopAfter(FLAGS.stop_after)])
    # Other initial weights: the backup must bring back the trained ones.
    results["resumed"] = train(powersgd=True, callbacks=[backup()], seed=1)
    # Both of Keras's loops around the step: micro-batches, and several
    # steps per call (a tf.while_loop).
    results["accumulated"] = train(powersgd=True, accumulation_steps=2,
                                   steps_per_execution=2)
    results["accumulated_uncompressed"] = train(
        powersgd=False, accumulation_steps=2, steps_per_execution=2)
    report(results)


if __name__ == "__main__":
    app.run(main)
