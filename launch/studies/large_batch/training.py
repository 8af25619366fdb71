"""Training: one AlexNet-BN run or one softmax-regression run, as a `Run`."""

import contextlib
import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf
from absl import flags

import tfscale
from tfscale import batch_growth
from tfscale import callbacks
from tfscale import data
from tfscale import models
from tfscale import optimizers
from tfscale import recipes
from tfscale.launch.studies.large_batch import variants

FLAGS = flags.FLAGS

# SVRG's and HALP's T, in epochs: about 2.5x SGD's gradients per epoch.
_SOFTMAX_EPOCHS_PER_FULL_GRADIENT = 2

_strategies = {}


def powersgd_strategy(rank):
    """One worker's `tfscale.Strategy` all-reducing by PowerSGD at `rank`
    (one per rank per process: every run of that rank shares it)."""
    if rank not in _strategies:
        _strategies[rank] = tfscale.Strategy(
            communication=tfscale.CommunicationOptions(
                compression="powersgd", powersgd=tfscale.PowerSGDOptions(
                    rank=rank, start_step=FLAGS.powersgd_start_step)))
    return _strategies[rank]


@dataclasses.dataclass
class Run:
    """What one training run measured.

    Attributes:
        accuracy: test accuracy (%) after every epoch.
        seconds: wall time of the run.
        recomputed_accuracy: AlexNet-BN: final test accuracy (%) with the
            BatchNorm statistics recomputed for the final weights.
        objective: softmax: the final training loss + L2 term.
        updates: parameter updates made.
        gradients: softmax: per-example gradient evaluations made.
    """

    accuracy: list
    seconds: float
    recomputed_accuracy: float = None
    objective: float = None
    updates: int = 0
    gradients: int = 0


def build_model():
    """The model of --model, and the input side it needs."""
    if FLAGS.model == "alexnet_bn":
        return models.alexnet_bn(num_classes=10, input_shape=(67, 67, 1),
                                 fc_units=64), 67
    return models.alexnet_bn_small(), 8


