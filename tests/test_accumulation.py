"""Gradient accumulation and clipping under tfscale.Strategy.

Keras 3.15 clips each worker's LOCAL gradient before the all-reduce, and its
`gradient_accumulation_steps` puts the all-reduce inside a replica-context
`cond`, where `merge_call` fails. Under `tfscale.Strategy` every Keras
optimizer all-reduces first, then clips, and accumulates local gradients
with one all-reduce per accumulated step
(`keras_hooks.route_optimizer_updates`).

The multi-worker tests start real workers (tests/workers/accumulation_worker.py),
each training several small classifiers one after another, and compare:
k micro-batches of b per worker against one batch of k*b (2 workers), and
N workers against 1 at the same global batch with each clipping argument.
"""

import sys

import numpy as np
import pytest

import keras
import tensorflow as tf

import tfscale
from tfscale._private import keras_hooks
from tests import multiworker

STEPS = 3
# float32 sums taken in another order: a few ulps of the weights (measured
# below 1e-6; see the report of each test's max difference).
TOLERANCE = 1e-5


def _max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(a, b, strict=True))


def _tiny_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_hook_is_installed_on_keras_optimizers_and_accumulates_in_one_process():
    """One worker: SGD(gradient_accumulation_steps=4) under tfscale.Strategy
    trains (stock Keras fails in `merge_call` there) and 4 micro-batches of 2
    give what one batch of 8 gives without a strategy."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8, 3)).astype("float32")
    y = rng.normal(size=(3, 8, 2)).astype("float32")
    keras.utils.set_random_seed(1)
    reference = _tiny_model()
    initial = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss="mse")
    for step in range(3):
        reference.train_on_batch(x[step], y[step])

    strategy = tfscale.Strategy()
    with strategy.scope():
        model = _tiny_model()
        model.set_weights(initial)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9,
                                         gradient_accumulation_steps=4)
        model.compile(optimizer=optimizer, loss="mse")
    assert keras_hooks.optimizer_updates_routed(optimizer)
    micro_batches = tf.data.Dataset.from_tensor_slices(
        (x.reshape(12, 2, 3), y.reshape(12, 2, 2)))
    model.fit(micro_batches, epochs=1, verbose=0)
    assert int(optimizer.iterations.numpy()) == 3
    difference = _max_difference(model.get_weights(), reference.get_weights())
    print(f"max |accumulated - one batch of 8| = {difference:.3g}")
    assert difference < TOLERANCE


def _run(tmp_path, num_workers, runs, strategy="tfscale", global_batch=16):
    run = multiworker.run_workers(
        "accumulation_worker.py", num_workers, tmp_path / f"{strategy}-{num_workers}",
        args=[f"--strategy={strategy}", f"--runs={','.join(runs)}",
              f"--steps={STEPS}", f"--global_batch={global_batch}"],
        timeout=240)
    multiworker.assert_succeeded(run)
    chief = run.results[0]["runs"]
    for other in run.results[1:]:  # every worker ends with the same weights
        for name, result in other["runs"].items():
            assert result["weights"] == chief[name]["weights"], name
    return chief


@pytest.mark.multiworker
def test_two_workers_accumulating_4_micro_batches_train_like_one_step_of_4x(tmp_path):
    """2 workers, 4 micro-batches of 2 per worker and step against 1 batch of
    8 per worker: same weights to float32 rounding, and ONE gradient
    all-reduce per accumulated step, counted at run time (Keras would run
    one per micro-batch). LARS, clipping (after the all-reduce, on the
    accumulated mean) and tfscale's LossScaleOptimizer compose with it."""
    runs = ["sgd:none:1", "sgd:none:4", "lars:global_clipnorm:1",
            "lars:global_clipnorm:4", "loss_scale:clipnorm:1", "loss_scale:clipnorm:4"]
    results = _run(tmp_path, 2, runs)
    for plain, accumulated, tolerance in (
            (runs[0], runs[1], TOLERANCE), (runs[2], runs[3], TOLERANCE),
            # mixed_float16: float16 forward passes of other batch sizes.
            (runs[4], runs[5], 1e-3)):
        difference = _max_difference(results[accumulated]["weights"],
                                     results[plain]["weights"])
        print(f"{accumulated} vs {plain}: max weight difference {difference:.3g}")
        assert difference < tolerance
        assert results[plain]["gradient_all_reduces"] == STEPS
        assert results[accumulated]["gradient_all_reduces"] == STEPS
        assert results[accumulated]["iterations"] == STEPS
    # The runs do train, and differently with LARS and clipping.
    assert _max_difference(results[runs[0]]["weights"],
                           results[runs[2]]["weights"]) > 1e-3


