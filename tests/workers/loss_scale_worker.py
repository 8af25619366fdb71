"""Trains under mixed_float16 with an inf in worker 1's data at one step.

Flags: --loss_scale=tfscale|stock|compile (SGD wrapped by the worker in
tfscale.optimizers.LossScaleOptimizer or keras.optimizers.LossScaleOptimizer,
or, as Keras's mixed-precision guide teaches, plain SGD that `compile` wraps
itself), --strategy=tfscale|stock (tfscale.Strategy or
tfscale.strategy.KerasMultiWorkerMirroredStrategy, stock MWMS with only the
Keras 3 fit fix), --bad_step, --steps, --collective_timeout. Reports, per
step, the weights and the loss scale, and which class compile produced.
"""

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
from report import report

flags.DEFINE_enum("loss_scale", "tfscale", ["tfscale", "stock", "compile"],
                  "Which LossScaleOptimizer wraps SGD; compile: the one "
                  "model.compile chooses for a plain SGD.")
flags.DEFINE_enum("strategy", "tfscale", ["tfscale", "stock"],
                  "tfscale.Strategy, or stock MWMS with the Keras fit fix.")
flags.DEFINE_integer("steps", 6, "Training steps.")
flags.DEFINE_integer("bad_step", 2, "Step (0-based) whose batch is inf on worker 1; "
                     "-1: none.")
flags.DEFINE_float("collective_timeout", 120, "Collective timeout in seconds.")
FLAGS = flags.FLAGS

GLOBAL_BATCH = 8
FEATURES = 5
# Low enough that no finite step overflows by itself. compile uses Keras's
# default, 2**15, which this model's finite steps also stand.
INITIAL_SCALE = 1024.0


def dataset_fn(input_context):
    """This worker's batches; worker 1's batch `bad_step` holds an inf."""
    worker = input_context.input_pipeline_id
    batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
    rng = np.random.default_rng(10 + worker)
    x = rng.normal(size=(FLAGS.steps, batch, FEATURES)).astype("float32")
    y = rng.integers(0, 3, size=(FLAGS.steps, batch)).astype("int64")
    if worker == 1 and FLAGS.bad_step >= 0:
        x[FLAGS.bad_step, 0, 0] = np.inf
    return tf.data.Dataset.from_tensor_slices((x, y))


class Recorder(keras.callbacks.Callback):
    """Records weights and loss scale before training and after each step.

    Reports after every step, so a run that hangs still tells the test how
    far each worker got.
    """

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.weights, self.scales, self.iterations = [], [], []

    def _record(self):
        optimizer = self.model.optimizer
        self.weights.append(
            [v.numpy().ravel().tolist() for v in self.model.trainable_variables])
        self.scales.append(float(optimizer.dynamic_scale.numpy()))
        self.iterations.append(int(optimizer.iterations.numpy()))
        self.report(done=False)

    def report(self, done):
        report({
            "worker_index": self.strategy.worker_index,
            "optimizer_class": type(self.model.optimizer).__module__ + "."
                               + type(self.model.optimizer).__name__,
            "weights": self.weights,
            "scales": self.scales,
            "iterations": self.iterations,
            "done": done,
        })

    def on_train_begin(self, logs=None):
        self._record()

    def on_train_batch_end(self, batch, logs=None):
        self._record()


def main(argv):
    keras.mixed_precision.set_global_policy("mixed_float16")
    if FLAGS.strategy == "tfscale":
        strategy = tfscale.Strategy(
            communication=tfscale.CommunicationOptions(
                timeout_seconds=FLAGS.collective_timeout))
    else:
        strategy = tfscale.strategy.KerasMultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=FLAGS.collective_timeout))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3),
            keras.layers.Activation("linear", dtype="float32"),
        ])
        sgd = keras.optimizers.SGD(0.1, momentum=0.9)
        if FLAGS.loss_scale == "compile":
            optimizer = sgd
        else:
            wrapper = {"tfscale": tfscale.optimizers.LossScaleOptimizer,
                       "stock": keras.optimizers.LossScaleOptimizer}[FLAGS.loss_scale]
            optimizer = wrapper(sgd, initial_scale=INITIAL_SCALE,
                                dynamic_growth_steps=1000)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        # Built up front so the recorder can read the scale before step 0.
        model.optimizer.build(model.trainable_variables)
    data = strategy.distribute_datasets_from_function(dataset_fn)
    if FLAGS.loss_scale == "compile":
        # compile wrapped the plain SGD in a loss-scale optimizer.
        assert model.optimizer.inner_optimizer is sgd, type(model.optimizer)
    else:
        # compile must not have wrapped our LossScaleOptimizer in another.
        assert model.optimizer is optimizer, type(model.optimizer)
    recorder = Recorder(strategy)
    model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps,
              callbacks=[recorder], verbose=0)
    recorder.report(done=True)


if __name__ == "__main__":
    app.run(main)
