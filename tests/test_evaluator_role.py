"""TF_CONFIG with an `evaluator` job, as Kubeflow's TFJob writes it: two
workers train while the evaluator evaluates their checkpoints.

Three tfscale-train processes (`python -m tfscale.launch.train`) with the same flags:
the evaluator, started first (it waits for checkpoints), then worker:0 and
worker:1, whose TF_CONFIG also names the evaluator. Checkpoints every 4 of 10
steps: the last one is the one written at the end of training.
"""

import glob
import os
import re
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from multiworker import cluster_tf_configs
from multiworker import run
from multiworker import start_process
from multiworker import worker_env

pytestmark = pytest.mark.multiworker


EPOCHS, STEPS_PER_EPOCH = 2, 5
FINAL_STEP = EPOCHS * STEPS_PER_EPOCH
FC_UNITS = 16
TRAIN = [sys.executable, "-m", "tfscale.launch.train", "--model=alexnet_bn_small",
         "--fc_units=16", "--global_batch_size=32",
         f"--epochs={EPOCHS}", f"--steps_per_epoch={STEPS_PER_EPOCH}",
         "--learning_rate=0.01", "--checkpoint_steps=4", "--model_dir=ckpt", "--export_dir=export",
         "--tensorboard_dir=tb", "--collective_timeout=120"]
TASKS = [("evaluator", 0), ("worker", 0), ("worker", 1)]
EVALUATED = re.compile(r"Evaluation of the checkpoint of step (\d+) of (\d+): "
                       r"accuracy=([\d.]+), loss=")
EXPORTED = re.compile(r"accuracy on the full 360-image test split: ([\d.]+)")


def wait_for_line(path, text, process, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert process.poll() is None, f"exited early:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {path} within {timeout} s")


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluator_role")
    configs = dict(zip(TASKS, cluster_tf_configs(TASKS), strict=True))
    logs = {task: f"{task[0]}-{task[1]}.log" for task in TASKS}
    processes = {}
    try:
        evaluator = ("evaluator", 0)
        processes[evaluator] = start_process(TRAIN, tmp, logs[evaluator],
                                             configs[evaluator])
        # Ready and waiting before training writes anything.
        wait_for_line(tmp / logs[evaluator], "Evaluator: evaluating the checkpoints",
                      processes[evaluator])
        for task in TASKS[1:]:
            processes[task] = start_process(TRAIN, tmp, logs[task], configs[task])
        for task, process in processes.items():
            returncode = process.wait(timeout=300)
            assert returncode == 0, (
                f"{task} failed:\n{(tmp / logs[task]).read_text()[-4000:]}")
    finally:
        for process in processes.values():
            process.kill()
    return tmp, {task: (tmp / log).read_text() for task, log in logs.items()}


def evaluations(output):
    return [(int(step), int(final), accuracy)
            for step, final, accuracy in EVALUATED.findall(output)]


def test_evaluator_evaluates_checkpoints_until_the_last_and_exits(cluster_run):
    _, outputs = cluster_run
    found = evaluations(outputs["evaluator", 0])
    steps = [step for step, _, _ in found]
    assert len(steps) >= 2 and steps == sorted(set(steps)), steps
    assert steps[-1] == FINAL_STEP and all(f == FINAL_STEP for _, f, _ in found)
    assert "Evaluated training's last checkpoint" in outputs["evaluator", 0]
    # The evaluator neither trained nor exported; the workers evaluated nothing.
    assert "Exported SavedModel" not in outputs["evaluator", 0]
    assert "2 worker(s), global batch 32 (16 per worker)" in outputs["worker", 0]
    assert not evaluations(outputs["worker", 0] + outputs["worker", 1])


def test_last_evaluation_equals_the_exported_models_accuracy(cluster_run):
    tmp, outputs = cluster_run
    printed = EXPORTED.findall(outputs["worker", 0])
    assert len(printed) == 1, outputs["worker", 0][-3000:]
    assert evaluations(outputs["evaluator", 0])[-1][2] == printed[0]
    # Exactly, not only to 4 decimals: Keras's accuracy is the float32
    # quotient of the correct count by 360, written to TensorBoard below.
    from tfscale import data
    from tfscale import export

    images, labels = data.digits_arrays("test")
    served = export.served_probabilities(str(tmp / "export"), images)
    # Not a model that answers one class whatever the image.
    assert len(set(served.argmax(axis=1))) >= 3, np.bincount(served.argmax(axis=1))
    exported_accuracy = np.mean(served.argmax(axis=1) == labels)
    scalars = eval_scalars(tmp / "tb")
    assert scalars["accuracy"][FINAL_STEP] == np.float32(exported_accuracy)


