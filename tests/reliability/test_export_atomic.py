"""An export killed midway leaves the previous export intact and loadable."""

import pytest
import os
import signal
import subprocess
import time

import numpy as np
import tensorflow as tf

import multiworker
from multiworker import worker_env

pytestmark = pytest.mark.multiworker


TRAIN = ["tfscale-train", "--model=alexnet_bn_small", "--fc_units=16",
         "--global_batch_size=32", "--epochs=1", "--steps_per_epoch=2"]


def serve(path):
    images = np.arange(2 * 64, dtype=np.uint8).reshape(2, 8, 8, 1)
    signature = tf.saved_model.load(str(path)).signatures["serving_default"]
    return signature(images=tf.constant(images))["probabilities"].numpy()


def test_killed_export_keeps_the_previous_one(tmp_path):
    export = tmp_path / "export"
    env = worker_env(tmp_path)
    first = multiworker.run(TRAIN + [f"--export_dir={export}"], tmp_path, env, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:]
    before = serve(export)

    second = multiworker.popen(TRAIN + [f"--export_dir={export}", "--seed=1"],
                               tmp_path, env, subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and second.poll() is None:
        if any(".partial-" in p for p in os.listdir(tmp_path)):
            second.send_signal(signal.SIGKILL)  # midway through writing
            break
        time.sleep(0.005)
    second.wait()
    assert second.returncode == -signal.SIGKILL, "the export finished before the kill"
    np.testing.assert_array_equal(serve(export), before)
