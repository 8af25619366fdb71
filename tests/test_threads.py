"""launch/threads.py: each worker's share of the cores, and TensorFlow reading it."""

import subprocess
import sys

import pytest

from tfscale.launch import threads

# The process's threads once TensorFlow has made its pools (a matmul runs on
# the intra-op pool).
_COUNT_THREADS = """
import os
import tensorflow as tf
tf.linalg.matmul(tf.ones([256, 256]), tf.ones([256, 256])).numpy()
print(len(os.listdir("/proc/self/task")))
"""


def test_the_share_is_cores_over_workers_at_least_one_unless_set():
    cores = threads.usable_cores()
    assert threads.worker_environment(2, environ={}) == {
        "TF_NUM_INTRAOP_THREADS": str(max(1, cores // 2))}
    assert threads.worker_environment(4 * cores, environ={}) == {
        "TF_NUM_INTRAOP_THREADS": "1"}
    # The user's value stands; one worker keeps TensorFlow's default.
    assert threads.worker_environment(2, environ={"TF_NUM_INTRAOP_THREADS": "7"}) == {}
    assert threads.worker_environment(1, environ={}) == {}
    assert threads.describe(2, environ={"TF_NUM_INTRAOP_THREADS": "7"}) is None
    assert threads.describe(1, environ={}) is None


def _threads_of_tensorflow(intra_op_threads):
    env = {"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "3",
           "TF_NUM_INTRAOP_THREADS": str(intra_op_threads)}
    out = subprocess.run([sys.executable, "-c", _COUNT_THREADS], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.multiworker  # two TensorFlow processes
def test_tensorflow_sizes_its_intra_op_pool_by_the_variable():
    # If TensorFlow stops reading TF_NUM_INTRAOP_THREADS, the launcher's
    # share does nothing: 1 and 9 threads must make different pools.
    assert _threads_of_tensorflow(9) - _threads_of_tensorflow(1) == 8
