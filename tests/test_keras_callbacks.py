"""Keras's own callbacks under tfscale.Strategy with 2 workers, used as their
docs and TensorFlow's multi-worker tutorial show them (tfscale/keras_callbacks.py):
ModelCheckpoint, TensorBoard and CSVLogger write one set of files, the
chief's; keras.callbacks.BackupAndRestore stops every worker at the start of
fit, naming tfscale.callbacks.BackupAndRestore."""

import csv
import os
import sys
import time

import keras
import numpy as np

from multiworker import WORKERS_DIR
from multiworker import assert_succeeded
from multiworker import run_workers
from multiworker import start_cluster
from tfscale import _tf_private

SCRIPT = "tutorial_callbacks.py"


def test_fit_calls_the_hooks():
    """The hook tfscale sees the user's callbacks through (private: fit's
    use of CallbackList)."""
    seen = []
    mine = keras.callbacks.Callback()
    remove = _tf_private.add_fit_hooks(
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
