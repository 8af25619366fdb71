"""The reused worker processes (tests/worker_pool.py, tests/pool_worker.py):
a scenario sees nothing an earlier one changed, and one that fails or
leaves what cannot be undone ends its pool with every worker's output; and
the processes a test starts of its own from the pools' preload process
(multiworker.popen)."""

import json
import os
import signal
import subprocess
import sys

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


def test_a_scenario_finds_the_earlier_ones_garbage_collected_its_survivors_frozen_and_the_collector_on(
        tmp_path):
    # After each scenario the pool collects (Keras's clear_session), then
    # freezes what survived (garbage frozen instead would live as long as the
    # pool), and switches the collector back on if the scenario left it off.
    left = probe(tmp_path / "leave", "leave")
    found = probe(tmp_path / "after", "process")
    for run in (left, found):
        multiworker.assert_succeeded(run)
    for result in found.results:
        assert result["garbage_alive"] is False, result
        assert result["survivor_frozen"] is True, result
        assert result["collecting"], result
        # TensorFlow's and Keras's module objects, frozen at start.
        assert result["frozen"] > 100_000, result


def test_pools_over_the_memory_limit_end_the_least_recently_used_and_are_replaced(
        tmp_path, monkeypatch):
    import worker_pool

    one = probe(tmp_path / "one", "state", num_workers=1)
    multiworker.assert_succeeded(one)
    held = worker_pool.kept()[1].own_memory_bytes()
    # What the worker wrote since it was forked (TensorFlow's import is the
    # preload process's, shared): the reading works.
    assert held > 1 << 20
    # A limit every pool that holds anything is over (a pool's reading
    # varies from one fork to the next, so no fraction of `held` would do).
    monkeypatch.setattr(worker_pool, "MAX_POOLS_MEMORY_BYTES", 1)
    # Pool 1 alone is over the limit: asked for, it is replaced.
    again = probe(tmp_path / "again", "state", num_workers=1)
    multiworker.assert_succeeded(again)
    assert again.results[0]["pid"] != one.results[0]["pid"]
    # Another size asked for ends it, the least recently used.
    replaced = worker_pool.kept()[1]
    two = probe(tmp_path / "two", "state", num_workers=2)
    multiworker.assert_succeeded(two)
    assert list(worker_pool.kept()) == [2] and not replaced.alive()


def test_op_determinism_left_on_fails_the_scenario_naming_it(tmp_path):
    run = probe(tmp_path, "determinism")
    assert run.returncode != 0
    assert ("left process-wide state that later scenarios would see: "
            "{'op determinism': True}") in run.output


# Processes of a test's own, forked from the pools' preload process
# (multiworker.popen): as a fresh interpreter would start them, none reused.
PROBE = [sys.executable, os.path.join(multiworker.WORKERS_DIR, "pool_probe.py")]


def test_a_forked_process_has_its_environment_arguments_folder_and_frozen_imports(tmp_path):
    env = multiworker.worker_env(tmp_path, {"POOL_PROBE": "its own"})
    for mode in ("state", "process"):
        process = multiworker.run([*PROBE, mode, "--probe=given"], tmp_path, env,
                                  timeout=120, run_time=("POOL_PROBE",))
        assert process.returncode == 0, process.stdout[-3000:]
        result = json.loads((tmp_path / "worker-0.json").read_text())
        if mode == "state":
            assert (result["env"], result["cwd"], result["probe"]) == (
                "its own", str(tmp_path), "given")
            assert result["pid"] != os.getpid()
        else:
            assert result["argv0"] == PROBE[1]
            assert result["path0"] == multiworker.WORKERS_DIR
            # TensorFlow's and Keras's module objects, frozen in the preload
            # process before the fork: this process imported none of them.
            assert result["collecting"] and result["frozen"] > 100_000, result


def test_a_forked_process_is_killed_waited_for_and_reports_the_signal(tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    process = multiworker.popen([sys.executable, str(sleeper)], tmp_path,
                                multiworker.worker_env(tmp_path), subprocess.DEVNULL)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.5)
    assert os.getpgid(process.pid) == process.pid  # a session of its own
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL == process.returncode


def test_a_variable_read_at_import_must_match_the_preload_process(tmp_path):
    with pytest.raises(ValueError, match=r"\['KERAS_BACKEND'\] differ from the pools' "
                                         r"environment at import"):
        multiworker.popen(PROBE + ["state"], tmp_path,
                          multiworker.worker_env(tmp_path, {"KERAS_BACKEND": "jax"}),
                          subprocess.DEVNULL)
