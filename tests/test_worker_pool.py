"""The reused worker processes (tests/worker_pool.py, tests/pool_worker.py):
a scenario sees nothing an earlier one changed, and one that fails or
leaves what cannot be undone ends its pool with every worker's output."""

import pytest

import multiworker

pytestmark = pytest.mark.multiworker


def probe(tmp_path, mode, *args, num_workers=2):
    return multiworker.run_workers("pool_probe.py", num_workers, tmp_path,
                                   args=[mode, *args], timeout=120)


def test_a_scenario_sees_nothing_an_earlier_one_changed(tmp_path):
    first = probe(tmp_path / "first", "state")
    dirty = probe(tmp_path / "dirty", "dirty", "--probe=changed")
    after = probe(tmp_path / "after", "state")
    for run in (first, dirty, after):
        multiworker.assert_succeeded(run)
    assert [r["pid"] for r in after.results] == [r["pid"] for r in first.results]
    assert [r["pid"] for r in dirty.results] == [r["pid"] for r in first.results]
    assert dirty.results[0] == dict(first.results[0], policy="mixed_bfloat16",
                                    floatx="float64", env="dirty", cwd="/",
                                    probe="changed", verbosity=-2)
    for result, expected in zip(after.results, first.results, strict=True):
        assert result == dict(expected, cwd=str(tmp_path / "after"))
    assert first.results[0]["policy"] == "float32" and first.results[0]["probe"] == "default"


def test_a_failed_worker_ends_the_scenario_with_its_output_and_a_new_pool_follows(tmp_path):
    before = probe(tmp_path / "before", "state")
    multiworker.assert_succeeded(before)
    failed = probe(tmp_path / "fail", "fail")
    assert failed.returncode != 0
    assert "[worker 1] RuntimeError: pool probe: worker 1 fails on purpose" in failed.output
    assert "worker pool: " in failed.output and "the pool is replaced" in failed.output
    after = probe(tmp_path / "after", "state")
    multiworker.assert_succeeded(after)
    assert not {r["pid"] for r in after.results} & {r["pid"] for r in before.results}


def test_op_determinism_left_on_fails_the_scenario_naming_it(tmp_path):
    run = probe(tmp_path, "determinism")
    assert run.returncode != 0
    assert ("left process-wide state that later scenarios would see: "
            "{'op determinism': True}") in run.output
