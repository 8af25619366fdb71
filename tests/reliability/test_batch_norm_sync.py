"""BatchNorm moving statistics: the same on every worker and in the export."""

import numpy as np

from multiworker import assert_succeeded
from multiworker import run_workers


def test_statistics_diverge_without_sync_and_agree_with_it(tmp_path):
    synced = run_workers("fit_worker.py", 2, tmp_path, args=["--model=bn"])
    assert_succeeded(synced)
    unsynced = run_workers("fit_worker.py", 2, tmp_path,
                           args=["--model=bn", "--nosync_bn"])
    assert_succeeded(unsynced)
    a, b = (r["non_trainable"] for r in synced.results)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    # Without the sync each worker keeps statistics of its own half-batches,
    # so this test would catch the sync breaking.
    a, b = (r["non_trainable"] for r in unsynced.results)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))
