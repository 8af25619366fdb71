"""Elastic resume: a checkpoint written by 3 workers resumes on 2 (same global
batch) at the same step, on the same global batches, and ends where the
uninterrupted 3-worker run ends, within float32 rounding; `tfscale-launch
--min_workers` drops a slot that keeps failing and finishes on the others."""

import pytest
import json
import os
import re
import sys

import numpy as np

from multiworker import WORKERS_DIR
from multiworker import assert_succeeded
from multiworker import preloaded
from multiworker import run
from multiworker import run_workers
from multiworker import saved_step
from multiworker import worker_env

pytestmark = pytest.mark.multiworker


STEPS = 40
SAVE_AT = 20


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(np.asarray(a[n]) - np.asarray(b[n])))) for n in a)


def test_a_checkpoint_of_3_workers_resumes_on_2_and_matches_the_3_worker_run(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    # Uninterrupted on 3 workers; the chief checkpoints step SAVE_AT on the way.
    three = run_workers("elastic_resume.py", 3, tmp_path,
                        args=[str(checkpoints), str(STEPS), str(SAVE_AT)])
    assert_succeeded(three)
    # Resumed from that checkpoint on 2 workers.
    two = run_workers("elastic_resume.py", 2, tmp_path,
                      args=[str(checkpoints), str(STEPS), "-1"])
    assert_succeeded(two)

    reference = three.results[0]
    assert [r["num_workers"] for r in three.results + two.results] == [3] * 3 + [2] * 2
    assert reference["start_step"] == 0 and reference["final_step"] == STEPS
    for resumed in two.results:
        assert resumed["start_step"] == SAVE_AT and resumed["final_step"] == STEPS
    assert two.results[0]["variables"] == two.results[1]["variables"]
    difference = max_difference(reference["variables"], two.results[0]["variables"])
    print(f"max |3-worker - (3->2 resumed)| over all weights after {STEPS} steps: "
          f"{difference:.3g}")
    # Same examples per step, summed in another order: float32 rounding only.
    # (Resumed one batch off in the data, the weights end up to 0.11 apart.)
    for name, value in reference["variables"].items():
        np.testing.assert_allclose(two.results[0]["variables"][name], value,
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_slot_that_keeps_failing_is_dropped_and_training_finishes_on_2_workers(
        tmp_path):
    model_dir = tmp_path / "model"
    train = ["--model=alexnet_bn_small", "--fc_units=32", "--global_batch_size=24", "--epochs=1",
             "--steps_per_epoch=14", "--checkpoint_steps=2", f"--model_dir={model_dir}",
             "--export_dir="]
    done = run(preloaded(
        [sys.executable, "-m", "tfscale.launch.local", "--num_workers=3", "--timeout=400",
         "--grace_seconds=2", "--max_restarts=3", "--min_workers=2",
         "--preload=tfscale.strategy", "--",  # one preload process for all three launches
         sys.executable, os.path.join(WORKERS_DIR, "flaky_slot_train.py"),
         "2", str(model_dir), "4", "--", *train]),
        tmp_path, worker_env(tmp_path), timeout=460)
    output = done.stdout
    assert done.returncode == 0, output[-6000:]
    died_at = int(re.search(r"\[worker 2\] slot 2: dying after the checkpoint of step "
                            r"(\d+)", output).group(1))
    # The launcher's lines about failed workers (not where they run).
    lines = [l for l in output.splitlines() if l.startswith("tfscale-launch: worker ")]
    assert lines[0] == ("tfscale-launch: worker 2 was killed by SIGKILL; stopped the "
                        "other workers; restart 1 of 3 on fresh ports.")
    assert re.fullmatch(
        r"tfscale-launch: worker 2 exited with code 1; stopped the other workers; "
        r"dropping worker slot 2 \(failed again [\d.]+ s after restart 1\); "
        r"continuing with 2 workers: restart 2 of 3 on fresh ports\.", lines[1])
    assert len(lines) == 2, lines
    # The 3 workers' checkpoint resumes on 2 (restart 1 never got as far as
    # training): the worker count is not among the settings a resume keeps.
    trained = re.findall(r"\[worker 0\] .*Training alexnet_bn_small on digits: (\d) "
                         r"worker\(s\), global batch 24 \((\d+) per worker\)", output)
    assert trained == [("3", "8"), ("2", "12")]
    saved = json.loads((model_dir / "settings.json").read_text())
    assert not [k for part in saved.values() for k in part if "worker" in k], saved
    step = int(re.findall(r"\[worker 0\] .*Resuming from the checkpoint of step (\d+)",
                          output)[-1])
    assert step >= died_at >= 4
    assert saved_step(model_dir) == 14
