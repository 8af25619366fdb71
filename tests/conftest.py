"""Shared test set-up: the helpers (multiworker.py) importable from
subfolders, and the two tiers.

A test that starts a worker process (a Python interpreter, tfscale-train,
tfscale-launch, tfscale-bench) is marked `multiworker`: its module sets
`pytestmark = pytest.mark.multiworker`, or the test carries the mark itself.
`python -m pytest tests -m "not multiworker"` runs the rest, in a few minutes,
while working. Unmarked tests that start such a process fail, naming the mark,
so the fast tier stays fast and the marks stay true.
"""

import collections
import importlib.util
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpu_seconds  # noqa: E402  (beside this file)

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

# Each module's seconds in README's test command (setup, call and teardown
# of its tests), which `--store-durations` rewrites: what the two pytest
# processes are handed first, as pytest-split keeps `.test_durations`.
DURATIONS = os.environ.get("TFSCALE_TEST_DURATIONS",
                           os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "durations.json"))
# A module not in DURATIONS yet: one that starts workers is handed out early.
_UNMEASURED_SECONDS = {True: 60.0, False: 0.0}


def pytest_addoption(parser):
    parser.addoption(
        "--store-durations", action="store_true",
        help=f"write each test module's seconds to {DURATIONS}, which "
             "orders the modules under pytest-xdist (longest first)")
    parser.addoption(
        "--cpu-durations", type=int, metavar="N", default=None,
        help="show the N tests that used the most CPU-seconds, counting every "
             "process they started or ran scenarios in (tests/cpu_seconds.py; "
             "N=0 for all)")


def pytest_configure(config):
    # pytest-xdist's own order for --dist loadfile (most tests first) would
    # replace the one below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    config.addinivalue_line(
        "markers", "multiworker: starts worker processes (a Python interpreter, "
        "tfscale-train, tfscale-launch, tfscale-bench); deselect with "
        '-m "not multiworker" for the fast tier')
    config.addinivalue_line(
        "markers", "package_index: asks the package index (pip's resolver), "
        "mostly waiting on the network: handed out first under pytest-xdist")


def _module(nodeid):
    return nodeid.split("::")[0]


def _measured_seconds():
    try:
        with open(DURATIONS) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadfile`, README's test command),
    the modules that wait on the package index go first, then the rest,
    longest first by DURATIONS: xdist hands out whole modules (`--dist
    loadfile`) in this order, so the other process computes while one waits,
    and the fast-tier modules, seconds each, fill in at the end instead of
    one long module running alone on a machine that is otherwise done (the
    longest-processing-time-first rule for scheduling on parallel
    machines: Graham 1969, "Bounds on multiprocessing timing anomalies")."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: any order
        return
    measured = _measured_seconds()
    waits, seconds = set(), collections.Counter()
    for item in items:
        module = _module(item.nodeid)
        if item.get_closest_marker("package_index") is not None:
            waits.add(module)
        if module not in measured:
            starts_workers = item.get_closest_marker("multiworker") is not None
            seconds[module] = max(seconds[module], _UNMEASURED_SECONDS[starts_workers])
        else:
            seconds[module] = measured[module]
    items.sort(key=lambda item: (_module(item.nodeid) not in waits,
                                 -seconds[_module(item.nodeid)]))


_durations = collections.Counter()  # module -> seconds, for --store-durations
_cpu_seconds = {}  # nodeid -> CPU-seconds, for --cpu-durations
_cpu_started = {}  # nodeid -> cpu_seconds.process_tree() at its setup


def pytest_runtest_logreport(report):
    _durations[_module(report.nodeid)] += report.duration
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            _cpu_seconds[report.nodeid] = value


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("cpu_durations") is not None:
        _cpu_started[item.nodeid] = cpu_seconds.process_tree()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = _cpu_started.get(item.nodeid)
    if report.when == "teardown" and started is not None:
        # In the teardown's report, which pytest-xdist sends to its controller.
        del _cpu_started[item.nodeid]
        report.user_properties.append(
            ("cpu_seconds", round(cpu_seconds.process_tree() - started, 2)))


def pytest_terminal_summary(terminalreporter, config):
    shown = config.getoption("cpu_durations")
    if shown is None or hasattr(config, "workerinput"):
        return
    ranked = sorted(_cpu_seconds.items(), key=lambda item: -item[1])
    terminalreporter.write_sep(
        "=", f"most CPU-seconds: {'all' if not shown else shown} of "
             f"{len(ranked)} tests, {sum(_cpu_seconds.values()):,.0f} in all")
    for nodeid, seconds in ranked[:shown or None]:
        terminalreporter.write_line(f"{seconds:8.2f}s  {nodeid}")


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
    try:
        import tfscale.launch
        import tfscale.models
    except ImportError as error:
        pytest.exit(f"{error}: {install}", returncode=4)
    for module, folder in ((tfscale.launch, "launch"), (tfscale.models, "models")):
        found = os.path.dirname(os.path.abspath(module.__file__))
        if found != os.path.join(repo, folder):
            pytest.exit(f"{module.__name__} is imported from {found}, not from "
                        f"this checkout: {install}", returncode=4)


def pytest_sessionstart(session):
    """Checks which checkout is installed; refuses worker processes to
    unmarked tests, their fixtures included; imports tfscale's core with the
    collector paused, then frozen, and skips the collection at exit, as
    tfscale-train does."""
    _check_installed_from_here()
    from tfscale.launch import garbage_collection

    garbage_collection.skip_final_collection()
    if importlib.util.find_spec("tensorflow") is not None:
        # As tfscale-train imports them: the tests' full collections then
        # skip TensorFlow's and Keras's module objects.
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


def pytest_sessionfinish(session, exitstatus):
    """Ends the reused worker pools (tests/worker_pool.py); with
    --store-durations, writes each module's seconds (in pytest-xdist's
    controller, which hears every test's report)."""
    import worker_pool

    worker_pool.close_all()
    config = session.config
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):
        seconds = dict(_measured_seconds(), **{
            module: round(total, 1) for module, total in _durations.items()})
        partial = f"{DURATIONS}.partial"
        with open(partial, "w") as f:
            json.dump(dict(sorted(seconds.items())), f, indent=1)
            f.write("\n")
        os.replace(partial, DURATIONS)
