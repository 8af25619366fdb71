"""The worker side of `tfscale-bench gpucheck`: one process of the check.

Runs `allreduce_worker.measure` on the spec gpucheck.py writes (one
`tfscale.Strategy` per algorithm and implementation; each result checked
against the exact sum), and adds what this worker sees: its
CUDA_VISIBLE_DEVICES and the GPUs TensorFlow lists.
"""

import os

import tensorflow as tf

from tfscale.launch.bench import allreduce_worker


def visible_gpus():
    """A description of each GPU TensorFlow sees, e.g.
    "/physical_device:GPU:0 NVIDIA A100-SXM4-80GB (compute capability 8.0)"."""
    described = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        capability = details.get("compute_capability")
        capability = (f" (compute capability {capability[0]}.{capability[1]})"
                      if capability else "")
        described.append(f"{gpu.name} {details.get('device_name', '')}{capability}")
    return described


def measure(spec):
    """`allreduce_worker.measure(spec)` plus `gpus` and `cuda_visible_devices`."""
    gpus = visible_gpus()  # before the strategies, as the user would see them
    result = allreduce_worker.measure(spec)
    result.update(gpus=gpus, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return result
