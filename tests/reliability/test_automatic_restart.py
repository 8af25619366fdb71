"""Automatic restart: `tfscale-launch --max_restarts=3` carries one
tfscale-train run through a worker killed with SIGKILL at 3 random moments;
it loses no checkpointed step and ends with the weights of a run never
interrupted, bit for bit."""

import pytest
import os
import random
import re
import signal
import sys
import time

import numpy as np

from multiworker import checkpoint_variables
from multiworker import popen
from multiworker import preloaded
from multiworker import run_train
from multiworker import saved_step
from multiworker import started_pid
from multiworker import worker_env

pytestmark = pytest.mark.multiworker


EPOCHS = 2
STEPS_PER_EPOCH = 12
CHECKPOINT_STEPS = 2
# Each kill comes once the checkpoint step reaches a random target in its
# range (and the relaunched run has checkpointed since), then a random
# fraction of a step later.
KILL_RANGES = [(2, 5), (8, 12), (15, 18)]


def train_args(model_dir):
    return ["--fc_units=32", "--global_batch_size=32", f"--epochs={EPOCHS}",
            f"--steps_per_epoch={STEPS_PER_EPOCH}",
            f"--checkpoint_steps={CHECKPOINT_STEPS}", f"--model_dir={model_dir}",
            "--export_dir="]


def command(model_dir, *launcher_flags):
    # Forked from one import (--preload): the launcher's line names the pids.
    return [sys.executable, "-m", "tfscale.launch.local", "--num_workers=2", "--timeout=400",
            "--grace_seconds=2", "--preload=tfscale.strategy", *launcher_flags, "--",
            sys.executable, "-m", "tfscale.launch.train", *train_args(model_dir)]


def test_a_run_with_3_workers_killed_at_random_restarts_and_matches_an_uninterrupted_one(
        tmp_path):
    env = worker_env(tmp_path)
    # The run never interrupted needs no processes of its own: the reused workers.
    straight = tmp_path / "straight"
    done = run_train(2, tmp_path, train_args(straight), timeout=460)
    assert done.returncode == 0, done.output[-4000:]

    seed = int(os.environ.get("TFSCALE_CHAOS_SEED", random.randrange(2**32)))
    print(f"chaos seed: {seed} (rerun with TFSCALE_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    chaos = tmp_path / "chaos"
    log_path = tmp_path / "chaos.log"
    with open(log_path, "w") as log:
        launcher = popen(preloaded(command(chaos, "--max_restarts=3")), tmp_path, env, log)
    try:
        kills = []  # (slot killed, checkpoint step seen just before)
        deadline = time.monotonic() + 400
        for restart, (low, high) in enumerate(KILL_RANGES):
            # Launch `restart` is under way once the launcher announced it;
            # the old workers are gone then, so a newer checkpoint is its own.
            while f"restart {restart} of 3" not in log_path.read_text() and restart:
                assert launcher.poll() is None, log_path.read_text()[-4000:]
                time.sleep(0.05)
            base = saved_step(chaos)
            target = max(rng.randint(low, high), base + CHECKPOINT_STEPS)
            while saved_step(chaos) < target:
                assert launcher.poll() is None and time.monotonic() < deadline, (
                    f"the run ended or stalled before kill {restart + 1} "
                    f"(target step {target}):\n{log_path.read_text()[-4000:]}")
                time.sleep(0.05)
            time.sleep(rng.uniform(0, 1.0))  # up to ~2 steps: between checkpoints
            slot = rng.randrange(2)
            pid = started_pid(log_path.read_text(), slot, restart)
            assert pid, f"no worker of slot {slot} in launch {restart}"
            seen = saved_step(chaos)
            os.kill(pid, signal.SIGKILL)
            kills.append((slot, seen))
        launcher.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = log_path.read_text()
    assert launcher.returncode == 0, output[-6000:]

    restarts = re.findall(r"tfscale-launch: worker (\d) was killed by SIGKILL; stopped "
                          r"the other workers; restart (\d) of 3 on fresh ports\.", output)
    assert restarts == [(str(slot), str(k + 1)) for k, (slot, _) in enumerate(kills)]
    resumed = [int(s) for s in re.findall(
        r"\[worker 0\] .*Resuming from the checkpoint of step (\d+)", output)]
    print(f"killed (slot, checkpoint step seen): {kills}; resumed at steps {resumed}")
    assert len(resumed) == 3
    for (_, seen), step in zip(kills, resumed):
        assert step >= seen, "a checkpointed step was lost"

    step_a, straight_vars = checkpoint_variables(straight)
    step_b, chaos_vars = checkpoint_variables(chaos)
    assert step_a == step_b == EPOCHS * STEPS_PER_EPOCH
    assert straight_vars.keys() == chaos_vars.keys()
    # Optimizer slots (momentum), its step count and the RNG of alexnet_bn's
    # Dropout are saved too (BatchNorm's moving statistics are weights).
    assert len([n for n in straight_vars if n.startswith("optimizer/_variables/")]) > 2
    assert any(n.startswith("optimizer/_iterations") for n in straight_vars)
    assert any(n.startswith("seed_states/") for n in straight_vars)
    for name, value in straight_vars.items():
        np.testing.assert_array_equal(chaos_vars[name], value, err_msg=name)
    assert not [p for p in os.listdir(chaos) if p.startswith(".partial")]
