"""Bad input is refused at start: a clear error, a non-zero exit, nothing written."""

import json
import subprocess

import pytest

import multiworker
from multiworker import worker_env

pytestmark = pytest.mark.multiworker



def train(tmp_path, *flags, tf_config=None, timeout=180):
    env = worker_env(tmp_path)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    before = set(p.name for p in tmp_path.iterdir())
    process = multiworker.run(
        ["tfscale-train", "--epochs=1", "--steps_per_epoch=1", "--fc_units=8",
         f"--export_dir={tmp_path / 'export'}", f"--model_dir={tmp_path / 'model'}",
         *flags],
        tmp_path, env, timeout=timeout)
    assert process.returncode != 0
    assert set(p.name for p in tmp_path.iterdir()) == before, "something was written"
    return process.stdout


TWO = ["127.0.0.1:1", "127.0.0.1:2"]


@pytest.mark.parametrize("tf_config, message", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    (json.dumps({"task": {"type": "worker", "index": 0}}),
     'TF_CONFIG needs a "cluster" object'),
    (json.dumps({"cluster": {"worker": TWO}, "task": {"type": "chief", "index": 0}}),
     'TF_CONFIG "task" must name a job of the cluster (worker)'),
    (json.dumps({"cluster": {"worker": TWO}, "task": {"type": "worker", "index": 2}}),
     "TF_CONFIG task index must be an integer in [0, 2) for the 2 \"worker\" "
     "addresses. Received: index=2"),
    (json.dumps({"cluster": {"worker": ["nohostport"]},
                 "task": {"type": "worker", "index": 0}}),
     'TF_CONFIG cluster "worker" must be a list of "host:port" strings'),
])
def test_malformed_tf_config(tmp_path, tf_config, message):
    assert message in train(tmp_path, tf_config=tf_config)


@pytest.mark.parametrize("flag, message", [
    ("--model=vgg", "--model='vgg' is unknown. Known: alexnet_bn, alexnet_bn_small, resnet50"),
    ("--dataset=cifar", "--dataset='cifar' is unknown. Known: digits, fashion_mnist, imagenet, synthetic"),
    ("--global_batch_size=2000", "'train' split has 1437 examples, fewer than one "
     "global batch. Received: global_batch_size=2000"),
])
def test_unknown_names_and_impossible_batches(tmp_path, flag, message):
    assert message in train(tmp_path, flag)


def test_missing_imagenet_archives_are_named(tmp_path):
    output = train(tmp_path, "--dataset=imagenet", f"--data_dir={tmp_path / 'tfds'}",
                   f"--manual_dir={tmp_path / 'nowhere'}")
    assert "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar" in output
    assert "--manual_dir" in output


@pytest.mark.parametrize("flag", ["export_dir", "model_dir"])
def test_unwritable_directories(tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    output = train(tmp_path, f"--{flag}={blocker / 'sub'}")
    assert f"--{flag} cannot be written: {blocker} is not a writable directory" in output


def test_bad_input_found_after_start_up_is_one_line_on_every_worker(tmp_path):
    """As a new user tries it: a global batch larger than the training split."""
    process = subprocess.run(
        ["tfscale-launch", "--num_workers=3", "--timeout=240", "--",
         "tfscale-train", "--global_batch_size=2000",
         f"--export_dir={tmp_path / 'export'}", f"--model_dir={tmp_path / 'model'}"],
        cwd=tmp_path, env=worker_env(tmp_path), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert process.returncode not in (0, 124), process.stdout[-4000:]
    assert "Traceback" not in process.stdout, process.stdout[-4000:]
    message = ("tfscale-train: The 'train' split has 1437 examples, fewer than "
               "one global batch. Received: global_batch_size=2000; use at most 1437.")
    for index in range(3):
        lines = [line for line in process.stdout.splitlines()
                 if line.startswith(f"[worker {index}]") and "tfscale-train:" in line]
        assert [line.split("] ", 1)[1] for line in lines] == [message], (
            index, process.stdout[-4000:])
    assert not (tmp_path / "export").exists() and not (tmp_path / "model").exists()