@pytest.mark.multiworker
def test_clipping_on_two_workers_means_what_it_means_on_one(tmp_path):
    """clipnorm, global_clipnorm and clipvalue clip the all-reduced gradient:
    2 workers end where 1 worker ends at the same global batch, within
    float32 rounding, with SGD, with LARS, under loss scaling (mixed_float16:
    within float16's rounding of the forward pass) and with accumulation;
    stock Keras (local clipping) does not."""
    runs = ["sgd:none:1", "sgd:clipnorm:1", "sgd:global_clipnorm:1",
            "sgd:clipvalue:1", "lars:clipnorm:1", "lars:global_clipnorm:1",
            "loss_scale:global_clipnorm:1", "sgd:global_clipnorm:2",
            "lars:clipnorm:2"]
    one = _run(tmp_path, 1, runs)
    many = _run(tmp_path, 2, runs)
    for name in runs:
        difference = _max_difference(many[name]["weights"], one[name]["weights"])
        print(f"{name}: 2 workers vs 1, max weight difference {difference:.3g}")
        assert difference < (1e-3 if name.startswith("loss_scale") else TOLERANCE)
    for name in runs[1:4]:  # each clips: it changes the training
        assert _max_difference(one[name]["weights"], one[runs[0]]["weights"]) > 1e-3
    stock = _run(tmp_path, 2, ["sgd:global_clipnorm:1"], strategy="stock")
    gap = _max_difference(stock["sgd:global_clipnorm:1"]["weights"],
                          one["sgd:global_clipnorm:1"]["weights"])
    print(f"stock Keras global_clipnorm, 2 workers vs 1: {gap:.3g}")
    assert gap > 100 * TOLERANCE


def _train(args, cwd, timeout=300):
    return multiworker.run(args, cwd, multiworker.worker_env(cwd), timeout)


@pytest.mark.multiworker
def test_tfscale_train_accumulation_steps(tmp_path):
    """2 workers, --global_batch_size=32 --accumulation_steps=2: 2 micro-batches
    of 16 (8 per worker) per update; the checkpoint holds 8 fit steps and 4
    optimizer updates."""
    process = multiworker.run_train(
        2, tmp_path, ["--epochs=1", "--model=alexnet_bn_small", "--fc_units=32",
                      "--global_batch_size=32", "--steps_per_epoch=4",
                      "--accumulation_steps=2", "--export_dir=",
                      "--checkpoint_steps=8", f"--model_dir={tmp_path / 'run'}"],
        timeout=240)
    assert process.returncode == 0, process.output[-6000:]
    assert ("Each step accumulates 2 micro-batches of 16 (8 per worker); "
            "8 micro-batches per epoch.") in process.output
    step, variables = multiworker.checkpoint_variables(tmp_path / "run")
    assert step == 8  # micro-batches: the data position a resume starts at
    taken = [v for name, v in variables.items() if name.startswith("optimizer/_iterations/")]
    assert [int(v) for v in taken] == [8]
    # 23 accumulators, one per trainable variable, zeroed by the last update.
    shapes = [v.shape for name, v in variables.items()
              if name.startswith("optimizer/_trainable_variables/")]
    accumulators = [v for name, v in variables.items()
                    if name.startswith("optimizer/_variables/") and v.shape != ()]
    assert len(accumulators) == 2 * len(shapes)  # momentum and accumulator
    assert sum(not np.any(v) for v in accumulators) >= len(shapes)


@pytest.mark.multiworker
def test_tfscale_train_refuses_micro_batches_that_do_not_divide(tmp_path):
    process = _train([sys.executable, "-m", "tfscale.launch.train", "--global_batch_size=32",
                      "--accumulation_steps=3", "--export_dir="], cwd=tmp_path,
                     timeout=120)
    assert process.returncode != 0
    assert ("tfscale-train: `global_batch_size` must be divisible by "
            "`accumulation_steps` (3), so that every update averages equal "
            "micro-batches. Received: global_batch_size=32; use e.g. 30.") in process.stdout
