"""One worker of `tfscale-bench scale`: start-up, memory, and one small
training per algorithm on a global batch the workers cannot share evenly."""

import time

# Start-up is counted from here: the worker's first line of Python.
STARTED = time.monotonic()

import hashlib  # noqa: E402
import statistics  # noqa: E402


def peak_memory_bytes():
    """This process's peak resident memory (VmHWM)."""
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def _train(strategy, spec):
    import keras
    import numpy as np
    import tensorflow as tf

    batch, steps = spec["global_batch"], spec["steps"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 12)).astype("float32")
    y = rng.integers(0, 4, batch * steps).astype("int64")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step_seconds = []

    class Time(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            step_seconds.append(time.perf_counter() - self.start)

    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch),
              epochs=2, verbose=0, callbacks=[Time()])
    weights = model.get_weights()
    return {
        "weights": [w.tolist() for w in weights],
        "digest": hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(),
        # The second epoch's: the first traces the step.
        "step_seconds": statistics.median(step_seconds[steps:]),
    }


def measure(spec):
    import tfscale

    result = {"runs": {}}
    for algorithm in spec["algorithms"]:
        options = (tfscale.CommunicationOptions() if algorithm == "default"
                   else tfscale.CommunicationOptions(algorithm=algorithm))
        strategy = tfscale.Strategy(communication=options)
        if "startup_seconds" not in result:
            result["startup_seconds"] = time.monotonic() - STARTED
            result["rank"] = strategy.worker_index
            result["topology"] = strategy.topology.describe()
        result["runs"][algorithm] = _train(strategy, spec)
    result["peak_memory_bytes"] = peak_memory_bytes()
    return result
