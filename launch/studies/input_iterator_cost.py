r"""What a CPU worker's distributed dataset costs to iterate: read on its host
(tfscale's default) against through TensorFlow's MultiDeviceIterator.

    python -m tfscale.launch.studies.input_iterator_cost

One process, a one-worker `tfscale.Strategy()` (the iterator a worker makes
is the same at any worker count). `--rounds` times each, alternating, in
CPU-seconds of the process (`resource.getrusage`: every thread):

- one iterator: `iter()` of the distributed dataset and its first batch;
- one `fit` of a small model for `--epochs` epochs on that dataset (Keras
  makes two iterators an epoch, plus one to build the model).

"host" is `strategy.experimental_distribute_dataset(dataset)`;
"MultiDeviceIterator" the same with `options=tf.distribute.InputOptions()`,
TensorFlow's default, which tfscale leaves as the user gives it
(docs/data.md, "How each worker reads its batches").
"""

import resource
import statistics

import keras
import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_integer("rounds", 10, "Timed runs of each variant.", lower_bound=1)
    flags.DEFINE_integer("epochs", 2, "Epochs of each timed fit.", lower_bound=1)
    flags.DEFINE_integer("steps", 8, "Steps per epoch of each timed fit.", lower_bound=1)


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _dataset(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * steps, 12)).astype("float32")
    y = rng.integers(0, 4, 32 * steps).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(32)


def _iterate(strategy, options):
    distributed = strategy.experimental_distribute_dataset(_dataset(1), options=options)
    start = _cpu_seconds()
    next(iter(distributed))
    return _cpu_seconds() - start


def _fit(strategy, options):
    distributed = strategy.experimental_distribute_dataset(_dataset(FLAGS.steps),
                                                           options=options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = _cpu_seconds()
    model.fit(distributed, epochs=FLAGS.epochs, verbose=0)
    used = _cpu_seconds() - start
    keras.backend.clear_session()
    return used


def main(argv):
    del argv
    import tfscale

    strategy = tfscale.Strategy()
    variants = {"host": None, "MultiDeviceIterator": tf.distribute.InputOptions()}
    for options in variants.values():  # first runs trace what every later one reuses
        _iterate(strategy, options)
        _fit(strategy, options)
    times = {(what, name): [] for what in ("iterator", "fit") for name in variants}
    for _ in range(FLAGS.rounds):
        for name, options in variants.items():
            times["iterator", name].append(_iterate(strategy, options))
            times["fit", name].append(_fit(strategy, options))
    medians = {key: statistics.median(t) for key, t in times.items()}
    for (what, name), median in medians.items():
        print(f"{what:8s} {name:19s} median {median:.3f} CPU-seconds ({FLAGS.rounds} rounds)")
    for what in ("iterator", "fit"):
        host, device = medians[what, "host"], medians[what, "MultiDeviceIterator"]
        print(f"{what}: host / MultiDeviceIterator = {host / device:.2f}")
    print(f"(fit: {FLAGS.epochs} epochs of {FLAGS.steps} steps, batch 32, Dense 12-16-4)")


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
