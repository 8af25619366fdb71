"""Shared test set-up: the helpers (multiworker.py) importable from
subfolders, and the two tiers.

A test that starts a worker process (a Python interpreter, tfscale-train,
tfscale-launch, tfscale-bench) is marked `multiworker`: its module sets
`pytestmark = pytest.mark.multiworker`, or the test carries the mark itself.
`python -m pytest tests -m "not multiworker"` runs the rest, in a few minutes,
while working. Unmarked tests that start such a process fail, naming the mark,
so the fast tier stays fast and the marks stay true.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The suite's order under pytest-xdist, --store-durations, --cpu-durations.
pytest_plugins = ["suite_timing"]

# TensorFlow's CPU allocator as a BFC allocator (TF_CPU_ALLOCATOR_USE_BFC,
# tensorflow/core/common_runtime/process_state.cc), here and in every worker
# the tests start, which inherit this environment. It keeps freed blocks for
# reuse where the default hands large tensors back to the system, to be
# faulted in again the next step: one epoch of the large-batch study's
# batch-8192 row took 48.5 CPU-seconds (18.7 of them the kernel's, 6.6M page
# faults) and 33.5 with it (2.6, 0.6M), to the same accuracy. Set before
# anything imports TensorFlow; a value the user set is kept. CI's main job
# and wheel job run TensorFlow's default (tests/README.md has the command).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

# Commands that start a worker process (the first word's basename).
_WORKER_COMMANDS = ("python", "tfscale-train", "tfscale-launch", "tfscale-bench")

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multiworker: starts worker processes (a Python interpreter, "
        "tfscale-train, tfscale-launch, tfscale-bench); deselect with "
        '-m "not multiworker" for the fast tier')


def _starts_a_worker(args):
    command = args if isinstance(args, str) else (args[0] if args else "")
    first = os.path.basename(str(command).split()[0] if isinstance(args, str) else str(command))
    return first.startswith(_WORKER_COMMANDS) or first == os.path.basename(sys.executable)


_running = [None]  # the test being set up, run or torn down


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item
    try:
        yield
    finally:
        _running[0] = None


def _check_installed_from_here():
    """tfscale.launch and tfscale.models come from the editable install's
    import hook (setup.py maps them to launch/ and models/), tfscale itself
    from this folder: both must be this checkout, or the tests would mix two
    versions of the code."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    install = f'install this checkout with pip install -e ".[cpu,test]" (in {repo})'
    for module, folder in (("tfscale.launch", "launch"), ("tfscale.models", "models")):
        # Found, not imported: tfscale.models would import TensorFlow.
        try:
            spec = importlib.util.find_spec(module)
        except ImportError as error:
            pytest.exit(f"{error}: {install}", returncode=4)
        if spec is None:
            pytest.exit(f"No module named {module!r}: {install}", returncode=4)
        found = os.path.dirname(os.path.abspath(spec.origin))
        if found != os.path.join(repo, folder):
            pytest.exit(f"{module} is imported from {found}, not from "
                        f"this checkout: {install}", returncode=4)


def pytest_sessionstart(session):
    """Checks which checkout is installed; refuses worker processes to
    unmarked tests, their fixtures included; imports tfscale's core with the
    collector paused, then frozen, and skips the collection at exit, as
    tfscale-train does."""
    _check_installed_from_here()
    from tfscale.launch import garbage_collection

    garbage_collection.skip_final_collection()
    runs_tests = not _is_xdist_controller(session.config)
    if runs_tests and importlib.util.find_spec("tensorflow") is not None:
        # As tfscale-train imports them: the tests' full collections then
        # skip TensorFlow's and Keras's module objects. (pytest-xdist's
        # controller only hands out tests: it imports no TensorFlow.)
        from multiworker import FRESH_WORKER_IMPORTS

        garbage_collection.import_frozen(FRESH_WORKER_IMPORTS)
    original = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        item = _running[0]
        if (item is not None and not item.get_closest_marker("multiworker")
                and _starts_a_worker(args)):
            raise AssertionError(
                f"{item.nodeid} starts a worker process ({args!r}): mark it "
                "(or its module: pytestmark = pytest.mark.multiworker) so the "
                'fast tier (-m "not multiworker") leaves it out')
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded


def _is_xdist_controller(config):
    return not hasattr(config, "workerinput") and bool(
        getattr(config.option, "numprocesses", None))


def pytest_sessionfinish(session, exitstatus):
    """Ends the reused worker pools (tests/worker_pool.py)."""
    import worker_pool

    worker_pool.close_all()
