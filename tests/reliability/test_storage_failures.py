"""Storage that fails under tfscale-train on 2 workers: a checkpoint with a
few flipped bytes (bit rot on a shared volume) and a disk that fills up
during a checkpoint. Each is named by its cause, never as a lost peer."""

import errno
import shutil
import subprocess
import sys
import time

import pytest

from multiworker import flip_bytes
from multiworker import popen
from multiworker import preloaded
from multiworker import run
from multiworker import saved_step
from multiworker import worker_env

pytestmark = pytest.mark.multiworker

TRAIN = ["tfscale-train", "--model=alexnet_bn_small", "--fc_units=16", "--global_batch_size=32",
         "--steps_per_epoch=4", "--checkpoint_steps=2", "--epochs=2",
         "--export_dir=", "--collective_timeout=120"]


def launch_command(model_dir, extra=()):
    return [sys.executable, "-m", "tfscale.launch.local", "--num_workers=2",
            "--timeout=400", "--preload=tfscale.strategy", "--", *TRAIN,
            f"--model_dir={model_dir}", *extra]


def launch(tmp_path, model_dir):
    return run(preloaded(launch_command(model_dir)), tmp_path, worker_env(tmp_path),
               timeout=460)


def test_a_corrupt_checkpoint_is_moved_aside_and_training_resumes_from_the_one_before(
        tmp_path):
    model_dir = tmp_path / "md"
    first = launch(tmp_path, model_dir)
    assert first.returncode == 0, first.stdout[-5000:]
    assert saved_step(model_dir) == 8
    flip_bytes(model_dir / "step-000000008")

    second = launch(tmp_path, model_dir)  # the same command, relaunched
    assert second.returncode == 0, second.stdout[-5000:]
    (moved,) = [p.name for p in model_dir.iterdir() if p.name.startswith("corrupt-")]
    for worker in (0, 1):  # every worker says so
        said = [l for l in second.stdout.splitlines() if l.startswith(f"[worker {worker}]")
                and f"The checkpoint of step 8 in {model_dir} is corrupt" in l]
        assert said and "Checksum does not match" in said[0], second.stdout[-5000:]
        assert f"moved aside to {moved}" in said[0]
        assert "resuming from the checkpoint of step 6" in said[0]
    assert "Lost contact" not in second.stdout
    assert "Resuming from the checkpoint of step 6" in second.stdout
    assert saved_step(model_dir) == 8
    assert (model_dir / moved / "ckpt.index").exists()  # kept, not deleted


def test_a_full_disk_is_named_with_its_path_and_the_last_good_checkpoint_stays(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mounted.stderr.strip()}): "
                    "needs root")
    try:
        model_dir = disk / "md"
        process = popen(
            preloaded(launch_command(model_dir, ["--steps_per_epoch=40", "--checkpoint_steps=5"])),
            tmp_path, worker_env(tmp_path), subprocess.PIPE)
        deadline = time.monotonic() + 300
        while saved_step(model_dir) < 5 and time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read()[-5000:]
            time.sleep(0.02)
        # The disk fills up: the next checkpoint cannot fit. A checkpoint
        # written since the free space was read takes some of it first; the
        # filler then stops at ENOSPC, and the disk is as full.
        try:
            (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 4096))
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
        kept = saved_step(model_dir)
        output, _ = process.communicate(timeout=300)
        assert process.returncode != 0, output[-5000:]
        lines = [l for l in output.splitlines() if l.startswith("[worker 0]")
                 and "tfscale-train: No space left on device for the checkpoint of "
                 f"step {kept + 5} in {model_dir}: it needs about " in l]
        assert lines, output[-5000:]
        assert (f"the checkpoint of step {kept} stays the one a relaunch resumes from"
                in lines[0])
        assert "Lost contact" not in lines[0]
        assert saved_step(model_dir) == kept
        assert not [p for p in model_dir.iterdir() if p.name.startswith(".partial-")]
        # (Resuming from it once there is space: tests/test_checkpoint.py.)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
