"""The worker side of `tfscale-bench train --algorithms=jax`: Keras 3 on JAX.

What Keras's maintainers point multi-worker users to (keras#20585): the JAX
backend with `keras.distribution.DataParallel`, one program over every
process's devices, its gradient all-reduce carried by JAX's CPU collectives
(gloo). This worker trains the same model on the same data with the same
optimizer as train_worker.py does under TensorFlow, and times it the same
way: first alone while the other workers do the same ("compute"), then
under DataParallel ("distributed").

It starts from the weights and the batch that the `single` launch (one
TensorFlow worker) wrote to `spec["reference_path"]`: JAX's random numbers
are not TensorFlow's, and train.py compares the two backends' losses after
the same steps.

No TensorFlow is imported here: Keras reads KERAS_BACKEND once, on import.

References:
    - https://keras.io/guides/distribution/ (DataParallel, initialize)
    - https://docs.jax.dev/en/latest/_autosummary/jax.distributed.initialize.html
"""

import json
import os
import time

# The JAX worker's whole process is Keras on JAX.
os.environ["KERAS_BACKEND"] = "jax"


def _hold_to_share_of_cores():
    """Runs this process on its share of the cores, as tfscale-launch gives
    TensorFlow workers theirs (TF_NUM_INTRAOP_THREADS, launch/threads.py).
    XLA's CPU client sizes its thread pool by the cores a process may run
    on, and XLA_FLAGS' Eigen settings do not bound it in jaxlib 0.10, so the
    share is set as CPU affinity: worker r gets cores r x share onwards,
    wrapping."""
    share = os.environ.get("TF_NUM_INTRAOP_THREADS")
    if not share or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    first = rank * int(share)
    os.sched_setaffinity(0, {cores[(first + i) % len(cores)]
                             for i in range(min(int(share), len(cores)))})


_hold_to_share_of_cores()  # before XLA starts its threads

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfscale.launch.bench import train_model  # noqa: E402


def measure(spec):
    """Trains as train_worker.measure does, under DataParallel.

    Returns:
        `{"rank", "runs"}`: per precision a "compute" run and, unless
        `spec["alone"]` (the 1-process baseline, which is read for its
        compute runs only), a "distributed" run, each with its per-step
        seconds and losses.
    """
    rank, num_workers, coordinator = _cluster()
    # gloo: JAX's CPU collectives between processes (its default since 0.5.1),
    # named because it carries the gradient all-reduce being measured.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keras.distribution.initialize(job_addresses=coordinator, num_processes=num_workers,
                                  process_id=rank)
    reference = np.load(spec["reference_path"])
    weights = [reference[f"weight_{i}"] for i in range(int(reference["num_weights"]))]
    images, labels = reference["images"], reference["labels"]
    runs = []
    for precision in spec["precisions"]:
        keras.mixed_precision.set_global_policy(precision)
        multihost_utils.sync_global_devices(f"compute {precision}")
        runs.append({"precision": precision, "phase": "compute",
                     **_fit(spec, weights, images, labels)})
        if not spec.get("alone", False):
            multihost_utils.sync_global_devices(f"distributed {precision}")
            keras.distribution.set_distribution(
                keras.distribution.DataParallel(auto_shard_dataset=False))
            try:
                runs.append({"precision": precision, "phase": "distributed",
                             **_fit(spec, weights, images, labels)})
            finally:
                keras.distribution.set_distribution(None)
        if rank == 0:
            train_model.print_progress(spec, precision, runs)
    keras.mixed_precision.set_global_policy("float32")
    return {"rank": rank, "runs": runs}


def _cluster():
    """(rank, number of workers, coordinator "host:port") from the TF_CONFIG
    tfscale-launch gives every worker: worker 0's address serves as JAX's
    coordinator (no TensorFlow server listens on it here)."""
    config = json.loads(os.environ["TF_CONFIG"])
    workers = config["cluster"]["worker"]
    return int(config["task"]["index"]), len(workers), workers[0]


class _StepRecorder(keras.callbacks.Callback):
    """Each step's wall time and fit's loss after it. Reading the loss waits
    for the step: JAX dispatches asynchronously."""

    def __init__(self):
        super().__init__()
        self.step_seconds, self.losses = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        self.step_seconds.append(time.perf_counter() - self._start)


def _fit(spec, weights, images, labels):
    """Timed steps of `model.fit` from the reference weights, the reference
    batch every step (each process feeds its own copy: under DataParallel
    the global batch is num_workers of them)."""
    model = train_model.build(spec)
    model.set_weights(weights)
    steps = spec["warmup_steps"] + spec["steps"]
    recorder = _StepRecorder()
    model.fit(np.tile(images, (steps, 1, 1, 1)), np.tile(labels, steps),
              batch_size=len(images), epochs=1, shuffle=False, callbacks=[recorder],
              verbose=0)
    return {"step_seconds": recorder.step_seconds[spec["warmup_steps"]:],
            "losses": recorder.losses,
            "gradient_floats": train_model.gradient_floats(model)}
