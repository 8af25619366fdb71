"""Preemption: SIGTERM to worker 1 of a 2-worker tfscale-train mid-epoch,
with checkpoints far apart, as Kubernetes evicting its pod would. Every
worker saves the step they agree on and exits with 143 well inside a
30-second grace period; `tfscale-launch --max_restarts=1` relaunches the
job, which resumes at that step and ends with the weights and optimizer
state of a run never interrupted, bit for bit (BatchNorm's moving statistics
within float32 rounding: the save averaged them over the workers)."""

import os
import re
import signal
import sys
import time

import numpy as np
import pytest

from multiworker import checkpoint_variables
from multiworker import pid_alive
from multiworker import popen
from multiworker import preloaded
from multiworker import run_train
from multiworker import started_pid
from multiworker import worker_env

pytestmark = pytest.mark.multiworker

EPOCHS = 3
STEPS_PER_EPOCH = 100  # mid-epoch 2, 0.3 s after it starts, on either CPU kind
GRACE_SECONDS = 30  # Kubernetes' default terminationGracePeriodSeconds


def train_args(model_dir):
    return ["--model=alexnet_bn_small", "--fc_units=32", "--global_batch_size=32",
            f"--epochs={EPOCHS}", f"--steps_per_epoch={STEPS_PER_EPOCH}", "--checkpoint_steps=1000",
            f"--model_dir={model_dir}", "--export_dir="]


def command(model_dir, *launcher_flags):
    # Forked from one import (--preload): the launcher's line names the pids.
    return [sys.executable, "-m", "tfscale.launch.local", "--num_workers=2",
            "--timeout=400", "--grace_seconds=5", "--preload=tfscale.strategy",
            *launcher_flags, "--",
            sys.executable, "-m", "tfscale.launch.train", *train_args(model_dir)]


def wait_for(predicate, what, launcher, log_path, seconds=300):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert launcher.poll() is None and time.monotonic() < deadline, (
            f"{what}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.02)


def test_sigterm_to_one_worker_saves_the_agreed_step_and_the_relaunch_matches(tmp_path):
    env = worker_env(tmp_path)
    # The run never interrupted needs no processes of its own: the reused workers.
    straight = tmp_path / "straight"
    done = run_train(2, tmp_path, train_args(straight), timeout=460)
    assert done.returncode == 0, done.output[-4000:]

    preempted = tmp_path / "preempted"
    log_path = tmp_path / "preempted.log"
    with open(log_path, "w") as log:
        launcher = popen(preloaded(command(preempted, "--max_restarts=1")), tmp_path,
                         env, log)
    try:
        # Mid-epoch 2: the chief announces the epoch when it starts.
        wait_for(lambda: "Epoch 2/3" in log_path.read_text(), "epoch 2 never started",
                 launcher, log_path)
        time.sleep(0.3)
        pid = started_pid(log_path.read_text(), slot=1)
        assert pid, f"no worker 1:\n{log_path.read_text()[-4000:]}"
        signalled = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(pid) or "restart 1 of 1" in log_path.read_text(),
                 "worker 1 did not exit", launcher, log_path, GRACE_SECONDS)
        exited = time.monotonic() - signalled
        launcher.wait(timeout=400)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = log_path.read_text()
    assert launcher.returncode == 0, output[-6000:]
    print(f"worker 1 exited {exited:.1f} s after its SIGTERM")
    assert exited < GRACE_SECONDS

    # Logged at once, with the step it came after.
    got = re.findall(r"\[worker 1\] tfscale: worker 1 got SIGTERM after step (\d+): "
                     r"every worker saves a checkpoint after the next step", output)
    assert len(got) == 1, output[-6000:]
    signalled_at = int(got[0])
    saved = {int(w): int(s) for w, s in re.findall(
        r"\[worker (\d)\] .*tfscale: preempted: 1 worker\(s\) had a SIGTERM; every "
        r"worker saved step (\d+) and exits with code 143", output)}
    assert saved.keys() == {0, 1}, output[-6000:]
    step = saved[0]
    assert saved[1] == step
    # Epoch 2 had begun (on a busy machine its first step may not have ended
    # 0.3 s later: the SIGTERM then comes after step 100); the agreed save is
    # the step after it, inside epoch 2, far from --checkpoint_steps.
    assert STEPS_PER_EPOCH <= signalled_at <= step <= signalled_at + 2, (
        f"SIGTERM after step {signalled_at}, saved step {step}: steps lost")
    assert step < 2 * STEPS_PER_EPOCH
    assert re.search(r"tfscale-launch: worker \d was preempted \(exit code 143: a "
                     r"SIGTERM, after every worker saved the same step\); stopped the "
                     r"other workers; restart 1 of 1", output), output[-6000:]
    resumed = re.findall(r"\[worker 0\] .*Resuming from the checkpoint of step (\d+)",
                         output)
    assert resumed == [str(step)], output[-6000:]

    step_a, straight_vars = checkpoint_variables(straight)
    step_b, preempted_vars = checkpoint_variables(preempted)
    assert step_a == step_b == EPOCHS * STEPS_PER_EPOCH
    assert straight_vars.keys() == preempted_vars.keys()
    moving = [n for n in straight_vars if "/moving_" in n]
    assert moving
    for name, value in straight_vars.items():
        if name in moving:
            # Every save averages BatchNorm's moving statistics over the
            # workers, the preemption's save too (the uninterrupted run made
            # none at that step): equal in exact arithmetic, not in float32.
            np.testing.assert_allclose(preempted_vars[name], value, rtol=1e-6,
                                       atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(preempted_vars[name], value, err_msg=name)
