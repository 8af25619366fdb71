"""README's test command runs the suite in two pytest processes
(pytest-xdist, `-n 2 --dist loadfile`): the one that waits on the package
index, then the modules that start workers, are handed out first
(tests/conftest.py), and the two processes' worker pools share one memory
budget (tests/worker_pool.py)."""

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


def run_pytest(tmp_path, *args):
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-v",
         *args, "test_fast.py", "test_workers.py", "test_index.py"],
        cwd=tmp_path, env=environment(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:]
    # "test_fast.py::test_fast PASSED", or under xdist "[gw0] ... PASSED test_fast.py::test_fast"
    return [match.group(1) for line in process.stdout.splitlines() if "PASSED" in line
            for match in [re.search(r"::(test_\w+)", line)] if match]


def test_under_xdist_the_package_index_then_the_modules_that_start_workers_run_first(
        tmp_path):
    (tmp_path / "test_fast.py").write_text("def test_fast():\n    pass\n")
    (tmp_path / "test_workers.py").write_text(
        "import pytest\npytestmark = pytest.mark.multiworker\n\n"
        "def test_workers():\n    pass\n")
    (tmp_path / "test_index.py").write_text(
        "import pytest\n\n@pytest.mark.package_index\n"
        "def test_index():\n    pass\n")
    # One process: the order as collected.
    assert run_pytest(tmp_path) == ["test_fast", "test_workers", "test_index"]
    # One xdist process takes the modules in the order they are handed out.
    assert run_pytest(tmp_path, "-n", "1", "--dist", "loadfile") == [
        "test_index", "test_workers", "test_fast"]


def test_the_pytest_processes_share_the_pools_memory_budget():
    def budget(**env):
        return int(subprocess.run(
            [sys.executable, "-c", "import worker_pool; print(worker_pool.MAX_POOLS_MEMORY_BYTES)"],
            env=environment(**env), capture_output=True, text=True,
            check=True).stdout)

    alone = budget()
    assert budget(PYTEST_XDIST_WORKER_COUNT="2") == alone // 2
