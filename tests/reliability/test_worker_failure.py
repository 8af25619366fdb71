"""A worker killed or hung mid-epoch: no hang, the lost worker named, no orphans."""

import os
import signal
import subprocess
import time
import uuid

import pytest

from multiworker import pids_with_env
from multiworker import start_cluster
from multiworker import started_pid
from multiworker import worker_env

pytestmark = pytest.mark.multiworker


COLLECTIVE_TIMEOUT = 30  # seconds
# TensorFlow's own heartbeat timeout. Measured (2026-11-28): the survivor
# stopped 10 s after its peer's SIGKILL or SIGSTOP; under tfscale's default,
# 60 s, after 43 s (SIGKILL) and 32 s (SIGSTOP: the collective timeout).
HEARTBEAT_TIMEOUT = 10
TRAIN = ["tfscale-train", "--model=alexnet_bn_small", "--fc_units=32",
         "--global_batch_size=32", "--epochs=50", "--steps_per_epoch=20",
         f"--collective_timeout={COLLECTIVE_TIMEOUT}",
         f"--heartbeat_timeout={HEARTBEAT_TIMEOUT}", "--export_dir="]


def wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def training_started(log_path):
    return lambda: log_path.exists() and "Epoch 1/" in log_path.read_text()


def test_launcher_names_the_killed_worker_and_leaves_no_orphans(tmp_path):
    marker = f"TFSCALE_RUN={uuid.uuid4().hex}"
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            # Forked from one import: the preload process, holding the
            # marker too, must be gone with the rest.
            ["tfscale-launch", "--num_workers=2", "--timeout=300",
             "--preload=tfscale.strategy", "--", *TRAIN],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
            env=worker_env(tmp_path, dict([marker.split("=")])),
        )
        wait_for(training_started(log), 240, "training to start")
        pid = started_pid(log.read_text(), slot=1)
        assert pid, log.read_text()[-4000:]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        launcher.wait(timeout=120)
    assert launcher.returncode != 0
    assert time.monotonic() - killed_at < 60
    assert "tfscale-launch: worker 1 was killed by SIGKILL" in log.read_text()
    wait_for(lambda: not pids_with_env(marker), 10, "no process of the run left")


@pytest.mark.parametrize("failure", ["SIGKILL", "SIGSTOP"])
def test_survivor_stops_within_the_collective_timeout_naming_the_lost_worker(
        tmp_path, failure):
    # Without the launcher, nothing stops the survivor but tfscale itself: a
    # dead peer (SIGKILL) or a hung one (SIGSTOP: the connection stays open
    # and nothing answers); TensorFlow's heartbeats notice both (measured
    # 10 s, HEARTBEAT_TIMEOUT above), and the collective timeout bounds it.
    marker = f"TFSCALE_RUN={uuid.uuid4().hex}"
    processes = start_cluster([TRAIN, TRAIN], tmp_path, dict([marker.split("=")]))
    try:
        wait_for(training_started(tmp_path / "worker-0.log"), 240, "training to start")
        victim = processes[1]
        os.kill(victim.pid, getattr(signal, failure))
        start = time.monotonic()
        survivor = processes[0]
        try:  # waits past the timeout, so a late exit fails on its duration
            survivor.wait(timeout=COLLECTIVE_TIMEOUT + 60)
        except subprocess.TimeoutExpired:
            pass
        elapsed = time.monotonic() - start
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    output = (tmp_path / "worker-0.log").read_text()
    print(f"{failure}: survivor exited {elapsed:.1f} s after the failure")
    assert survivor.returncode not in (0, -signal.SIGKILL), output[-3000:]
    assert elapsed < COLLECTIVE_TIMEOUT, output[-3000:]
    assert "tfscale-train: Lost contact with worker 1 (" in output, output[-3000:]
    assert f"--collective_timeout={COLLECTIVE_TIMEOUT} s" in output
    assert f"--heartbeat_timeout={HEARTBEAT_TIMEOUT} s" in output
