"""tfscale-train end to end: real workers, chief-only progress, served export."""

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import multiworker
from skips import needs_fashion_mnist

pytestmark = pytest.mark.multiworker

SMALL = ["--fc_units=32", "--global_batch_size=32", "--steps_per_epoch=4"]


def run(command, cwd, timeout=400):
    """`command` with its output as text: tfscale-train, or tfscale-launch
    with `--preload=tfscale.strategy`, as processes of its own
    (`multiworker.run`, `multiworker.preloaded`), another tfscale-launch as
    a fresh one."""
    env = multiworker.worker_env(cwd)
    if command[0] == "tfscale-train":
        return multiworker.run(command, cwd, env, timeout)
    if "--preload=tfscale.strategy" in command:
        return multiworker.run(multiworker.preloaded(command), cwd, env, timeout)
    return subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tfscale-train on 2 workers, in reused worker processes."""
    tmp = tmp_path_factory.mktemp("train")
    process = multiworker.run_train(
        2, tmp, ["--epochs=2", *SMALL, f"--export_dir={tmp / 'export'}"], timeout=400)
    assert process.returncode == 0, process.output[-6000:]
    return tmp, process.output


def test_only_the_chief_reports_progress_each_epoch(trained):
    _, output = trained
    lines = output.splitlines()
    epochs = [l for l in lines if "Epoch " in l and "/2" in l]
    assert epochs and all(l.startswith("[worker 0]") for l in epochs)
    per_epoch = [l for l in lines if "images_per_second" in l]
    assert len(per_epoch) == 2 and all(l.startswith("[worker 0]") for l in per_epoch)
    assert all(" loss: " in l and " accuracy: " in l for l in per_epoch)
    compute = [l for l in lines if "Compute per step (median, epoch " in l]
    assert len(compute) == 2 and all(l.startswith("[worker 0]") for l in compute)
    assert all(re.search(r"worker 0 [0-9.e-]+ s, worker 1 [0-9.e-]+ s; ", l)
               for l in compute), compute
    assert "2 worker(s), global batch 32 (16 per worker)" in output


def test_chief_exports_a_savedmodel_that_serves_the_trained_model(trained):
    tmp, output = trained
    # The chief compares the served classes with its in-process model's.
    printed = re.search(
        rf"Exported SavedModel to {re.escape(str(tmp / 'export'))}; it serves the "
        r"trained model's predictions, and its accuracy on the full 360-image "
        r"test split: ([0-9.]+)", output)
    assert printed, output[-3000:]
    assert not [p for p in os.listdir(tmp) if ".partial-" in p or ".previous-" in p]
    from tfscale import data

    images, labels = data.digits_arrays("test")
    np.save(tmp / "images.npy", images)
    # A fresh process, without TF_CONFIG or tfscale: what a serving user does.
    script = f"""
import json, numpy as np, tensorflow as tf

serve = tf.saved_model.load({str(tmp / 'export')!r}).signatures["serving_default"]
images = np.load({str(tmp / 'images.npy')!r})
probabilities = serve(images=tf.constant(images))["probabilities"].numpy()
spec = serve.structured_input_signature[1]["images"]
print(json.dumps({{"classes": probabilities.argmax(1).tolist(),
                  "sums": probabilities.sum(1).tolist(),
                  "dtype": spec.dtype.name, "input": spec.shape.as_list()}}))
