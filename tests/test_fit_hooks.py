"""tfscale/fit_hooks.py: what tfscale checks and changes at the start of a fit.

Keras's own callbacks under tfscale.Strategy with 2 workers, used as their
docs and TensorFlow's multi-worker tutorial show them: ModelCheckpoint,
TensorBoard and CSVLogger write one set of files, the chief's;
keras.callbacks.BackupAndRestore stops every worker at the start of fit,
naming tfscale.callbacks.BackupAndRestore.

`jit_compile=True` (XLA): trains as stock does where XLA can compile the
step, is refused in one line where it cannot (2+ workers on CPU), and
tfscale's all-reduce timing stays out of compiled steps."""

import csv
import os
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import multiworker
from multiworker import WORKERS_DIR
from multiworker import assert_succeeded
from multiworker import launch_workers
from multiworker import run_workers
from multiworker import start_cluster
from multiworker import worker_env
from tfscale import collectives
from tfscale._private import accessors
from tfscale._private import keras_hooks

SCRIPT = "tutorial_callbacks.py"


def test_fit_calls_the_hooks():
    """The hook tfscale sees the user's callbacks through (private: fit's
    use of CallbackList)."""
    seen = []
    mine = keras.callbacks.Callback()
    remove = keras_hooks.add_fit_hooks(
        lambda callbacks, model: seen.append(("begin", list(callbacks.callbacks))),
        lambda callbacks: seen.append(("end", callbacks.model)))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[mine])
    finally:
        remove()
    assert [event for event, _ in seen] == ["begin", "end"]
    assert mine in seen[0][1] and seen[1][1] is model


@pytest.mark.multiworker
def test_model_checkpoint_tensorboard_and_csv_logger_write_once(tmp_path):
    out = tmp_path / "out"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = run_workers(SCRIPT, 2, tmp_path, args=[str(out), "keras_files"],
                      env={"TMPDIR": str(scratch)})
    assert_succeeded(run)
    assert sorted(os.listdir(out)) == ["ckpt", "logs", "training.csv"]
    assert sorted(os.listdir(out / "ckpt")) == ["model-1.keras", "model-2.keras"]
    reloaded = keras.saving.load_model(out / "ckpt" / "model-2.keras")
    trained = run.results[0]["variables"]
    assert reloaded.trainable_weights
    for saved in reloaded.trainable_weights:
        # The worker's paths start with its model's name.
        [value] = [v for path, v in trained.items() if path.endswith("/" + saved.path)]
        np.testing.assert_array_equal(saved.numpy(), value)
    with open(out / "training.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["epoch"] for row in rows] == ["0", "1"]
    assert sorted(os.listdir(out / "logs")) == ["train"]
    assert len(os.listdir(out / "logs" / "train")) == 1  # one event file
    assert os.listdir(scratch) == []  # the other worker's files are deleted


@pytest.mark.multiworker
def test_keras_backup_and_restore_is_refused_on_every_worker(tmp_path):
    backup = tmp_path / "backup"
    command = [sys.executable, os.path.join(WORKERS_DIR, SCRIPT), str(backup),
               "keras_backup"]
    processes = start_cluster([command, command], tmp_path)
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in processes:
        if p.poll() is None:
            p.kill()
    for index, process in enumerate(processes):
        log = (tmp_path / f"worker-{index}.log").read_text()
        assert process.returncode not in (0, None), log[-3000:]
        assert ("ValueError: keras.callbacks.BackupAndRestore cannot back up a fit "
                "with 2 workers: every worker writes the same file. Use "
                "tfscale.callbacks.BackupAndRestore(backup_dir, save_freq=..., "
                "delete_checkpoint=...) instead") in log, log[-3000:]
    assert not backup.exists()


def test_in_xla_context_sees_jit_compile():
    seen = []

    def probe():
        seen.append(accessors.in_xla_context())
        return tf.constant(0.0)

    tf.function(probe, jit_compile=True)()
    tf.function(probe)()
    tf.function(lambda: tf.function(probe, jit_compile=True)())()
    assert seen == [True, False, True]
    assert not accessors.in_xla_context()  # eager


def test_a_timed_all_reduce_compiles_under_xla_and_adds_no_time():
    exposed = tf.Variable(0.0, dtype=tf.float64)

    def step(x):  # reduce_fn stands in for the collectives
        return collectives.timed_all_reduce(lambda t: [2.0 * t[0]], [x], exposed)

    def op_types(function):
        graph = function.get_concrete_function(tf.constant(3.0)).graph
        return {op.type for op in graph.get_operations()}

    # XLA has no kernel for tf.timestamp: with it in the step, this fails.
    compiled = tf.function(step, jit_compile=True)
    assert float(compiled(tf.constant(3.0))[0]) == 6.0
    assert float(exposed.numpy()) == 0.0
    assert "Timestamp" not in op_types(compiled)
    assert "Timestamp" in op_types(tf.function(step))  # timed outside XLA


GPUS = tf.config.list_physical_devices("GPU")


@pytest.mark.multiworker
def test_jit_compile_on_one_worker_trains_as_stock(tmp_path):
    weights = {}
    with open(f"{WORKERS_DIR}/jit_compile_fit.py") as f:
        original = f.read()
    for name, strategy in (("tfscale", "tfscale.Strategy()"),
                           ("stock", "tf.distribute.MultiWorkerMirroredStrategy()")):
        script = original
        for old, new in (("import tfscale\n", "import tfscale\nimport tensorflow as tf\n"),
                         ("strategy = tfscale.Strategy()", f"strategy = {strategy}")):
            assert script.count(old) == 1, f"jit_compile_fit.py no longer holds {old!r}"
            script = script.replace(old, new)
        results = tmp_path / name
        results.mkdir()
        (tmp_path / f"{name}.py").write_text(script)
        done = multiworker.run([sys.executable, str(tmp_path / f"{name}.py")], tmp_path,
                               worker_env(results), timeout=180)
        assert done.returncode == 0, done.stdout[-3000:]
        weights[name] = (results / "worker-0.json").read_text()
    assert weights["tfscale"] == weights["stock"]


@pytest.mark.skipif(bool(GPUS), reason="the workers would compute on this machine's "
                    "GPUs, where XLA compiles collectives: the CPU refusal does not apply")
@pytest.mark.multiworker
def test_jit_compile_on_two_cpu_workers_is_refused_in_one_line(tmp_path):
    run = launch_workers("jit_compile_fit.py", 2, tmp_path,
        why='its workers fail on purpose (jit_compile refused)', timeout=120)
    assert run.returncode != 0
    assert run.results == [None, None]
    for index in (0, 1):
        assert (f"[worker {index}] ValueError: jit_compile=True cannot run on 2 "
                "workers on CPU: XLA does not compile collectives for CPU devices"
                in run.output), run.output[-3000:]
    assert "Timestamp" not in run.output
    assert "Graph execution error" not in run.output
