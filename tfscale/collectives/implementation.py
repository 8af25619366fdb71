"""Which implementation carries the collectives: NCCL on GPUs, ring elsewhere.

TensorFlow's names (`tf.distribute.experimental.CommunicationImplementation`):

- `"ring"`: TensorFlow's ring collectives over gRPC, on any device.
- `"nccl"`: NVIDIA's NCCL, between GPUs.
- `"auto"`: NCCL when the worker's device is a GPU, ring otherwise. (Stock
  MultiWorkerMirroredStrategy's AUTO means ring even on GPUs: TF 2.x
  `collective_all_reduce_strategy.py` never turns `collective_nccl` on for
  it. tfscale's "auto" does choose NCCL there.)

What the NCCL path changes, from TensorFlow's sources (read, not run on a GPU
by this project; see `tfscale._private.tf_collectives.CollectiveGroup`):

- Every NCCL communicator of a GPU shares one NCCL stream
  (core/nccl/nccl_manager.cc, `device_to_comm_streams_`), and an NCCL kernel
  blocks until every member has launched it: collectives of different groups
  must be launched in one order that all workers share. Every NCCL
  collective of a worker sits on one ordering chain.
- NCCL sums half, float, double, int32 and int64 (`kValidDataTypes` in
  nccl_manager.cc): no bfloat16. bfloat16 wire compression becomes float16
  (`wire_compression`).
- `broadcast_send_v2`/`broadcast_recv_v2` take no ordering token: on the
  NCCL path a broadcast is an all-reduce to which only the sender contributes.
- Chunks cannot overlap on one chain: hierarchical and 2d send each bucket
  whole (`num_chunks=1`).
"""

import tensorflow as tf

from tfscale import communication_names
from tfscale._private.tf_collectives import NCCL_DTYPES  # noqa: F401 (what NCCL sums)
from tfscale.collectives import autotune

IMPLEMENTATIONS = communication_names.IMPLEMENTATIONS


def check_implementation(implementation, num_gpus=None):
    """Raises `ValueError` if `implementation` is unknown, or is "nccl" on a
    machine where TensorFlow sees `num_gpus == 0` GPUs (`None`: not looked
    at)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"Argument `implementation` must be one of {list(IMPLEMENTATIONS)}. "
            f"Received: implementation={implementation!r}"
        )
    if implementation == "nccl" and num_gpus == 0:
        raise ValueError(
            "implementation='nccl' needs GPUs, and TensorFlow sees none on "
            "this machine (tf.config.list_physical_devices('GPU') is empty; "
            "tensorflow-cpu has no NCCL). Use implementation='auto' (NCCL on "
            "GPUs, ring elsewhere) or 'ring'. Received: implementation='nccl'"
        )


def resolve(implementation, device):
    """The implementation that runs on `device`: `"ring"` or `"nccl"`.

    Args:
        implementation: one of `IMPLEMENTATIONS`.
        device: the worker's device name, e.g.
            "/job:worker/replica:0/task:1/device:GPU:0".

    Raises:
        ValueError: "nccl" on a device that is not a GPU.
    """
    is_gpu = tf.DeviceSpec.from_string(device).device_type == "GPU"
    if implementation == "auto":
        return "nccl" if is_gpu else "ring"
    if implementation == "nccl" and not is_gpu:
        raise ValueError(
            "implementation='nccl' runs between GPUs, but this worker's device "
            f"is {device}. Use implementation='auto' or 'ring'."
        )
    return implementation


def default_algorithm(implementation, hybrid_threshold_bytes=None):
    """The algorithm of `CommunicationOptions(algorithm=None)` on
    `implementation`.

    Over TensorFlow's ring, "auto": each buffer's fastest of ring,
    hierarchical and 2d, measured by the job in its first steps
    (`autotune`; why it is the default: docs/communication.md). With one
    node, or one worker per node, it is the ring and tries nothing; inside
    XLA or under op determinism, the cost model's choice. Over NCCL,
    "ring": one NCCL all-reduce per fused bucket over the world group,
    inside which NCCL picks its own ring or tree for the topology: the
    path every NCCL user runs (Horovod, PyTorch DDP, stock
    MultiWorkerMirroredStrategy with NCCL); "auto" is refused there (`autotune.NCCL_REFUSAL`), and
    tfscale's sub-group algorithms over NCCL put several communicators on
    one GPU stream, which no tfscale test has run on a GPU; they stay
    available by name. A `hybrid_threshold_bytes` asks for "hybrid" on
    either.
    """
    if hybrid_threshold_bytes is not None:
        return "hybrid"
    return "ring" if implementation == "nccl" else autotune.NAME


def wire_compression(compression, implementation):
    """The compression that runs: NCCL has no bfloat16, so on the NCCL path
    "bfloat16" becomes "float16" (scaled per buffer so that the sum cannot
    overflow, see `compression`)."""
    if implementation == "nccl" and compression == "bfloat16":
        return "float16"
    return compression
