"""The suite's order under pytest-xdist and what it measures of each test:
a pytest plugin. conftest.py loads it for the suite; the tests of the
order and of the measures (test_two_pytest_processes.py) load it alone
(`-p suite_timing`) in pytest runs of their own, which then import no
TensorFlow.

- Under README's test command (`-n 2 --dist loadfile`) the modules marked
  `package_index` go first, then the others, longest first by DURATIONS.
- `--store-durations` rewrites DURATIONS with each module's seconds.
- `--cpu-durations=N` lists the N tests that used the most CPU-seconds
  (tests/cpu_seconds.py).
"""

import collections
import json
import os

import pytest

import cpu_seconds

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


def pytest_sessionfinish(session, exitstatus):
    """With --store-durations, writes each module's seconds (in pytest-xdist's
    controller, which hears every test's report)."""
    config = session.config
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):
        seconds = dict(_measured_seconds(), **{
            module: round(total, 1) for module, total in _durations.items()})
        partial = f"{DURATIONS}.partial"
        with open(partial, "w") as f:
            json.dump(dict(sorted(seconds.items())), f, indent=1)
            f.write("\n")
        os.replace(partial, DURATIONS)
