"""tfscale.agreement: how differing settings are reported, and its gather
on real workers."""

import pytest

from multiworker import assert_succeeded
from multiworker import run_workers
from tfscale import agreement


def test_differences_name_each_setting_and_the_workers():
    lines = agreement.differences([
        {"global_batch_size": 64, "model": "resnet50", "seed": 0},
        {"global_batch_size": 128, "model": "resnet50", "seed": 0},
        {"global_batch_size": 64, "model": "resnet50"},
    ])
    assert lines == [
        "global_batch_size: 64 on workers 0, 2, 128 on worker 1",
        "seed: 0 on workers 0, 1, <unset> on worker 2",
    ]


def test_equal_settings_have_no_differences():
    same = {"a": [1, 2], "b": "x"}
    assert agreement.differences([same, dict(same)]) == []


@pytest.mark.multiworker
def test_gather_stacks_every_workers_array_by_worker_index_in_its_dtype(tmp_path):
    run = run_workers("agreement_gather.py", 3, tmp_path)
    assert_succeeded(run)
    expected = {
        "float32": [[i + 0.5] for i in range(3)],
        "float64": [[i / 3, -i] for i in range(3)],
        "int32": [[10 * i, 10 * i + 1, 10 * i + 2] for i in range(3)],
        "int64": [[2**40 + i] for i in range(3)],
        "matrix": [[[i] * 3] * 2 for i in range(3)],
    }
    for result in run.results:
        gathered = result["gathered"]
        assert {name: g["values"] for name, g in gathered.items()} == expected
        assert {name: g["dtype"] for name, g in gathered.items()} == {
            name: name if name != "matrix" else "float32" for name in expected}
        assert gathered["matrix"]["shape"] == [3, 2, 3]
        assert result["refused"] == (
            "tfscale.agreement.gather gathers arrays of int32, int64, float32, "
            "float64; cast it to one of them. Received: array.dtype=uint8")
