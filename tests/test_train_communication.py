"""tfscale-train with non-default communication flags (4 workers in 2 nodes of
2): they reach the Strategy and its gradient all-reduce plan, and training
ends in a loadable export."""

import re

import numpy as np
import pytest
import tensorflow as tf

import multiworker
from tfscale import data

pytestmark = pytest.mark.multiworker


FLAGS = ["--algorithm=2d", "--compression=bfloat16", "--local_size=2",
         "--fusion_threshold_bytes=65536", "--implementation=ring"]


def test_algorithm_compression_local_size_and_implementation_flags_reach_the_all_reduce(
        tmp_path):
    export_dir = tmp_path / "export"
    process = multiworker.run_train(
        4, tmp_path, ["--model=alexnet_bn_small", "--fc_units=32", "--global_batch_size=32",
                      "--steps_per_epoch=2", "--epochs=1", *FLAGS, f"--export_dir={export_dir}"])
    output = process.output
    assert process.returncode == 0, output[-6000:]
    chief = [l for l in output.splitlines() if l.startswith("[worker 0]")]

    strategy = [l for l in chief if "tfscale.Strategy: " in l]
    assert len(strategy) == 1, strategy
    assert ("4 workers in 2 nodes of 2; CommunicationOptions(algorithm='2d', "
            "fusion_threshold_bytes=65536, ") in strategy[0]
    assert "local_size=2, compression='bfloat16'," in strategy[0]
    assert strategy[0].endswith("implementation='ring', timeline=None, "
                                "autotune_dir=None); collectives through ring.")

    # The gradients' plan: several buckets (64 KiB threshold), all 2d, bfloat16
    # on the wire.
    plans = [i for i, l in enumerate(chief) if re.search(
        r"tfscale all-reduce of \d{2,} tensor\(s\) on 4 workers in 2 nodes of 2: "
        r"algorithm=2d, fusion_threshold_bytes=65,536, compression=bfloat16", l)]
    assert plans, "\n".join(chief[-40:])
    buckets = []
    for line in chief[plans[0] + 1:]:
        if not re.match(r"\[worker 0\]   bucket \d+:", line):
            break
        buckets.append(line)
    assert len(buckets) > 1, buckets
    wire = re.compile(r" -> [\d,]+ bytes bfloat16 on the wire: 2d( in \d+ chunks)?$")
    assert all(wire.search(l) for l in buckets), buckets

    # The export loads and serves; its accuracy is the one the chief printed.
    printed = re.search(r"its accuracy on the full 360-image test split: ([\d.]+)", output)
    assert printed, output[-3000:]
    images, labels = data.digits_arrays("test")
    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    probabilities = serve(images=tf.constant(images))["probabilities"].numpy()
    assert probabilities.shape == (360, 10)
    np.testing.assert_allclose(probabilities.sum(1), 1, rtol=1e-5)
    accuracy = np.mean(probabilities.argmax(1) == labels)
    assert abs(accuracy - float(printed.group(1))) < 1e-4
