"""launch/bench/report.py: the allreduce rows, their checks and their table."""

import pytest

from tfscale.launch.bench import report


def test_the_bench_refuses_to_report_timings_of_a_wrong_result():
    outputs = [{"rank": 1, "rows": [{"label": "ring", "inputs": "64 KiB", "wrong": 1}]}]
    with pytest.raises(report.WrongResultError,
                       match="ring on 64 KiB: 1 element\\(s\\) differ from the exact sum on worker 1"):
        report.check_results(outputs)


def test_rows_take_the_slowest_worker_per_repeat_and_compare_to_stock():
    context = {"num_workers": 2, "local_size": None, "node_sizes": [2],
               "emulate_nodes": None, "inter_node_rate": None, "link_rate": None}

    def output(rank, stock, ring):
        return {"rank": rank, "rows": [
            {"inputs": "4 KiB", "side": "stock", "algorithm": "stock",
             "label": "stock (one pack)", "wrong": 0, "repeat_seconds": stock},
            {"inputs": "4 KiB", "side": "tfscale", "algorithm": "ring", "label": "ring",
             "compression": None, "wrong": 0, "repeat_seconds": ring}]}

    rows = report.summarize([[output(0, [1.0, 3.0], [1.0, 1.0]),
                              output(1, [2.0, 1.0], [0.5, 2.0])]],
                            [("4 KiB", [[1024]])], context)
    stock, ring = rows
    assert stock["repeat_seconds"] == [2.0, 3.0] and stock["seconds"] == 2.5
    assert ring["repeat_seconds"] == [1.0, 2.0] and ring["seconds"] == 1.5
    assert ring["vs_stock"] == pytest.approx(1.5 / 2.5)
    assert ring["busbw"] == pytest.approx(4096 / 1.5 * 2 * (2 - 1) / 2)
    assert "# tfscale-bench allreduce: 2 workers in 1 node(s) of 2; loopback" in (
        report.header(context, repeats=2, warmup=1, rounds=1))
    with pytest.raises(ValueError, match="lacks fields"):
        report.write_json([{"label": "ring"}], "unused.json")