def test_last_checkpoint_holds_the_exported_weights_and_batch_norm_statistics(
        cluster_run):
    from tfscale import models
    from tfscale import checkpoint

    tmp, _ = cluster_run
    step, prefix = checkpoint.latest(str(tmp / "ckpt"))
    assert step == FINAL_STEP
    model = models.get("alexnet_bn_small", num_classes=10, input_shape=(8, 8, 1),
                       fc_units=FC_UNITS)
    checkpoint.restore_model(model, prefix)
    exported = {v.name.split(":")[0]: v.numpy()
                for v in tf.saved_model.load(str(tmp / "export")).variables}
    missing = [v.path for v in model.weights if v.path not in exported]
    assert not missing, sorted(exported)
    assert sum(v.path.endswith(("moving_mean", "moving_variance"))
               for v in model.weights) == 6  # 3 BatchNorm layers
    for variable in model.weights:
        np.testing.assert_array_equal(variable.numpy(), exported[variable.path],
                                      err_msg=variable.path)


def test_evaluation_metrics_are_tensorboard_scalars_at_the_checkpoint_steps(
        cluster_run):
    tmp, outputs = cluster_run
    scalars = eval_scalars(tmp / "tb")
    steps = [step for step, _, _ in evaluations(outputs["evaluator", 0])]
    assert sorted(scalars) == ["accuracy", "loss"]
    assert sorted(scalars["accuracy"]) == sorted(scalars["loss"]) == steps


def eval_scalars(tensorboard_dir):
    """{tag: {step: value}} of the evaluator's event files (tb/eval)."""
    scalars = {}
    for path in glob.glob(str(tensorboard_dir / "eval" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = float(
                    tf.make_ndarray(value.tensor))
    return scalars


@pytest.mark.parametrize("flags, message", [
    (["--model_dir="], "The evaluator needs --model_dir: the training job's "
     "checkpoint directory"),
    (["--dataset=synthetic", "--steps_per_epoch=1"],
     "--dataset=synthetic has no evaluation split for the evaluator"),
])
def test_evaluator_without_checkpoints_or_eval_split_is_refused(tmp_path, flags,
                                                                 message):
    process = run_evaluator(tmp_path, flags)
    assert process.returncode != 0
    assert message in process.stdout, process.stdout[-3000:]
    assert os.listdir(tmp_path) == []


def test_evaluator_refuses_checkpoints_trained_with_other_flags(tmp_path):
    from tfscale import recipes

    model_dir = tmp_path / "ckpt"
    recipes.write_settings(str(model_dir), recipes.Settings(learning_rate=0.5),
                           model="alexnet_bn_small")
    (model_dir / "state.json").write_text(
        '{"step": 5, "checkpoint": "step-000000005"}')
    process = run_evaluator(tmp_path, [])
    assert process.returncode != 0
    assert ("The checkpoints in ckpt were trained with other flags than the "
            "evaluator's; start the evaluator with the training job's command:"
            ) in process.stdout, process.stdout[-3000:]
    assert "learning_rate: 0.5 saved, 0.01 now" in process.stdout


def test_evaluator_gives_up_after_its_timeout_without_a_checkpoint(tmp_path):
    process = run_evaluator(tmp_path, ["--evaluator_timeout=1"])
    assert process.returncode != 0
    assert ("tfscale-train: No new checkpoint in ckpt for 1 s (none has been "
            "written yet): training has stopped, or writes checkpoints further "
            "apart than the timeout. If training is still running, raise "
            "--evaluator_timeout (now 1 s).") in process.stdout, process.stdout[-3000:]


def run_evaluator(tmp_path, flags):
    config = cluster_tf_configs(TASKS)[0]
    return run(TRAIN + flags, tmp_path, worker_env(tmp_path, {"TF_CONFIG": config}),
               timeout=120)
