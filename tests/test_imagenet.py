"""tfscale-train --dataset=imagenet on 3 workers, from archives in the real
ILSVRC2012 layout, as a user's first run: prepared once while the others
wait, read on more workers than files, trained and evaluated, a worker killed
and the job resumed (tfscale-launch --max_restarts), then exported."""

import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from tfscale.launch.studies import imagenet_archives
from multiworker import started_pid
from multiworker import saved_step
from multiworker import worker_env

pytestmark = pytest.mark.multiworker



@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imagenet")
    imagenet_archives.write(str(tmp / "manual"), num_validation=12, train_per_synset=6)
    command = [
        # Fresh workers, so a killed fresh worker's relaunch stays tested
        # (preemption and automatic restart fork theirs).
        "tfscale-launch", "--num_workers=3", "--timeout=500", "--max_restarts=1",
        # The survivors wait in a collective with the killed worker: 2 s, not 10.
        "--grace_seconds=2",
        "--", "tfscale-train", "--dataset=imagenet", f"--data_dir={tmp / 'data'}",
        f"--manual_dir={tmp / 'manual'}", "--model=alexnet_bn_small", "--image_size=32",
        "--fc_units=16",
        "--global_batch_size=8", "--epochs=2", "--steps_per_epoch=4",
        "--checkpoint_steps=2", f"--model_dir={tmp / 'model'}",
        f"--export_dir={tmp / 'export'}"]
    log = tmp / "launch.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(command, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                                    env=worker_env(tmp))
        deadline = time.monotonic() + 400
        while saved_step(tmp / "model") < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, log.read_text()[-6000:]
            time.sleep(0.2)
        killed_at = saved_step(tmp / "model")
        victim = started_pid(log.read_text(), slot=2)
        if victim is None:
            launcher.kill()
            pytest.fail(f"no worker of slot 2:\n{log.read_text()[-6000:]}")
        os.kill(victim, signal.SIGKILL)
        launcher.wait(timeout=500)
    output = log.read_text()
    assert launcher.returncode == 0, output[-6000:]
    return tmp, output, killed_at


def test_the_first_run_prepares_once_while_the_others_wait(run):
    tmp, output, _ = run
    preparing = [l for l in output.splitlines() if "Preparing ImageNet in" in l]
    assert len(preparing) == 1 and preparing[0].startswith("[worker 0]"), preparing
    indexed = [l for l in output.splitlines() if "records of ImageNet in" in l]
    assert len(indexed) == 2 and all(l.startswith("[worker 0]") for l in indexed)
    folder = tmp / "data" / "imagenet2012"
    assert [d for d in os.listdir(folder) if d.startswith("incomplete.")] == []
    # One TFRecord file per split, read by 3 workers: more workers than files.
    (prepared,) = os.listdir(folder)
    files = os.listdir(folder / prepared)
    assert len([f for f in files if "train.tfrecord-" in f]) == 1, files


def test_three_workers_train_evaluate_and_resume_after_a_kill(run):
    _, output, killed_at = run
    assert "3 worker(s), global batch 8 (2-3 per worker)" in output
    assert "tfscale-launch: worker 2 was killed by SIGKILL" in output, output[-3000:]
    resumed = re.findall(r"Resuming from the checkpoint of step (\d+)", output)
    assert resumed and int(resumed[0]) >= killed_at, output[-3000:]
    epoch_ends = [l for l in output.splitlines() if "val_loss" in l]
    assert epoch_ends and all(l.startswith("[worker 0]") for l in epoch_ends)


def test_the_export_serves_imagenet_images(run):
    tmp, output, _ = run
    assert f"Exported SavedModel to {tmp / 'export'}" in output
    import tensorflow as tf

    serve = tf.saved_model.load(str(tmp / "export")).signatures["serving_default"]
    images = np.random.default_rng(0).integers(0, 256, (2, 90, 70, 3), dtype=np.uint8)
    probabilities = serve(images=tf.constant(images))["probabilities"].numpy()
    assert probabilities.shape == (2, 1000)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-4)
