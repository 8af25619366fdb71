"""Collective algorithms over TensorFlow's own collective ops.

Pure tensor functions: topology, fusion (bucketing, pack/unpack), the
all-reduce algorithms, and `fused_all_reduce`, which ties them together for
`tfscale.Strategy`.
"""

from absl import logging

from tfscale.collectives import algorithms
from tfscale.collectives import fusion

ALGORITHMS = {"ring": algorithms.ring_all_reduce}


def fused_all_reduce(tensors, world, algorithm, fusion_threshold_bytes):
    """Sums `tensors` over all workers, fused into buckets in backward order.

    Args:
        tensors: dense tensors with static shapes, in variable (forward)
            order, as Keras hands gradients over.
        world: `CollectiveGroup` of all workers.
        algorithm: a key of `ALGORITHMS`.
        fusion_threshold_bytes: bucket size, see `fusion.bucket_indices`.

    Returns:
        The summed tensors, in the order given.
    """
    # Backward order: the last layers' gradients are ready first.
    backward = list(reversed(tensors))
    buckets = fusion.bucket_indices(
        [fusion.size_bytes(t) for t in backward],
        [t.dtype for t in backward],
        fusion_threshold_bytes,
    )
    logging.log_first_n(
        logging.INFO,
        "tfscale all-reduce: %d tensors in %d buckets of %s bytes, "
        "algorithm=%s" % (
            len(tensors), len(buckets),
            [sum(fusion.size_bytes(backward[i]) for i in b) for b in buckets],
            algorithm),
        3,
    )
    reduce_buffer = ALGORITHMS[algorithm]
    results = [None] * len(backward)
    for bucket in buckets:
        buffer, shapes = fusion.pack([backward[i] for i in bucket])
        reduced = fusion.unpack(reduce_buffer(buffer, world), shapes)
        for i, tensor in zip(bucket, reduced):
            results[i] = tensor
    return list(reversed(results))
