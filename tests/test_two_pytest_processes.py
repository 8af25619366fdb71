"""README's test command runs the suite in two pytest processes
(pytest-xdist, `-n 2 --dist loadfile`): the one that waits on the package
index is handed out first, then the others, longest first by
tests/durations.json (tests/suite_timing.py, loaded here alone: these
pytest runs import no TensorFlow), and the two processes' worker
pools share one memory budget (tests/worker_pool.py)."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiworker

TESTS = os.path.dirname(os.path.abspath(__file__))


def environment(**extra):
    """This environment without what pytest-xdist sets in its own processes
    (this suite may run under it), with the tests' helpers importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    return dict(env, PYTHONPATH=TESTS, **extra)


def run_pytest(tmp_path, durations, *args):
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "suite_timing", "-v",
         *args, "test_fast.py", "test_workers.py", "test_long.py", "test_index.py"],
        cwd=tmp_path, env=environment(TFSCALE_TEST_DURATIONS=str(durations)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:]
    # "test_fast.py::test_fast PASSED", or under xdist "[gw0] ... PASSED test_fast.py::test_fast"
    return [match.group(1) for line in process.stdout.splitlines() if "PASSED" in line
            for match in [re.search(r"::(test_\w+)", line)] if match]


def write_modules(tmp_path):
    # test_fast.py has the most tests, which pytest-xdist's own order
    # (--loadscope-reorder) would hand out first.
    (tmp_path / "test_fast.py").write_text(
        "def test_fast():\n    pass\n\ndef test_fast_too():\n    pass\n\n"
        "def test_fast_also():\n    pass\n")
    for name in ("workers", "long"):
        (tmp_path / f"test_{name}.py").write_text(
            "import pytest\npytestmark = pytest.mark.multiworker\n\n"
            f"def test_{name}():\n    pass\n")
    (tmp_path / "test_index.py").write_text(
        "import pytest\n\n@pytest.mark.package_index\n"
        "def test_index():\n    pass\n")


FAST = ["test_fast", "test_fast_too", "test_fast_also"]


def test_under_xdist_the_package_index_then_the_longest_modules_run_first(tmp_path):
    write_modules(tmp_path)
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"test_workers.py": 30.0, "test_long.py": 90.0,
                                     "test_fast.py": 0.5, "test_index.py": 20.0}))
    # One process: the order as collected.
    assert run_pytest(tmp_path, durations) == [
        *FAST, "test_workers", "test_long", "test_index"]
    # One xdist process takes the modules in the order they are handed out.
    assert run_pytest(tmp_path, durations, "-n", "1", "--dist", "loadfile") == [
        "test_index", "test_long", "test_workers", *FAST]


def test_modules_not_measured_yet_that_start_workers_go_before_the_fast_ones(tmp_path):
    write_modules(tmp_path)
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"test_fast.py": 0.5}))
    assert run_pytest(tmp_path, durations, "-n", "1", "--dist", "loadfile") == [
        "test_index", "test_workers", "test_long", *FAST]


def test_store_durations_writes_each_modules_seconds_and_keeps_the_others(tmp_path):
    write_modules(tmp_path)
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(0.5)\n")
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"test_gone.py": 7.0}))
    run_pytest(tmp_path, durations, "-n", "1", "--dist", "loadfile", "--store-durations",
               "test_slow.py")
    seconds = json.loads(durations.read_text())
    assert seconds.keys() == {"test_gone.py", "test_fast.py", "test_workers.py",
                              "test_long.py", "test_index.py", "test_slow.py"}
    assert seconds["test_gone.py"] == 7.0
    assert 0.5 <= seconds["test_slow.py"] < 60
    assert not list(tmp_path.glob("*.partial"))


def test_the_pytest_processes_share_the_pools_memory_budget():
    def budget(**env):
        return int(subprocess.run(
            [sys.executable, "-c", "import worker_pool; print(worker_pool.MAX_POOLS_MEMORY_BYTES)"],
            env=environment(**env), capture_output=True, text=True,
            check=True).stdout)

    alone = budget()
    assert budget(PYTEST_XDIST_WORKER_COUNT="2") == alone // 2


def test_cpu_durations_count_the_processes_a_test_starts_and_not_its_waits(tmp_path):
    # A test whose child computes for about a second, and one that sleeps.
    (tmp_path / "test_cpu.py").write_text(
        "import subprocess, sys, time\nimport pytest\n"
        "pytestmark = pytest.mark.multiworker\n\n"
        "def test_child_computes():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\n"
        "end = time.process_time() + 1\\nwhile time.process_time() < end: pass'],"
        " check=True)\n\n"
        "def test_sleeps():\n    time.sleep(1)\n")
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "suite_timing", "-q",
         "-n", "1", "--cpu-durations=0", "test_cpu.py"],
        cwd=tmp_path, env=environment(TFSCALE_TEST_DURATIONS=str(tmp_path / "d.json")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:]
    seconds = dict((line.split()[1], float(line.split()[0].rstrip("s")))
                   for line in process.stdout.splitlines()
                   if re.match(r" *\d+\.\d\ds  test_cpu\.py::", line))
    assert seconds.keys() == {"test_cpu.py::test_child_computes", "test_cpu.py::test_sleeps"}
    assert seconds["test_cpu.py::test_child_computes"] >= 0.9, process.stdout[-2000:]
    assert seconds["test_cpu.py::test_sleeps"] < 0.5, process.stdout[-2000:]
    assert "most CPU-seconds: all of 2 tests" in process.stdout