def test_accuracy_callback(model, images, labels):
    """A Keras callback recording `model`'s test accuracy (%) per epoch."""

    class TestAccuracy(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            # One list over every fit (a growing batch fits once per phase).
            self.accuracy = []

        def on_epoch_end(self, epoch, logs=None):
            self.accuracy.append(accuracy_of(model, images, labels))

    return TestAccuracy()


def accuracy_of(model, images, labels):
    """Test accuracy (%) of `model` on `images`."""
    logits = model.predict_on_batch(images)
    return 100.0 * float(np.mean(np.argmax(logits, axis=1) == labels))


def train_alexnet(variant, precision, seed):
    """One AlexNet-BN run: accuracy per epoch, then with recomputed BN."""
    start = time.perf_counter()
    settings = variant.settings(precision)
    recipes.set_precision(settings)
    keras.utils.set_random_seed(seed)
    strategy = (powersgd_strategy(variant.powersgd_rank)
                if variant.powersgd_rank else None)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model, image_size = build_model()
        optimizer, _ = recipes.make_optimizer(
            settings, variant.batch, variant.steps_per_epoch, FLAGS.epochs)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images, labels = data.digits_arrays("test")
    images = data.preprocess(images, data.spec("digits"), image_size)
    callback = test_accuracy_callback(model, images, labels)
    phases = recipes.batch_phases(settings, variant.batch,
                                  variant.steps_per_epoch, FLAGS.epochs)
    for part in batch_growth.fit_parts(phases):  # one without growth
        phase = part.phase
        model.fit(data.digits("train", phase.global_batch_size, image_size,
                              seed=seed, start_example=phase.first_example,
                              start_step=part.data_step),
                  initial_epoch=part.initial_epoch, epochs=part.epochs,
                  steps_per_epoch=part.steps_per_epoch, callbacks=[callback],
                  verbose=0)
    # BatchNorm without moving averages: statistics of the final weights,
    # over one epoch of final training batches (another shuffle).
    last = phases[-1]
    callbacks.recompute_batch_norm_statistics(
        model, data.digits("train", last.global_batch_size, image_size,
                           seed=seed + 1),
        steps=last.steps_per_epoch)
    run = Run(callback.accuracy, 0.0,
              recomputed_accuracy=accuracy_of(model, images, labels),
              updates=int(optimizer.iterations.numpy()))
    keras.backend.clear_session()
    run.seconds = time.perf_counter() - start
    return run


def softmax_features(split):
    """Digits as 64 pixels in [0, 1], centred on the training mean."""
    def pixels(name):
        images, labels = data.digits_arrays(name)
        pixels = images.reshape(len(images), -1).astype(np.float32) / 255.0
        return pixels, labels

    train_images, _ = pixels("train")
    images, labels = pixels(split)
    return images - train_images.mean(axis=0), labels


def softmax_optimizer(variant, seed):
    """The optimizer of a softmax variant (SVRG/HALP need a wrapper)."""
    lr = variant.learning_rate
    epoch_length = _SOFTMAX_EPOCHS_PER_FULL_GRADIENT * variant.steps_per_epoch
    if variant.method == "halp":
        return optimizers.HALP(learning_rate=lr, epoch_length=epoch_length,
                               bits=variants.BITS, mu=2 * FLAGS.softmax_l2,
                               seed=seed)
    if variant.method == "svrg":
        return optimizers.SVRG(learning_rate=lr, epoch_length=epoch_length)
    if variant.method == "lp_sgd":
        return optimizers.LowPrecisionSGD(
            learning_rate=lr, bits=variants.BITS,
            scale=FLAGS.softmax_lp_scale, seed=seed)
    return keras.optimizers.SGD(learning_rate=lr)


def train_softmax(variant, seed):
    """One softmax-regression run, counting updates and gradients."""
    start = time.perf_counter()
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(seed)
    x, y = softmax_features("train")
    test_x, test_y = softmax_features("test")
    model = keras.Sequential([
        keras.Input((x.shape[1],)),
        keras.layers.Dense(
            10, use_bias=False, kernel_initializer="zeros",
            kernel_regularizer=keras.regularizers.L2(FLAGS.softmax_l2)),
    ])
    optimizer = softmax_optimizer(variant, seed)
    full_passes = []

    class CountingModel(models.VarianceReducedModel):
        def full_gradient(self):
            full_passes.append(len(x))
            return super().full_gradient()

    variance_reduced = variant.method in ("svrg", "halp")
    trainer = (CountingModel(model, full_gradient_data=tf.data.Dataset
                             .from_tensor_slices((x, y)).batch(512))
               if variance_reduced else model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer.compile(optimizer=optimizer, loss=loss)
    train = (tf.data.Dataset.from_tensor_slices((x, y))
             .shuffle(len(x), seed=seed).repeat().batch(variant.batch))
    callback = test_accuracy_callback(model, test_x, test_y)
    trainer.fit(train, epochs=FLAGS.epochs,
                steps_per_epoch=variant.steps_per_epoch, callbacks=[callback],
                verbose=0)
    weights = model.trainable_variables[0].numpy()
    l2_term = FLAGS.softmax_l2 * np.sum(weights.astype(np.float64) ** 2)
    objective = float(loss(y, model.predict_on_batch(x))) + float(l2_term)
    updates = int(optimizer.iterations.numpy())
    # Per step: the batch at the weights (and at the anchor for SVRG/HALP).
    gradients = (2 if variance_reduced else 1) * updates * variant.batch
    keras.backend.clear_session()
    return Run(callback.accuracy, time.perf_counter() - start,
               objective=objective, updates=updates,
               gradients=gradients + sum(full_passes))


def train_once(variant, precision, seed):
    """The `Run` of one variant under one precision and seed."""
    if variant.softmax:
        return train_softmax(variant, seed)
    return train_alexnet(variant, precision, seed)

