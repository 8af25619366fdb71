"""Workers started with different settings all stop, naming the difference."""

import pytest
from multiworker import start_cluster

pytestmark = pytest.mark.multiworker


BASE = ["tfscale-train", "--model=alexnet_bn_small", "--fc_units=32", "--epochs=1",
        "--steps_per_epoch=2", "--export_dir="]


def test_mismatched_flags_stop_every_worker_with_the_differences(tmp_path):
    processes = start_cluster(
        [BASE + ["--global_batch_size=64"],
         BASE + ["--global_batch_size=128", "--learning_rate=0.1"]],
        tmp_path,
    )
    for process in processes:
        process.wait(timeout=240)
    for index, process in enumerate(processes):
        output = (tmp_path / f"worker-{index}.log").read_text()
        assert process.returncode != 0, output[-3000:]
        assert "Workers were started with different settings" in output
        assert "global_batch_size: 64 on worker 0, 128 on worker 1" in output
        assert "learning_rate: 0.05 on worker 0, 0.1 on worker 1" in output
        assert "Epoch 1/" not in output
