"""tfscale.checkpoint: what a checkpoint holds, and that writes are atomic."""

import json
import os
import shutil
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

from multiworker import flip_bytes
from tfscale import checkpoint


def compiled_model(seed, loss_scale=False):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def train(model, steps):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)), rng.normal(size=(8, 2))
    for _ in range(steps):
        model.train_on_batch(x, y)


@pytest.mark.parametrize("loss_scale", [False, True])
def test_restored_model_continues_exactly(tmp_path, loss_scale):
    original = compiled_model(0, loss_scale)
    train(original, 3)
    checkpoint.save(original, str(tmp_path), step=3)
    restored = compiled_model(1, loss_scale)  # other initial weights
    assert checkpoint.restore(restored, str(tmp_path)) == 3
    for a, b in zip(original.optimizer.variables, restored.optimizer.variables,
                    strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    if loss_scale:  # the dynamic loss scale is among them
        assert any("scale" in v.path for v in restored.optimizer.variables)
    train(original, 2)
    train(restored, 2)  # Dropout masks match only if its RNG state was restored
    for a, b in zip(original.variables, restored.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_nothing_to_restore_is_step_zero(tmp_path):
    assert checkpoint.restore(compiled_model(0), str(tmp_path / "empty")) == 0


def test_state_names_the_newest_and_old_ones_are_pruned(tmp_path):
    model = compiled_model(0)
    train(model, 1)
    for step in (1, 2, 3):
        checkpoint.save(model, str(tmp_path), step)
    assert json.loads((tmp_path / "state.json").read_text()) == {
        "step": 3, "checkpoint": "step-000000003"}
    assert sorted(os.listdir(tmp_path)) == ["state.json", "step-000000002",
                                            "step-000000003"]


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = compiled_model(0)
    train(model, 1)
    checkpoint.save(model, str(tmp_path), 1)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.tf.train.Checkpoint, "write", fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(model, str(tmp_path), 2)
    assert checkpoint.latest(str(tmp_path))[0] == 1
    assert sorted(os.listdir(tmp_path)) == ["state.json", "step-000000001"]


def test_restore_model_reads_the_weights_alone(tmp_path):
    trained = compiled_model(0)
    train(trained, 3)  # BatchNorm's moving statistics move too
    checkpoint.save(trained, str(tmp_path), step=3)
    _, prefix = checkpoint.latest(str(tmp_path))
    keras.utils.set_random_seed(1)
    fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    checkpoint.restore_model(fresh, prefix)  # no optimizer needed
    for a, b in zip(trained.weights, fresh.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_restore_model_of_a_pruned_checkpoint_is_not_found(tmp_path):
    model = compiled_model(0)
    for step in (1, 2, 3):
        checkpoint.save(model, str(tmp_path), step)
    with pytest.raises(tf.errors.NotFoundError):
        checkpoint.restore_model(model, str(tmp_path / "step-000000001" / "ckpt"))


def saved_steps(model, directory, steps):
    weights = {}
    for step in steps:
        train(model, 1)
        checkpoint.save(model, str(directory), step, extra={"epoch": step})
        weights[step] = [v.numpy() for v in model.trainable_variables]
    return weights


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_the_older_one_resumed(
        tmp_path, caplog):
    weights = saved_steps(compiled_model(0), tmp_path, (4, 8))
    flip_bytes(tmp_path / "step-000000008")
    with pytest.raises(tf.errors.OpError, match="Checksum does not match"):
        checkpoint.restore(compiled_model(1), str(tmp_path))  # what users got
    with caplog.at_level("WARNING"):
        assert checkpoint.recover(str(tmp_path), is_chief=True) == 4
    (moved,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("corrupt-")]
    assert moved.startswith("corrupt-step-000000008-")
    assert (tmp_path / moved / "ckpt.index").exists()  # kept, not deleted
    assert not (tmp_path / "step-000000008").exists()
    saved = checkpoint.state(str(tmp_path))
    assert saved["step"] == 4 and saved["epoch"] == 4  # the older one's record
    assert (f"The checkpoint of step 8 in {tmp_path} is corrupt (TensorBundle at "
            in caplog.text and "Checksum does not match" in caplog.text and f"moved aside to {moved}" in caplog.text
            and "resuming from the checkpoint of step 4" in caplog.text)
    restored = compiled_model(1)
    assert checkpoint.restore(restored, str(tmp_path)) == 4
    for a, b in zip(weights[4], restored.trainable_variables, strict=True):
        np.testing.assert_array_equal(a, b.numpy())
    # Training goes on from there; the next save names its own step again.
    checkpoint.save(restored, str(tmp_path), 5)
    assert checkpoint.state(str(tmp_path)) == {"step": 5, "checkpoint": "step-000000005"}
    assert (tmp_path / moved).exists()


def test_an_intact_checkpoint_is_left_as_it_is(tmp_path):
    saved_steps(compiled_model(0), tmp_path, (4, 8))
    before = (tmp_path / "state.json").read_text()
    assert checkpoint.recover(str(tmp_path), is_chief=True) == 8
    assert (tmp_path / "state.json").read_text() == before
    assert checkpoint.recover(str(tmp_path / "none"), is_chief=True) == 0


def test_no_intact_checkpoint_is_named_and_nothing_is_deleted(tmp_path):
    saved_steps(compiled_model(0), tmp_path, (4, 8))
    flip_bytes(tmp_path / "step-000000008")
    flip_bytes(tmp_path / "step-000000004")
    for attempt in range(2):  # and again at the next start
        with pytest.raises(checkpoint.NoIntactCheckpointError,
                           match=r"No checkpoint in .* reads back whole: step 8 "
                                 r"\(TensorBundle at .*Checksum does not match.*\), "
                                 r"moved to corrupt-step-000000008-"):
            checkpoint.recover(str(tmp_path), is_chief=True)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("corrupt-")]) == 2
    assert checkpoint.latest(str(tmp_path)) == (0, None)


def _small_tmpfs(path, size):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mounted.stderr.strip()}): "
                    "needs root")


def test_a_full_disk_is_named_with_the_bytes_needed_and_the_last_good_one_kept(tmp_path):
    disk = tmp_path / "disk"
    _small_tmpfs(disk, "1m")
    try:
        model = compiled_model(0)
        saved_steps(model, disk, (4,))
        # Fill what is left, but for a few hundred bytes.
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * (free - 512))
        with pytest.raises(checkpoint.CheckpointWriteError) as raised:
            checkpoint.save(model, str(disk), 8)
        message = str(raised.value)
        needed = checkpoint.bytes_needed(model)
        assert (f"No space left on device for the checkpoint of step 8 in {disk}: it "
                f"needs about {needed:,} bytes and ") in message, message
        assert "the checkpoint of step 4 stays the one a relaunch resumes from" in message
        assert checkpoint.state(str(disk)) == {"epoch": 4, "step": 4,
                                               "checkpoint": "step-000000004"}
        assert not [p for p in disk.iterdir() if p.name.startswith(".partial-")]
        (disk / "filler").unlink()
        assert checkpoint.recover(str(disk), is_chief=True) == 4
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_missing_newest_checkpoint_resumes_from_the_one_before(tmp_path, caplog):
    saved_steps(compiled_model(0), tmp_path, (4, 8))
    shutil.rmtree(tmp_path / "step-000000008")  # deleted by hand, state.json not
    with caplog.at_level("WARNING"):
        assert checkpoint.recover(str(tmp_path), is_chief=True) == 4
    assert "moved aside to nowhere (step-000000008 is missing)" in caplog.text
    assert checkpoint.latest(str(tmp_path))[0] == 4
