"""Data-parallel Keras training on the JAX backend with tfscale's LARS recipe.

No TensorFlow: Keras on JAX runs one program over all processes' devices
(`keras.distribution.DataParallel`), and tfscale contributes the optimizer,
its schedule and the model. Two processes on this machine (docs/jax.md):

    python docs/examples/jax_data_parallel.py --process_id=0 &
    python docs/examples/jax_data_parallel.py --process_id=1

Each process joins the others through `keras.distribution.initialize`,
which calls `jax.distributed.initialize` (process 0 serves as coordinator
at `--coordinator`) and agrees on one random seed (then set to `--seed` on
all); JAX's CPU collectives (gloo) then carry the gradient all-reduce. Each
process feeds its own rows of every global batch; the model's variables
are replicated.

References:
    - Keras's distribution API: https://keras.io/guides/distribution/ and
      https://keras.io/api/distribution/ (DataParallel, initialize)
    - https://docs.jax.dev/en/latest/_autosummary/jax.distributed.initialize.html
"""

import argparse
import math
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")  # read when Keras is imported

import jax  # noqa: E402
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from tfscale import models  # noqa: E402
from tfscale import recipes  # noqa: E402

# tfscale's LARS recipe for AlexNet-BN (LARS, warmup, polynomial decay of
# power 2, weight decay 5e-4 except biases and BatchNorm), with this
# example's own peak learning rate and warmup for a global batch of 480 on
# the digits (docs/jax.md says what it reached).
RECIPE = "alexnet_bn_lars_8k"
OVERRIDES = {"learning_rate": 3.0, "warmup_epochs": 2.0}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--process_id", type=int, required=True,
                        help="This process: 0 (the coordinator) to num_processes - 1.")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--coordinator", default="127.0.0.1:12355",
                        help="host:port where process 0 serves the others.")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--per_process_batch", type=int, default=240,
                        help="Rows each process feeds per step (global batch: "
                        "this times --num_processes).")
    parser.add_argument("--seed", type=int, default=0,
                        help="Weights and data order, the same on every process.")
    args = parser.parse_args(argv)
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        parser.error("--process_id must be in [0, --num_processes) and "
                     f"--num_processes >= 1. Received: --process_id={args.process_id}, "
                     f"--num_processes={args.num_processes}")
    if args.epochs <= OVERRIDES["warmup_epochs"] or args.per_process_batch < 1:
        parser.error(f"--epochs must be more than the warmup ({OVERRIDES['warmup_epochs']:g}) "
                     f"and --per_process_batch >= 1. Received: --epochs={args.epochs}, "
                     f"--per_process_batch={args.per_process_batch}")
    return args


def digits(process_id, num_processes, local_devices):
    """This process's rows of the digits' train and test splits (the same
    stratified 80/20 split as tfscale.data: 1,437 and 360 images), scaled to
    [0, 1]. Every process keeps as many rows as the others, a multiple of
    its device count: each step, all of them feed a batch of the same size,
    which their devices split evenly (the last one of an epoch included)."""
    bunch = load_digits()
    images = (bunch.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, bunch.target, test_size=0.2, random_state=0, stratify=bunch.target)

    def rows(x, y):
        unit = num_processes * local_devices
        keep = len(x) // unit * unit
        return x[process_id:keep:num_processes], y[process_id:keep:num_processes]

    return rows(x_train, y_train), rows(x_test, y_test)


def train(args):
    """Builds, fits and evaluates under DataParallel; returns the test
    metrics (the same on every process: they are computed on the global
    batch)."""
    local_devices = jax.local_device_count()
    if args.per_process_batch % local_devices:
        raise ValueError(
            f"--per_process_batch must be a multiple of this process's {local_devices} "
            f"devices. Received: --per_process_batch={args.per_process_batch}")
    # The mesh spans every process's devices (one CPU device each, unless
    # XLA_FLAGS says otherwise). Numpy inputs are not sharded by Keras
    # (`auto_shard_dataset` applies to tf.data): each process passes its own
    # rows.
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False))
    (x, y), (x_test, y_test) = digits(args.process_id, args.num_processes, local_devices)
    steps_per_epoch = math.ceil(len(x) / args.per_process_batch)
    global_batch = args.per_process_batch * args.num_processes

    settings = recipes.Settings.from_recipe(RECIPE, **OVERRIDES)
    optimizer, _ = recipes.make_optimizer(settings, global_batch, steps_per_epoch,
                                          args.epochs)
    model = models.alexnet_bn_small(num_classes=10, input_shape=(8, 8, 1))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    # Progress from process 0 only: the loss is the global batch's on all.
    model.fit(x, y, batch_size=args.per_process_batch, epochs=args.epochs,
              verbose=2 if args.process_id == 0 else 0)
    return model.evaluate(x_test, y_test, batch_size=len(x_test), verbose=0,
                          return_dict=True)


def main(argv=None):
    args = parse_args(argv)
    if keras.backend.backend() != "jax":
        sys.exit("jax_data_parallel.py runs on Keras's JAX backend: unset "
                 f"KERAS_BACKEND or set it to jax. Received: "
                 f"KERAS_BACKEND={keras.backend.backend()}")
    # JAX's collectives between processes on CPU: gloo over TCP (JAX's
    # default, DEFAULT_CPU_COLLECTIVES_IMPL in jax/_src/config.py; named
    # here because it is what carries the gradient all-reduce).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keras.distribution.initialize(job_addresses=args.coordinator,
                                  num_processes=args.num_processes,
                                  process_id=args.process_id)
    print(f"process {args.process_id} of {args.num_processes}: "
          f"{jax.local_device_count()} local, {jax.device_count()} global devices; "
          f"recipe {RECIPE} with {OVERRIDES}, global batch "
          f"{args.per_process_batch * args.num_processes}", flush=True)
    # After initialize, which agreed on a random seed: the same fixed one on
    # every process, so that a run can be repeated.
    keras.utils.set_random_seed(args.seed)
    metrics = train(args)
    print(f"process {args.process_id}: test loss {metrics['loss']:.4f}, "
          f"accuracy {metrics['accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
