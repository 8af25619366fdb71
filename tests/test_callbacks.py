"""tfscale.callbacks in one process: what each adds to the logs or records."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale import callbacks


def fit(callback_list, x=None, steps=3):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    if x is None:
        x = np.ones((8 * steps, 4), "float32")
    y = np.zeros((len(x), 2), "float32")
    return model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                     callbacks=callback_list)


def test_step_timer_records_every_step():
    timer = callbacks.StepTimer()
    fit([timer], steps=3)
    assert len(timer.step_seconds) == 3
    assert all(s > 0 for s in timer.step_seconds)
    assert timer.exposed_communication_seconds == []  # no strategy given


def test_throughput_adds_images_per_second_to_the_epoch_logs():
    history = fit([callbacks.Throughput(global_batch_size=8)], steps=4)
    assert history.history["images_per_second"][0] > 0


def test_terminate_on_non_finite_loss_raises_at_the_step():
    x = np.ones((24, 4), "float32")
    x[8] = np.nan  # the second batch
    callback = callbacks.TerminateOnNonFiniteLoss()
    assert isinstance(callback, keras.callbacks.TerminateOnNaN)
    with pytest.raises(callbacks.NonFiniteLossError,
                       match=r"The loss \(averaged over all workers\) is nan at step 2; "
                             r"training stopped\."):
        fit([callback], x=x)


def test_tensorboard_scalars_writes_each_scalar_per_step(tmp_path):
    fit([callbacks.TensorBoardScalars(str(tmp_path), global_batch_size=8)], steps=3)
    tags = {}
    for path in glob.glob(str(tmp_path / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    assert tags["learning_rate"] == [1, 2, 3]
    assert tags["loss"] == [1, 2, 3]
    assert tags["images_per_second"] == [2, 3]  # from the time between steps
