"""One run of the study, trained and measured, on this process's workers."""

import time

import keras
import numpy as np
from absl import flags

from tfscale import batch_growth
from tfscale import data
from tfscale import models
from tfscale import optimizers
from tfscale import recipes
from tfscale.optimizers import exclusion

FLAGS = flags.FLAGS

IMAGE_SIZE = 28  # the images as stored
# alexnet_bn_small at 28x28: width 8, fc1 64 (52K parameters).
MODEL_WIDTH = 8
MODEL_FC_UNITS = 64

class NaiveHalfPrecisionLARS(optimizers.LARS):
    """LARS whose norms, trust ratio and update run in the variable's own
    dtype: with bfloat16 weights, what Jia et al. 2018 (section 3) warn
    against. tfscale's LARS computes them in float32 whatever the weights."""

    def _update_dtype(self, variable_dtype):
        return variable_dtype


def make_optimizer(run, settings, steps_per_epoch):
    """The run's optimizer: the recipe's, but for the two LARS ablations."""
    optimizer, schedule = recipes.make_optimizer(
        settings, run.row.first_batch, steps_per_epoch, run.epochs)
    if run.row.method == "lars_decay_all":
        return optimizers.LARS(
            learning_rate=schedule, momentum=settings.momentum,
            weight_decay_rate=settings.weight_decay, eeta=settings.eeta,
            exclude_from_weight_decay=[],
            # Still kept from layer adaptation: LARS's own default patterns
            # (this model's BatchNorm parameters and biases).
            exclude_from_layer_adaptation=list(exclusion.DEFAULT_EXCLUDE))
    if run.row.method == "lars_half":
        return NaiveHalfPrecisionLARS(
            learning_rate=schedule, momentum=settings.momentum,
            weight_decay_rate=settings.weight_decay, eeta=settings.eeta)
    return optimizer


def test_accuracy(model, images, labels):
    """Test accuracy (%) of `model`, in this process (no collective)."""
    predictions = [np.argmax(model(images[i:i + 2000], training=False), axis=1)
                   for i in range(0, len(images), 2000)]
    return 100.0 * float(np.mean(np.concatenate(predictions) == labels))


def train(run, strategy):
    """Trains `run` under `strategy` (a `tfscale.Strategy`: one worker, or
    every worker tfscale-launch started); returns (record of what it
    measured, the model)."""
    start = time.perf_counter()
    row = run.row
    settings = row.settings(run.learning_rate)
    # floatx too: the loss and the other values Keras makes without a
    # layer's policy.
    keras.config.set_floatx("float64" if run.float64 else "float32")
    keras.mixed_precision.set_global_policy(run.policy)
    keras.utils.set_random_seed(run.seed)
    steps_per_epoch = row.steps_per_epoch
    with strategy.scope():
        model = models.alexnet_bn_small(
            num_classes=10, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 1),
            width=MODEL_WIDTH, fc_units=MODEL_FC_UNITS,
            synchronized_batch_norm=True)
        optimizer = make_optimizer(run, settings, steps_per_epoch)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    test_images, test_labels = data.fashion_mnist_source.arrays("test")
    test_images = data.preprocess(test_images, data.spec("fashion_mnist"),
                                  IMAGE_SIZE).numpy()
    accuracy = []

    class TestAccuracy(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            accuracy.append(round(test_accuracy(model, test_images, test_labels), 2))

    phases = recipes.batch_phases(settings, row.first_batch, steps_per_epoch,
                                  run.epochs)
    for part in batch_growth.fit_parts(phases):  # one without growth
        phase = part.phase

        def dataset(input_context, phase=phase, part=part):
            return data.fashion_mnist(
                "train", phase.global_batch_size, IMAGE_SIZE,
                input_context=input_context, seed=run.seed,
                start_example=phase.first_example, start_step=part.data_step,
                num_examples=run.train_examples)

        model.fit(strategy.distribute_datasets_from_function(dataset),
                  initial_epoch=part.initial_epoch, epochs=part.epochs,
                  steps_per_epoch=part.steps_per_epoch,
                  callbacks=[TestAccuracy()], verbose=0)
    record = dict(
        key=run.key, row=row.id, method=row.method, batch=row.batch,
        precision=run.policy, learning_rate=run.learning_rate,
        peak_learning_rate=settings.peak_learning_rate(row.first_batch),
        seed=run.seed, epochs=run.epochs, train_examples=run.train_examples,
        accuracy=accuracy,
        final_accuracy=accuracy[-1], updates=int(optimizer.iterations.numpy()),
        seconds=round(time.perf_counter() - start, 1),
        workers=strategy.num_replicas_in_sync)
    return record, model
