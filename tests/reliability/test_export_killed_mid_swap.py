"""A process killed at any step of an export leaves a loadable export.

The child exports model 0, then exports model 1 and is killed with SIGKILL
at one step of replacing it: right after the new SavedModel is written (before
the swap), right after the swap (before the old export is deleted), or right
after any rename that moves the live export away (what a two-rename swap does
first; the atomic exchange never does it, so that child finishes). The kill
is injected through the functions the export calls (`ExportArchive.write_out`,
`shutil.rmtree`, `os.rename`).
"""

import os
import signal
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import multiworker
from multiworker import worker_env

CHILD = textwrap.dedent("""
    import os, shutil, signal, sys
    import keras
    from tfscale import data, export

    target, kill_at = sys.argv[1], sys.argv[2]
    spec = data.spec("digits")

    def model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                 keras.layers.Dense(10)])

    export.export_classifier(model(0), target, spec, 8)
    archive_class = type(keras.export.ExportArchive())
    write_out, rmtree = archive_class.write_out, shutil.rmtree

    def write_then_die(self, path, **kwargs):
        write_out(self, path, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    def die_before_removing_the_old_export(path, *args, **kwargs):
        if os.path.exists(os.path.join(path, "saved_model.pb")):
            os.kill(os.getpid(), signal.SIGKILL)
        rmtree(path, *args, **kwargs)

    rename = os.rename

    def die_after_moving_the_export_away(source, destination):
        rename(source, destination)
        if os.path.abspath(source) == os.path.abspath(target):
            os.kill(os.getpid(), signal.SIGKILL)

    if kill_at == "before_swap":
        archive_class.write_out = write_then_die
    elif kill_at == "after_swap":
        shutil.rmtree = die_before_removing_the_old_export
    else:
        os.rename = die_after_moving_the_export_away
    export.export_classifier(model(1), target, spec, 8)
""")


def run_child(tmp_path, target, kill_at):
    """CHILD as a process of its own (`python child.py TARGET KILL_AT`)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return multiworker.run([sys.executable, str(script), str(target), kill_at],
                           tmp_path, worker_env(tmp_path), timeout=300)


def serve(path):
    images = np.arange(2 * 64, dtype=np.uint8).reshape(2, 8, 8, 1)
    signature = tf.saved_model.load(str(path)).signatures["serving_default"]
    return signature(images=tf.constant(images))["probabilities"].numpy()


def reference(tmp_path, seed):
    """What model `seed` serves, exported without interruption."""
    import keras

    from tfscale import data
    from tfscale import export

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    return serve(export.export_classifier(
        model, str(tmp_path / f"reference-{seed}"), data.spec("digits"), 8))


@pytest.mark.parametrize("kill_at,serves_seed", [
    ("before_swap", 0),   # the new export was complete but not in place
    ("after_swap", 1),    # in place; the old one not yet deleted
])
@pytest.mark.multiworker
def test_killed_export_leaves_a_loadable_export(tmp_path, kill_at, serves_seed):
    target = tmp_path / "export"
    child = run_child(tmp_path, target, kill_at)
    assert child.returncode == -signal.SIGKILL, child.stdout[-3000:]
    np.testing.assert_array_equal(serve(target), reference(tmp_path, serves_seed))
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith("export.")]
    assert len(leftovers) == 1 and ".partial-" in leftovers[0]
    assert_next_export_cleans_up(tmp_path, target)


@pytest.mark.multiworker
def test_export_is_never_moved_away_from_export_dir(tmp_path):
    target = tmp_path / "export"
    child = run_child(tmp_path, target, "after_moving_away")
    assert child.returncode == 0, (
        f"killed after moving the export away (exit {child.returncode}): "
        f"{sorted(os.listdir(tmp_path))}\n{child.stdout[-3000:]}")
    np.testing.assert_array_equal(serve(target), reference(tmp_path, 1))


def assert_next_export_cleans_up(tmp_path, target):
    """The next export removes what a killed one left behind."""
    from tfscale import data
    from tfscale import export
    import keras

    export.export_classifier(keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]),
        str(target), data.spec("digits"), 8)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("export")) == [
        "export"]


def test_replace_directory_swaps_a_directory_into_place(tmp_path):
    from tfscale import export

    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "version").write_text("2")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "version").write_text("1")
    export.replace_directory(str(tmp_path / "new"), str(tmp_path / "target"))
    assert (tmp_path / "target" / "version").read_text() == "2"
    assert (tmp_path / "new" / "version").read_text() == "1"  # for the caller to delete
