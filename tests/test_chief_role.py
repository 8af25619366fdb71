"""TF_CONFIG with a `chief` job, as Kubeflow's TFJob writes it: the chief is
the one chief, and `worker:0` is an ordinary worker.

Two tfscale-train processes (chief:0, worker:0), each started in
a directory of its own with the same relative --model_dir and --export_dir,
so whatever a process writes lands in its own directory.
"""

import json
import os
import subprocess

import pytest

import multiworker
from multiworker import worker_env

pytestmark = pytest.mark.multiworker


TRAIN = ["tfscale-train", "--model=alexnet_bn_small", "--fc_units=16",
         "--global_batch_size=24", "--epochs=1", "--steps_per_epoch=2",
         "--checkpoint_steps=1", "--model_dir=ckpt",
         "--export_dir=export", "--collective_timeout=120"]
TASKS = [("chief", 0), ("worker", 0)]


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    from tfscale.launch import ports

    tmp = tmp_path_factory.mktemp("chief_role")
    picked = ports.free_ports("127.0.0.1", len(TASKS))
    cluster = {"chief": [f"127.0.0.1:{picked[0]}"],
               "worker": [f"127.0.0.1:{p}" for p in picked[1:]]}
    processes = []
    for job, index in TASKS:
        cwd = tmp / f"{job}-{index}"
        cwd.mkdir()
        config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
        processes.append((cwd, multiworker.popen(
            TRAIN, cwd, worker_env(cwd, {"TF_CONFIG": config}), subprocess.PIPE)))
    outputs = {}
    try:
        for (job, index), (cwd, process) in zip(TASKS, processes, strict=True):
            output, _ = process.communicate(timeout=400)
            assert process.returncode == 0, f"{job}:{index} failed:\n{output[-4000:]}"
            outputs[f"{job}-{index}"] = (cwd, output)
    finally:
        for _, process in processes:
            process.kill()
    return outputs


def test_only_the_chief_task_checkpoints_and_exports(cluster_run):
    writers = sorted(name for name, (cwd, _) in cluster_run.items()
                     if os.listdir(cwd))
    assert writers == ["chief-0"]
    chief_dir = cluster_run["chief-0"][0]
    assert sorted(os.listdir(chief_dir)) == ["ckpt", "export"]


def test_only_the_chief_task_logs_progress(cluster_run):
    for name, (_, output) in cluster_run.items():
        logged = "2 worker(s), global batch 24 (12 per worker)" in output
        exported = "Exported SavedModel to" in output
        assert (logged, exported) == ((True, True) if name == "chief-0" else
                                      (False, False)), name
