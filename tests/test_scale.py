"""12 workers on 4 emulated nodes of 3 (tfscale-bench scale): every algorithm
trains a BN-free model on an uneven global batch as one worker does. (16
workers on 4 nodes: `tfscale-bench scale --worker_counts=16 --num_workers=16
--emulate_nodes=4`, BENCHMARKS.md section 6; 12 keeps the suite shorter and
puts an odd number of workers on each node.)"""

import json
import subprocess
import sys

import pytest

import multiworker

pytestmark = pytest.mark.multiworker


NETNS_PROBLEM = multiworker.netns_not_permitted_reason()


@pytest.mark.skipif(NETNS_PROBLEM is not None,
                    reason=f"emulated nodes need network namespaces: {NETNS_PROBLEM}")
def test_twelve_workers_on_four_nodes_of_three_train_as_one_worker_with_every_algorithm(tmp_path):
    output = tmp_path / "scale.json"
    process = subprocess.run(
        [sys.executable, "-m", "tfscale.launch.bench", "scale", "--worker_counts=12",
         "--num_workers=12", "--emulate_nodes=4", "--timeout=900", f"--output={output}"],
        cwd=tmp_path, env=multiworker.worker_env(tmp_path), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert process.returncode == 0, process.stdout[-6000:]
    (row,) = json.loads(output.read_text())
    assert row["num_workers"] == 12 and row["emulated_nodes"] == 4
    assert "4 nodes" in row["topology"], row["topology"]
    assert set(row["algorithms"]) == {"default", "ring", "hierarchical", "2d",
                                      "halving_doubling", "hybrid"}
    for algorithm, check in row["algorithms"].items():
        # Global batch 37: 4 or 3 examples a worker, weighted by what each holds.
        assert check["bitwise_identical"], (algorithm, process.stdout[-3000:])
        assert check["max_abs_diff_vs_one_worker"] < 1e-6, (algorithm, check)
