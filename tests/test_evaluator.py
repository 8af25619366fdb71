"""tfscale.evaluator: watching a directory of real checkpoints, evaluating them."""

import glob
import logging
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale import checkpoint
from tfscale import evaluator

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(0)
X = RNG.normal(size=(40, 4)).astype(np.float32)
Y = RNG.integers(0, 3, size=40)


def compiled_model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def train_and_save(model, directory, steps):
    """Trains to each of `steps` and saves a checkpoint there."""
    for step in steps:
        while checkpoint.step(model) < step:
            model.train_on_batch(X[:8], Y[:8])
        checkpoint.save(model, str(directory), step)


def eval_data():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)


def fast(directory, **kwargs):
    return evaluator.new_checkpoints(str(directory), poll_seconds=0.01, **kwargs)


def test_new_checkpoints_yields_each_newer_one_and_skips_superseded(tmp_path):
    model = compiled_model(0)
    checkpoints = fast(tmp_path / "ckpt", timeout_seconds=5)
    train_and_save(model, tmp_path / "ckpt", [1])
    assert next(checkpoints) == (1, str(tmp_path / "ckpt" / "step-000000001" / "ckpt"))
    train_and_save(model, tmp_path / "ckpt", [2, 3])  # while the caller was busy
    assert next(checkpoints)[0] == 3


def test_no_new_checkpoint_times_out_naming_the_directory(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="absl")
    directory = tmp_path / "ckpt"
    with pytest.raises(evaluator.NoNewCheckpointError,
                       match=rf"No new checkpoint in {directory} for 0.3 s \(none "
                             r"has been written yet\): training has stopped"):
        next(fast(directory, timeout_seconds=0.3, log_seconds=0.1))
    assert f"Waiting for a new checkpoint in {directory} (none yet)." in caplog.text
    train_and_save(compiled_model(0), directory, [1])
    checkpoints = fast(directory, timeout_seconds=0.2)
    assert next(checkpoints)[0] == 1
    with pytest.raises(evaluator.NoNewCheckpointError,
                       match=r"\(the newest is still step 1\)"):
        next(checkpoints)


def test_evaluates_each_new_checkpoint_until_the_final_step(tmp_path):
    trained = compiled_model(0)
    sidecar = evaluator.CheckpointEvaluator(
        compiled_model(1), eval_data(), str(tmp_path / "ckpt"), final_step=5,
        poll_seconds=0.01, timeout_seconds=5, tensorboard_dir=str(tmp_path / "tb"))
    evaluations = sidecar.evaluations()
    expected = {}
    for step in (2, 5):
        train_and_save(trained, tmp_path / "ckpt", [step])
        expected[step] = trained.evaluate(eval_data(), return_dict=True, verbose=0)
        assert next(evaluations) == (step, expected[step])
    with pytest.raises(StopIteration):  # step 5 was the last
        next(evaluations)
    scalars = {}
    for path in glob.glob(str(tmp_path / "tb" / "eval" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars[value.tag, event.step] = float(tf.make_ndarray(value.tensor))
    assert scalars == {(name, step): value  # float32 values, stored exactly
                       for step, metrics in expected.items()
                       for name, value in metrics.items()}


def test_training_finished_before_the_evaluator_started(tmp_path):
    train_and_save(compiled_model(0), tmp_path / "ckpt", [1, 2, 3])
    sidecar = evaluator.CheckpointEvaluator(
        compiled_model(1), eval_data(), str(tmp_path / "ckpt"), final_step=3,
        timeout_seconds=5)
    assert [step for step, _ in sidecar.evaluations()] == [3]


def test_checkpoint_pruned_before_it_is_read_is_skipped_for_the_newest(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="absl")
    trained = compiled_model(0)
    train_and_save(trained, tmp_path / "ckpt", [1])

    def training_goes_on(step, prefix):
        if step == 1:  # the chief saves twice more: step 1's is pruned
            train_and_save(trained, tmp_path / "ckpt", [2, 3])
            assert not os.path.exists(os.path.dirname(prefix))

    sidecar = evaluator.CheckpointEvaluator(
        compiled_model(1), eval_data(), str(tmp_path / "ckpt"), final_step=3,
        poll_seconds=0.01, timeout_seconds=5, before_restore=training_goes_on)
    step, metrics = sidecar.run()
    assert step == 3
    assert metrics == trained.evaluate(eval_data(), return_dict=True, verbose=0)
    assert ("The checkpoint of step 1 was replaced before it could be read; "
            "evaluating the newest.") in caplog.text


def test_a_missing_checkpoint_that_was_not_pruned_is_an_error(tmp_path):
    train_and_save(compiled_model(0), tmp_path / "ckpt", [1])
    os.remove(glob.glob(str(tmp_path / "ckpt" / "step-000000001" / "ckpt.index"))[0])
    sidecar = evaluator.CheckpointEvaluator(
        compiled_model(1), eval_data(), str(tmp_path / "ckpt"), final_step=1,
        timeout_seconds=5)
    with pytest.raises(tf.errors.NotFoundError):
        sidecar.run()


@pytest.mark.multiworker
@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_a_waiting_evaluator_stops_on_ctrl_c_and_sigterm(tmp_path, signal_number):
    script = ("from tfscale import evaluator\n"
              "print('waiting', flush=True)\n"
              f"next(evaluator.new_checkpoints({str(tmp_path)!r}))\n")
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2"),
        # Ctrl-C's default, whatever this process inherited: a suite started
        # in the background (`pytest ... &`) ignores SIGINT, and so would
        # the evaluator it starts.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout.readline() == "waiting\n"
        time.sleep(1)  # in the polling loop
        process.send_signal(signal_number)
        # Generous: the signal ends the wait at once, but a TensorFlow
        # process's exit can take many seconds on a busy machine.
        process.wait(timeout=120)
        # Died of the signal itself: SIGTERM's default action, or Ctrl-C's
        # KeyboardInterrupt left uncaught (Python then exits by SIGINT).
        # Swallowed, the wait would go on, and the poll's next sleep with it.
        assert process.returncode == -signal_number
    finally:
        process.kill()


def test_is_evaluator_task():
    def resolver(task_type):
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": ["a:1"], "evaluator": ["b:1"]}),
            task_type=task_type, task_id=0)

    assert evaluator.is_evaluator_task(resolver("evaluator"))
    assert not evaluator.is_evaluator_task(resolver("worker"))
