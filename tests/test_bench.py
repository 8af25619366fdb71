"""tfscale-bench: the checks and statistics, and a smoke run of each subcommand.

The smoke runs use 2 workers on 127.0.0.1 and tiny sizes: they check that the
commands run end to end and write what they promise (the JSON schema, the
PNG), not the numbers.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launch import bench_report
from launch import bench_stats
from multiworker import REPO_ROOT


def test_sizes_and_rates_parse_as_nccl_tests_and_tc_read_them():
    assert bench_stats.parse_sizes(["64KB", "4MB", "1GB", "1024"]) == [
        65536, 4 * 1024**2, 1024**3, 1024]
    assert bench_stats.parse_rate("200mbit") == 25e6
    assert bench_stats.parse_rate("1gbit") == 125e6
    assert bench_stats.parse_rate("3mbps") == 3e6  # tc: bps = bytes per second
    with pytest.raises(ValueError, match=r"Received: '3 parsecs'"):
        bench_stats.parse_size("3 parsecs")
    with pytest.raises(ValueError, match=r"multiple of 4 bytes.*'6'"):
        bench_stats.parse_sizes(["6"])
    with pytest.raises(ValueError, match=r"tc unit.*'fast'"):
        bench_stats.parse_rate("fast")


def test_link_bound_is_the_bytes_each_node_link_must_carry_over_its_rate():
    # Two nodes: S bytes each way, S / R.
    assert bench_stats.link_bound_seconds(100e6, 2, 25e6) == pytest.approx(4.0)
    # m nodes: 2(m-1)/m S / R.
    assert bench_stats.link_bound_seconds(100e6, 4, 25e6) == pytest.approx(6.0)
    assert bench_stats.link_bound_seconds(100e6, 1, 25e6) is None
    assert bench_stats.link_bound_seconds(100e6, 2, None) is None
    assert bench_stats.bus_factor(4) == 1.5
    assert bench_stats.node_sizes(4, local_size=2) == [2, 2]
    assert bench_stats.node_sizes(3, local_size=2) == [2, 1]
    assert bench_stats.node_sizes(4, emulate_nodes=2) == [2, 2]
    assert bench_stats.node_sizes(4) == [4]


def test_inputs_sum_exactly_even_in_16_bits():
    shapes = [[5, 3], [1000]]
    expected = bench_stats.expected_sum(shapes, 4)
    reference = sum(np.concatenate([a.ravel() for a in bench_stats.integer_inputs(shapes, r)])
                    .astype(np.float64) for r in range(4))
    assert np.array_equal(np.concatenate([e.ravel() for e in expected]), reference)
    # Every partial sum is an integer of magnitude <= 128: exact in bfloat16.
    assert max(np.abs(e).max() for e in expected) <= 16
    # Ranks differ, so a local copy is not the sum.
    first = bench_stats.integer_inputs(shapes, 0)
    assert bench_stats.count_wrong(first, expected) > 0


def test_the_correctness_check_rejects_a_corrupted_sum():
    shapes = [[4, 4], [10]]
    expected = bench_stats.expected_sum(shapes, 2)
    assert bench_stats.count_wrong([e.copy() for e in expected], expected) == 0
    corrupted = [e.copy() for e in expected]
    corrupted[1][3] += 1.0  # one element off by one
    assert bench_stats.count_wrong(corrupted, expected) == 1
    rounded = [e.copy() for e in expected]
    rounded[0] = rounded[0] + 1e-3  # off by a rounding error everywhere
    assert bench_stats.count_wrong(rounded, expected) == 16
    assert bench_stats.count_wrong(expected[:1], expected) == 10  # a missing tensor
    assert bench_stats.count_wrong([expected[0].ravel(), expected[1]], expected) == 16
    # The bench refuses to report timings of a wrong result.
    outputs = [{"rank": 1, "rows": [{"label": "ring", "inputs": "64 KiB", "wrong": 1}]}]
    with pytest.raises(bench_report.WrongResultError,
                       match="ring on 64 KiB: 1 element\\(s\\) differ from the exact sum on worker 1"):
        bench_report.check_results(outputs)


def test_the_slowest_worker_of_each_repeat_counts():
    median, maxima = bench_stats.median_of_max([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]])
    assert maxima == [3.0, 5.0, 2.5] and median == 3.0
    with pytest.raises(ValueError, match="same, non-zero number of repeats"):
        bench_stats.median_of_max([[1.0], [1.0, 2.0]])


def bench(tmp_path, *args, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    process = subprocess.run(
        [sys.executable, "-m", "launch.bench", *args], cwd=str(tmp_path), env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert process.returncode == 0, process.stdout[-6000:]
    return process.stdout


@pytest.fixture(scope="module")
def allreduce_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    output = tmp_path / "allreduce.json"
    stdout = bench(tmp_path, "allreduce", "--num_workers=2", "--local_size=1",
                   "--sizes=4KB,64KB", "--algorithms=stock,ring,hierarchical",
                   "--warmup=1", "--repeats=2", f"--output={output}", "--plot")
    return tmp_path, output, stdout


def test_allreduce_writes_checked_rows_a_table_and_a_plot(allreduce_run):
    tmp_path, output, stdout = allreduce_run
    rows = json.loads(output.read_text())
    assert [(r["label"], r["bytes"]) for r in rows] == [
        (label, size) for size in (4096, 65536)
        for label in ("stock (one pack)", "ring", "hierarchical")]
    for row in rows:
        for field in bench_report.REQUIRED_FIELDS:
            assert field in row, field
        assert row["wrong"] == 0
        assert row["num_workers"] == 2 and row["node_sizes"] == [1, 1]
        assert row["seconds"] > 0 and len(row["repeat_seconds"]) == 2
        assert row["algbw"] == pytest.approx(row["bytes"] / row["seconds"])
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
    assert "algbw (MB/s)" in stdout and "#wrong" in stdout
    assert (tmp_path / "allreduce.png").stat().st_size > 1000


def test_project_fits_the_measurements_and_projects_the_paper_hardware(allreduce_run):
    tmp_path, measurements, _ = allreduce_run
    output = tmp_path / "project.json"
    fitted = tmp_path / "fitted.json"
    stdout = bench(tmp_path, "project", f"--measurements={measurements}",
                   f"--fitted_output={fitted}", f"--output={output}", "--gpus=8,16")
    result = json.loads(output.read_text())
    assert json.loads(fitted.read_text())["cost_model"] == result["fit"]["cost_model"]
    assert {(r["model"], r["gpus"]) for r in result["projection"]} == {
        (m, g) for m in ("resnet50", "alexnet_bn") for g in (8, 16)}
    resnet = [r for r in result["projection"] if r["model"] == "resnet50"]
    assert resnet[0]["params"] == 25_557_032
    assert all(0 < r["e_hybrid"] < 1 for r in resnet)
    assert "predicted (ms)" in stdout and "NOT FOUND" in stdout


def test_train_reports_throughput_efficiency_and_exposed_communication(tmp_path):
    output = tmp_path / "train.json"
    bench(tmp_path, "train", "--num_workers=2", "--local_size=1", "--model=alexnet_bn",
          "--image_size=67", "--fc_units=16", "--per_worker_batch=2", "--steps=1",
          "--warmup_steps=1", "--precisions=float32", "--algorithms=stock,ring",
          f"--output={output}")
    stock, row = json.loads(output.read_text())
    assert stock["config"] == "stock" and 0 < stock["exposed_comm_in_step_seconds"]
    assert row["config"] == "ring" and row["precision"] == "float32"
    assert row["exposed_comm_seconds"] == pytest.approx(
        row["step_seconds"] - row["compute_seconds"])
    # Measured inside the step, for stock and tfscale alike: part of the step.
    assert 0 < row["exposed_comm_in_step_seconds"] < row["step_seconds"]
    assert row["exposed_comm_in_step_vs_stock"] == pytest.approx(
        row["exposed_comm_in_step_seconds"] / stock["exposed_comm_in_step_seconds"])
    assert row["images_per_second"] == pytest.approx(4 / row["step_seconds"])
    assert row["scaling_efficiency"] == pytest.approx(
        row["images_per_second"] / (2 * row["single_worker_images_per_second"]))
