"""BatchNorm moving statistics: the same on every worker and in the export."""

import pytest
import numpy as np
import tensorflow as tf

from multiworker import assert_succeeded
from multiworker import run_workers
from tfscale import data

pytestmark = pytest.mark.multiworker



def test_statistics_agree_across_workers_and_in_the_served_export(tmp_path):
    export_dir = tmp_path / "export"
    synced = run_workers("fit_worker.py", 2, tmp_path,
                         args=["--model=bn", f"--export_dir={export_dir}"])
    assert_succeeded(synced)
    unsynced = run_workers("fit_worker.py", 2, tmp_path,
                           args=["--model=bn", "--nosync_bn"])
    assert_succeeded(unsynced)
    a, b = (r["non_trainable"] for r in synced.results)
    assert len(a) == 2  # BatchNormalization's moving mean and variance
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    # Without the sync each worker keeps statistics of its own half-batches,
    # so this test would catch the sync breaking.
    c, d = (r["non_trainable"] for r in unsynced.results)
    assert any(not np.array_equal(x, y) for x, y in zip(c, d, strict=True))

    # The chief's export, loaded as a serving user does: it holds the synced
    # statistics and serves what the trained model predicts in process.
    loaded = tf.saved_model.load(str(export_dir))
    exported = [v.numpy().ravel() for v in loaded.non_trainable_variables]
    for x, y in zip(exported, a, strict=True):
        np.testing.assert_array_equal(x, y)
    images, _ = data.digits_arrays("test")
    predicted = np.asarray(synced.results[0]["served_images_probabilities"])
    served = loaded.signatures["serving_default"](
        images=tf.constant(images[:len(predicted)]))["probabilities"].numpy()
    np.testing.assert_array_equal(served.argmax(1), predicted.argmax(1))
    np.testing.assert_allclose(served, predicted, rtol=1e-5, atol=1e-6)
    # Both workers predicted the same (same weights and statistics).
    np.testing.assert_array_equal(
        predicted, synced.results[1]["served_images_probabilities"])


def test_syncing_synced_statistics_changes_nothing(tmp_path):
    """Three workers (a mean over 3 is inexact in float32): the statistics a
    checkpoint holds are bitwise those of the export synced after it."""
    run = run_workers("batch_norm_resync.py", 3, tmp_path)
    assert_succeeded(run)
    start = np.array([r["start"] for r in run.results], np.float64)
    for result in run.results:
        np.testing.assert_array_equal(result["once"], run.results[0]["once"])
        np.testing.assert_allclose(result["once"], start.mean(axis=0), rtol=1e-6)
        np.testing.assert_array_equal(result["twice"], result["once"])
