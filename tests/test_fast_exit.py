"""tfscale.launch.fast_exit: tfscale's processes skip the interpreter's last
garbage collection, and everything else of their exit still runs."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiworker  # each test starts a Python interpreter

# An atexit handler registered first runs last: it sees the heap as the
# interpreter's own finalization will.
_SEES_THE_EXIT = """
import atexit, gc
freezes = []
freeze = gc.freeze
gc.freeze = lambda: (freezes.append(1), freeze())
atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, "times", len(freezes),
                              "collecting", gc.isenabled(), flush=True))
"""


def run_python(code, *args):
    return subprocess.run([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)


def test_the_heap_is_frozen_at_exit_after_the_other_handlers_ran(tmp_path):
    written = tmp_path / "written.txt"
    process = run_python(_SEES_THE_EXIT + f"""
from tfscale.launch import fast_exit
fast_exit.skip_final_garbage_collection()
fast_exit.skip_final_garbage_collection()  # once, however often asked
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
