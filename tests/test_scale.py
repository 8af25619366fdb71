"""9 workers on 3 emulated nodes of 3 (tfscale-bench scale): every algorithm
trains a BN-free model on an uneven global batch as one worker does. (16
workers on 4 nodes: `tfscale-bench scale --worker_counts=16 --num_workers=16
--emulate_nodes=4`; BENCHMARKS.md, section "Many workers: start-up and
memory". 9 keeps the suite short and is
odd three ways: the workers, the nodes and the workers on each node; for
halving-doubling, 9 is 8 that pair up in three rounds and one folded in.)"""

import json
import sys

import pytest

import multiworker

pytestmark = pytest.mark.multiworker


NETNS_PROBLEM = multiworker.netns_not_permitted_reason()


@pytest.mark.skipif(NETNS_PROBLEM is not None,
                    reason=f"emulated nodes need network namespaces: {NETNS_PROBLEM}")
def test_nine_workers_on_three_nodes_of_three_train_as_one_worker_with_every_algorithm(tmp_path):
    output = tmp_path / "scale.json"
    process = multiworker.run(multiworker.preloaded(
        [sys.executable, "-m", "tfscale.launch.bench", "scale", "--worker_counts=9",
         "--num_workers=9", "--emulate_nodes=3", "--timeout=900", f"--output={output}",
         "--preload=tfscale.strategy"]),
        tmp_path, multiworker.worker_env(tmp_path), timeout=1200)
    assert process.returncode == 0, process.stdout[-6000:]
    (row,) = json.loads(output.read_text())
    assert row["num_workers"] == 9 and row["emulated_nodes"] == 3
    assert "3 nodes" in row["topology"], row["topology"]
    assert set(row["algorithms"]) == {"default", "ring", "hierarchical", "2d",
                                      "halving_doubling", "hybrid"}
    for algorithm, check in row["algorithms"].items():
        # Global batch 37: 5 or 4 examples a worker, weighted by what each holds.
        assert check["bitwise_identical"], (algorithm, process.stdout[-3000:])
        assert check["max_abs_diff_vs_one_worker"] < 1e-6, (algorithm, check)