"""
    process = run([sys.executable, "-c", script], cwd=tmp)
    assert process.returncode == 0, process.stdout
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "uint8" and result["input"] == [None, 8, 8, 1]
    np.testing.assert_allclose(result["sums"], 1, atol=1e-5)
    accuracy = np.mean(np.array(result["classes"]) == labels)
    assert f"{accuracy:.4f}" == printed.group(1)


def write_fashion_mnist_head(directory, train, test):
    """The first `train` and `test` images of the real Fashion-MNIST files,
    written as the same four IDX files: the workers read them as they read
    the whole set (tests/test_fashion_mnist.py reads the whole set), and
    evaluating and checking the export take seconds, not a minute."""
    from tfscale import fashion_mnist_source as source

    directory.mkdir()
    for split, count in (("train", train), ("test", test)):
        images, labels = source.arrays(split)
        for name, array in zip(source.FILES[split], (images[:count, ..., 0], labels[:count])):
            header = (0x0800 + array.ndim).to_bytes(4, "big") + b"".join(
                n.to_bytes(4, "big") for n in array.shape)
            with gzip.open(directory / name, "wb") as f:
                f.write(header + array.astype(np.uint8).tobytes())
    return directory


@needs_fashion_mnist
def test_fashion_mnist_trains_on_two_workers_and_serves_raw_28x28_images(tmp_path):
    export_dir = tmp_path / "export"
    data_dir = write_fashion_mnist_head(tmp_path / "fashion-mnist", train=2000, test=1000)
    process = multiworker.run_train(
        2, tmp_path, ["--dataset=fashion_mnist", f"--data_dir={data_dir}", "--epochs=1",
                      *SMALL, f"--export_dir={export_dir}"], timeout=400)
    assert process.returncode == 0, process.output[-6000:]
    assert "2 worker(s), global batch 32 (16 per worker)" in process.output
    # The chief checked the export against its model on the whole test split.
    assert re.search(r"its accuracy on the full 1000-image test split: [0-9.]+",
                     process.output), process.output[-3000:]
    import tensorflow as tf

    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    spec = serve.structured_input_signature[1]["images"]
    assert spec.dtype == tf.uint8 and spec.shape.as_list() == [None, 28, 28, 1]


def test_fashion_mnist_files_nowhere_are_one_line_saying_how_to_get_them(tmp_path):
    process = run(["tfscale-train", "--dataset=fashion_mnist",
                   f"--data_dir={tmp_path}"], cwd=tmp_path, timeout=120)
    assert process.returncode == 1
    last = [l for l in process.stdout.splitlines() if l.strip()][-1]
    assert last.startswith(f"tfscale-train: data_dir={str(tmp_path)!r} lacks "
                           "Fashion-MNIST's train-images-idx3-ubyte.gz"), last
    assert "apt-get install dataset-fashion-mnist" in last


# Unknown names, impossible batches and a global batch the workers cannot
# share: tests/reliability/test_bad_input.py.
def test_a_flag_out_of_its_range_is_refused_before_anything_is_written(tmp_path):
    process = run(["tfscale-train", "--epochs=0", f"--export_dir={tmp_path / 'export'}"],
                  cwd=tmp_path, timeout=120)
    assert process.returncode != 0
    assert "--epochs must be >= 1, got 0." in process.stdout
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("args, message", [
    (["--epochs=0"], "tfscale-train: --epochs must be >= 1, got 0."),
    (["--model=alexnet"], "tfscale-train: --model='alexnet' is unknown. "
                          "Known: alexnet_bn, alexnet_bn_small, resnet50"),
    (["epochs=3"], "tfscale-train: unexpected arguments: epochs=3 (flags are "
                   "written --name=value; tfscale-train --helpshort lists them)"),
])
def test_a_bad_flag_is_one_line_without_the_flag_listing(tmp_path, args, message):
    process = run(["tfscale-train", *args], cwd=tmp_path, timeout=120)
    assert process.returncode == 1
    lines = [l for l in process.stdout.splitlines() if l.strip()]
    assert lines[-1] == message, process.stdout[-3000:]
    assert "--global_batch_size" not in process.stdout  # no usage listing


def test_deterministic_turns_op_determinism_on_and_the_run_repeats_bitwise(tmp_path):
    """Own processes: op determinism, once on, stays on for the process."""
    runs = []
    for attempt in range(2):
        process = run(["tfscale-train", "--deterministic", "--epochs=2",
                       "--model=alexnet_bn_small", *SMALL,
                       "--export_dir=", f"--model_dir={tmp_path / str(attempt)}"],
                      cwd=tmp_path)
        assert process.returncode == 0, process.stdout[-6000:]
        assert "Op determinism on: every op runs a deterministic kernel" in (
            process.stdout)
        runs.append(multiworker.checkpoint_variables(tmp_path / str(attempt)))
    (step, first), (_, second) = runs
    assert step == 8 and first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


ONE_EPOCH = ["--epochs=1", "--model=alexnet_bn_small", *SMALL, "--export_dir="]


def test_timeline_flag_writes_every_step_of_each_worker(tmp_path):
    """Own processes: each worker writes its timeline when its process exits."""
    from tfscale import timeline

    traces = tmp_path / "timeline"
    process = run(["tfscale-launch", "--num_workers=2", "--timeout=300",
                   "--preload=tfscale.strategy", "--",
                   "tfscale-train", *ONE_EPOCH, f"--timeline={traces}"],
                  cwd=tmp_path, timeout=360)
    assert process.returncode == 0, process.stdout[-4000:]
    merged = json.loads(open(timeline.merge(str(traces))).read())
    steps = {(e["pid"], e["args"]["step"]) for e in merged["traceEvents"]
             if e.get("ph") == "X" and e["name"] == "train step"}
    assert steps == {(w, s) for w in (0, 1) for s in range(4)}, steps


def test_tensorboard_scalars_per_step_on_the_chief(tmp_path):
    import tensorflow as tf

    board = tmp_path / "board"
    process = multiworker.run_train(2, tmp_path, [*ONE_EPOCH, f"--tensorboard_dir={board}"])
    assert process.returncode == 0, process.output[-4000:]
    tags, values = {}, {}
    for event_file in board.iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(event_file)):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
                values.setdefault(value.tag, {})[event.step] = float(
                    tf.make_ndarray(value.tensor))
    assert {"images_per_second", "learning_rate", "loss",
            "exposed_communication_seconds"} <= tags.keys()
    assert sorted(tags["learning_rate"]) == [1, 2, 3, 4]
    assert sorted(tags["exposed_communication_seconds"]) == [1, 2, 3, 4]
    for tag in ("straggler/worker_0_compute_seconds",
                "straggler/worker_1_compute_seconds", "straggler/slowest_over_median"):
        assert tags[tag] == [4], tag  # at the epoch's end
    assert values["straggler/slowest_over_median"][4] >= 1
    # Each step waits a little on its all-reduces, never longer than the step
    # (images/s comes from the time between consecutive steps: from step 2).
    exposed = values["exposed_communication_seconds"]
    for step, images_per_second in values["images_per_second"].items():
        assert 0 < exposed[step] < 32 / images_per_second, (step, exposed, values)
