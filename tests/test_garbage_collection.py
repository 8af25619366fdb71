"""tfscale.launch.garbage_collection: tfscale's processes import TensorFlow
with the collector paused and freeze what it loaded, skip the interpreter's
last collection, and everything else of their exit still runs."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiworker  # each test starts a Python interpreter

# Counts gc.freeze calls; an atexit handler registered first runs last, so it
# sees the heap as the interpreter's own finalization will.
_SEES_THE_EXIT = """
import atexit, gc
freezes = []
freeze = gc.freeze
gc.freeze = lambda: (freezes.append(1), freeze())
atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, "times", len(freezes),
                              "collecting", gc.isenabled(), flush=True))
"""


def run_python(code, *args, cwd=None):
    return subprocess.run([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, cwd=cwd)


def test_a_module_is_imported_with_the_collector_paused_then_frozen_once(tmp_path):
    for name in ("first", "second"):
        (tmp_path / f"{name}.py").write_text("import gc\nCOLLECTING = gc.isenabled()\n")
    process = run_python(_SEES_THE_EXIT + """
from tfscale.launch import garbage_collection
first = garbage_collection.import_frozen("first")
print("collecting while importing", first.COLLECTING, "after", gc.isenabled(),
      "frozen", len(freezes), flush=True)
second = garbage_collection.import_frozen("second")  # imported, not frozen again
print("second", second.COLLECTING, "frozen", len(freezes), flush=True)
""", cwd=tmp_path)
    assert process.returncode == 0, process.stdout
    assert process.stdout.splitlines()[-3:] == [
        "collecting while importing False after True frozen 1",
        "second True frozen 1",
        "frozen True times 1 collecting True",
    ]


def test_a_failed_import_leaves_the_collector_on_and_the_heap_unfrozen():
    process = run_python(_SEES_THE_EXIT + """
from tfscale.launch import garbage_collection
try:
    garbage_collection.import_frozen("tfscale_no_such_module")
except ModuleNotFoundError as error:
    print("raised", error.name, flush=True)
""")
    assert process.stdout.splitlines()[-2:] == [
        "raised tfscale_no_such_module", "frozen False times 0 collecting True"]


def test_the_heap_is_frozen_at_exit_after_the_other_handlers_ran(tmp_path):
    written = tmp_path / "written.txt"
    process = run_python(_SEES_THE_EXIT + f"""
from tfscale.launch import garbage_collection
garbage_collection.skip_final_collection()
garbage_collection.skip_final_collection()  # once, however often asked
atexit.register(lambda: open({str(written)!r}, "w").write("kept"))
""")
    assert process.returncode == 0, process.stdout
    assert process.stdout.splitlines()[-1] == "frozen True times 1 collecting False"
    assert written.read_text() == "kept"


def test_without_it_the_last_collection_runs():
    process = run_python(_SEES_THE_EXIT)
    assert process.stdout.splitlines()[-1] == "frozen False times 0 collecting True"


def test_tfscale_train_skips_it_even_when_it_refuses_its_flags():
    process = run_python(_SEES_THE_EXIT + """
import sys
from tfscale.launch import train
sys.argv = ["tfscale-train", "--epochs=0"]
train.run()
""")
    assert process.returncode == 1, process.stdout
    assert "--epochs must be >= 1, got 0." in process.stdout
    assert process.stdout.splitlines()[-1] == "frozen True times 1 collecting False"


def test_tfscale_train_freezes_tensorflow_once_imported(tmp_path):
    # Refused by a check that needs TensorFlow: the heap was frozen after its
    # import, and again at exit.
    process = run_python(_SEES_THE_EXIT + f"""
import sys
from tfscale.launch import train
sys.argv = ["tfscale-train", "--dataset=fashion_mnist", "--data_dir={tmp_path}"]
train.run()
""")
    assert process.returncode == 1, process.stdout
    assert "fashion" in process.stdout.lower() and str(tmp_path) in process.stdout, \
        process.stdout
    assert process.stdout.splitlines()[-1] == "frozen True times 2 collecting False"


def test_a_fresh_test_worker_runs_its_script_as_python_would_with_tensorflow_frozen(tmp_path):
    import multiworker

    run = multiworker.launch_workers(
        "pool_probe.py", 2, tmp_path, args=["process"],
        why="what a fresh worker process starts with is the point", fresh=True)
    multiworker.assert_succeeded(run)
    for result in run.results:
        assert result["argv0"] == os.path.join(multiworker.WORKERS_DIR, "pool_probe.py")
        assert result["path0"] == multiworker.WORKERS_DIR
        assert result["collecting"]
        # TensorFlow's and Keras's module objects (~450,000), frozen before
        # the script ran.
        assert result["frozen"] > 100_000, result
