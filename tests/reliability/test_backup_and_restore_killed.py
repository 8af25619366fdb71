"""tfscale.callbacks.BackupAndRestore with 2 workers: TensorFlow's tutorial's
fit, a worker SIGKILLed mid-epoch and the fit relaunched, resumes at the
saved step and ends bitwise equal to a fit never interrupted."""

import pytest
import os
import signal
import subprocess
import sys
import time

import numpy as np

from multiworker import WORKERS_DIR
from multiworker import assert_succeeded
from multiworker import saved_step
from multiworker import started_pid
from multiworker import run_workers
from multiworker import worker_env

pytestmark = pytest.mark.multiworker


SCRIPT = "tutorial_callbacks.py"
STEPS = 16  # 2 epochs of 8 (tests/workers/tutorial_callbacks.py)


def test_a_worker_killed_mid_epoch_resumes_at_the_saved_step(tmp_path):
    straight = run_workers(SCRIPT, 2, tmp_path / "straight",
                           args=[str(tmp_path / "straight-backup"), "tfscale_backup"])
    assert_succeeded(straight)
    assert not (tmp_path / "straight-backup").exists()  # delete_checkpoint=True

    backup = tmp_path / "backup"
    results = tmp_path / "killed-results"
    results.mkdir()
    env = worker_env(results, {"TFSCALE_STEP_SECONDS": "0.4"})
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen(
            # Worker 0 waits for its killed peer where SIGTERM cannot reach
            # it: a short grace before SIGKILL. Fresh workers, as TensorFlow's
            # tutorial starts them; the launcher's line names their pids.
            [sys.executable, "-m", "tfscale.launch.local", "--num_workers=2",
             "--timeout=300", "--grace_seconds=2", "--",
             sys.executable, os.path.join(WORKERS_DIR, SCRIPT), str(backup),
             "tfscale_backup"],
            cwd=str(tmp_path), env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    # Step 9 is saved in the second epoch (8 steps each), where the input's
    # iterator has gone on from the first.
    while saved_step(backup) < 9 and time.monotonic() < deadline:
        assert first.poll() is None, log_path.read_text()[-4000:]
        time.sleep(0.05)
    pid = started_pid(log_path.read_text(), slot=1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    first.wait(timeout=120)
    output = log_path.read_text()
    assert first.returncode != 0, output[-4000:]
    assert "SIGKILL" in output, output[-4000:]
    killed_at = saved_step(backup)
    assert 9 <= killed_at < STEPS and killed_at % 8, "killed too late to test resume"

    resumed = run_workers(SCRIPT, 2, tmp_path / "resumed",
                          args=[str(backup), "tfscale_backup"])
    assert_succeeded(resumed)
    assert not backup.exists()
    for result, reference in zip(resumed.results, straight.results):
        assert result["first_step"] == killed_at
        assert result["trained"] == list(range(killed_at + 1, STEPS + 1))
        assert reference["trained"] == list(range(1, STEPS + 1))
        for kind in ("variables", "optimizer"):
            assert result[kind].keys() == reference[kind].keys()
            for name, value in reference[kind].items():
                np.testing.assert_array_equal(result[kind][name], value, err_msg=name)
