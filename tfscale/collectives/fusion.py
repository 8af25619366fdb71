"""Tensor fusion: many small gradients packed into few large buffers.

One collective per tensor pays the per-message latency hundreds of times per
step (ResNet-50 has 161 gradient tensors, most under 1 MiB). Packing them into
buffers of about `threshold_bytes` pays it a few times, and because buffers are
filled in backward order (last layer first, the order backprop produces
gradients) the first buffer can be reduced while earlier layers are still
being differentiated (Jia et al. 2018, section 4.1; Horovod's tensor fusion).
"""

import tensorflow as tf


def bucket_indices(sizes_bytes, dtypes, threshold_bytes):
    """Groups consecutive tensors into buckets of about `threshold_bytes`.

    A bucket is closed once its size reaches the threshold, or when the next
    tensor has another dtype (a buffer holds one dtype). `threshold_bytes=0`
    gives one bucket per tensor.

    Args:
        sizes_bytes: size of each tensor, in the order they will be reduced.
        dtypes: dtype of each tensor.
        threshold_bytes: bucket size at which a bucket is closed.

    Returns:
        A list of buckets, each a list of indices into `sizes_bytes`.
    """
    buckets, current, current_bytes = [], [], 0
    for index, (size, dtype) in enumerate(zip(sizes_bytes, dtypes)):
        if current and dtype != dtypes[current[-1]]:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
        if current_bytes >= threshold_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def size_bytes(tensor):
    """Bytes of a tensor; 0 where its shape is only known at run time.

    Gradients always have static shapes; the rare dynamic value (a data batch
    Keras reduces once while building) is packed all the same.
    """
    return (tensor.shape.num_elements() or 0) * tensor.dtype.size


def pack(tensors):
    """Flattens and concatenates tensors of one dtype into one 1-D buffer.

    Returns:
        `(buffer, shapes)`: what `unpack` needs to restore the tensors.
    """
    shapes = [tf.shape(t) for t in tensors]
    if len(tensors) == 1:
        return tf.reshape(tensors[0], [-1]), shapes
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0), shapes


def unpack(buffer, shapes):
    """Inverse of `pack`: splits `buffer` back into tensors of `shapes`."""
    if len(shapes) == 1:
        return [tf.reshape(buffer, shapes[0])]
    sizes = [tf.reduce_prod(s) for s in shapes]
    parts = tf.split(buffer, sizes, axis=0)
    return [tf.reshape(p, s) for p, s in zip(parts, shapes)]
