"""Collective algorithms over TensorFlow's own collective ops.

Pure tensor functions and the plan that ties them together for
`tfscale.Strategy`:

- `topology`: which workers share a node; the sub-groups that follow.
- `fusion`: bucketing in backward order, pack/unpack.
- `compression`: 16-bit wire formats for float32 buffers.
- `algorithms`: ring, hierarchical and 2d all-reduce of one buffer.
- `cost_model`: alpha-beta predictions, the hybrid threshold, chunk counts.

`plan` decides, per fused bucket, the algorithm and its chunking; `AllReduce`
carries a plan out on this worker's collective groups.
"""

import dataclasses
import math

from absl import logging
import tensorflow as tf

from tfscale.collectives import algorithms
from tfscale.collectives import compression as compression_lib
from tfscale.collectives import cost_model as cost_model_lib
from tfscale.collectives import fusion
from tfscale.collectives import topology as topology_lib

# Algorithms a user can ask for. "hybrid": per bucket, "hierarchical" below
# the hybrid threshold and "ring" at or above it.
ALGORITHMS = ("ring", "hierarchical", "2d", "hybrid")
COMPRESSIONS = tuple(compression_lib.WIRE_DTYPES)
# 2d tags shards with the local rank in the wire dtype; bfloat16 holds the
# integers up to 256 exactly.
MAX_2D_LOCAL_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One fused buffer and how it is all-reduced.

    Attributes:
        indices: positions, in the list handed to `plan`, of its tensors.
        size_bytes: bytes of its tensors (0 when a shape is only known at
            run time).
        dtype: dtype of its tensors.
        wire_dtype: dtype on the wire (differs from `dtype` when compressed).
        algorithm: `"ring"`, `"hierarchical"` or `"2d"`.
        num_chunks: independent chains the buffer is split into.
    """

    indices: tuple
    size_bytes: int
    dtype: tf.DType
    wire_dtype: tf.DType
    algorithm: str
    num_chunks: int

    @property
    def wire_bytes(self):
        return self.size_bytes // self.dtype.size * self.wire_dtype.size


def check_supported(topology, algorithm):
    """Raises if `algorithm` cannot run on `topology`.

    Only "2d" has requirements: nodes of equal size (its shards are 1/k of a
    node's buffer, the same k everywhere) of at most `MAX_2D_LOCAL_SIZE`.
    """
    if algorithm != "2d" or topology.is_flat:
        return
    if not topology.equal_nodes:
        raise NotImplementedError(
            "algorithm='2d' needs nodes with the same number of workers; this "
            f"cluster has {topology.describe()}. Use algorithm='hierarchical' "
            "or 'hybrid' (both handle unequal nodes), or set `local_size` to a "
            "divisor of the number of workers."
        )
    if topology.local_size > MAX_2D_LOCAL_SIZE:
        raise NotImplementedError(
            f"algorithm='2d' supports nodes of at most {MAX_2D_LOCAL_SIZE} "
            f"workers; this cluster has {topology.describe()}. Use "
            "algorithm='hierarchical' instead."
        )


def hybrid_threshold(topology, hybrid_threshold_bytes=None, cost_model=None):
    """The threshold "hybrid" uses: as given, or the cost model's.

    Returns:
        `(threshold_bytes, source)` with source `"given"` or `"cost model"`;
        the threshold may be `math.inf` (see
        `CostModel.hybrid_threshold_bytes`).
    """
    if hybrid_threshold_bytes is not None:
        return hybrid_threshold_bytes, "given"
    model = cost_model or cost_model_lib.DEFAULT
    return model.hybrid_threshold_bytes(topology.node_sizes), "cost model"


def plan(
    sizes_bytes, dtypes, topology, algorithm, fusion_threshold_bytes,
    hybrid_threshold_bytes=None, compression=None, cost_model=None,
):
    """Buckets tensors and picks each bucket's algorithm and chunking.

    A pure function of static information: every worker computes the same plan.

    Args:
        sizes_bytes: bytes of each tensor, in the order they are reduced
            (backward order for gradients); 0 for a shape known only at run
            time.
        dtypes: dtype of each tensor.
        topology: a `topology.Topology`.
        algorithm: one of `ALGORITHMS`.
        fusion_threshold_bytes: see `fusion.bucket_indices`.
        hybrid_threshold_bytes: for "hybrid": wire bytes at which a bucket
            goes by ring instead of hierarchical; `None`: each bucket takes
            the algorithm the cost model predicts faster.
        compression: `None` or one of `COMPRESSIONS`; applies to float32
            buckets of more than one element.
        cost_model: a `cost_model.CostModel` for the hybrid threshold and
            chunk counts; `None`: `cost_model.DEFAULT`.

    Returns:
        A list of `Bucket`.
    """
    model = cost_model or cost_model_lib.DEFAULT
    threshold = None
    if algorithm == "hybrid":
        threshold, _ = hybrid_threshold(topology, hybrid_threshold_bytes, model)
    buckets = []
    for indices in fusion.bucket_indices(sizes_bytes, dtypes, fusion_threshold_bytes):
        dtype = tf.as_dtype(dtypes[indices[0]])
        size = sum(sizes_bytes[i] for i in indices)
        wire_dtype = dtype
        # A lone scalar (a loss, a metric, a loss-scale flag) saves nothing
        # and is read as an exact number: it travels as it is.
        if size > dtype.size:
            wire_dtype = compression_lib.wire_dtype(dtype, compression)
        wire_bytes = size // dtype.size * wire_dtype.size
        chosen = algorithm
        if algorithm == "hybrid" and hybrid_threshold_bytes is None:
            # The cost model decides each bucket by predicted time: its
            # crossover may run either way (a fitted model can favour the ring
            # for small buffers and hierarchical for large ones).
            node_sizes = topology.node_sizes
            faster = model.predict("hierarchical", wire_bytes, node_sizes) < (
                model.predict("ring", wire_bytes, node_sizes))
            chosen = "hierarchical" if faster else "ring"
        elif algorithm == "hybrid":
            chosen = "hierarchical" if wire_bytes < threshold else "ring"
        # A shape known only at run time (a data batch Keras reduces once)
        # cannot be split into static chunks or shards; a ring handles it.
        if topology.is_flat or any(sizes_bytes[i] == 0 for i in indices):
            chosen = "ring"
        num_chunks = 1
        if chosen != "ring":
            num_chunks = model.best_num_chunks(chosen, wire_bytes, topology.node_sizes)
        buckets.append(Bucket(
            indices=tuple(indices), size_bytes=size, dtype=dtype,
            wire_dtype=wire_dtype, algorithm=chosen, num_chunks=num_chunks,
        ))
    return buckets


def timed_all_reduce(reduce_fn, tensors, exposed_seconds):
    """`reduce_fn(tensors)`, adding its exposed communication time to a variable.

    Adds to `exposed_seconds` (a float64 `tf.Variable`) the seconds from the
    moment the last of `tensors` is ready to the moment the last result is:
    the part of the all-reduce not overlapped with computing its inputs.

    Returns:
        What `reduce_fn` returns (tensors, or a nest of them).
    """
    with tf.control_dependencies(tf.nest.flatten(tensors)):
        inputs_ready = tf.timestamp()
    reduced = reduce_fn(tensors)
    with tf.control_dependencies(tf.nest.flatten(reduced)):
        # A stateful op: tf.function runs it although nothing consumes it.
        exposed_seconds.assign_add(tf.timestamp() - inputs_ready)
    return reduced


def describe_plan(buckets):
    """One line per bucket, for the log."""
    lines = []
    for i, b in enumerate(buckets):
        wire = ""
        if b.wire_dtype != b.dtype:
            wire = f" -> {b.wire_bytes:,} bytes {b.wire_dtype.name} on the wire"
        chunks = f" in {b.num_chunks} chunks" if b.num_chunks > 1 else ""
        lines.append(
            f"  bucket {i}: {len(b.indices)} tensor(s), {b.size_bytes:,} bytes "
            f"{b.dtype.name}{wire}: {b.algorithm}{chunks}"
        )
    return "\n".join(lines)


def make_groups(world, topology):
    """This worker's `algorithms.Groups`, sub-groups created from `world`.

    Args:
        world: `CollectiveGroup` (tfscale._tf_private) of all workers.
        topology: a `topology.Topology`.
    """
    groups = {
        kind: world.subgroup(index, size)
        for kind, (index, size) in topology_lib.subgroup_indices(topology).items()
    }
    return algorithms.Groups(
        world=world,
        intra_in=groups.get("intra_in"),
        intra_out=groups.get("intra_out"),
        cross=groups.get("cross"),
        local_rank=topology.local_rank,
        local_size=topology.local_size,
    )


def fused_all_reduce(tensors, groups, buckets, compression=None):
    """Sums `tensors` over all workers following a plan.

    Args:
        tensors: dense tensors, in the order given to `plan`.
        groups: this worker's `algorithms.Groups`.
        buckets: `plan(...)` for these tensors.
        compression: as given to `plan` (applied where a bucket's
            `wire_dtype` says so).

    Returns:
        The summed tensors, in the order given.
    """
    num_workers = groups.world.size

    def max_all_reduce(value):
        return groups.world.all_reduce(value, merge_op="Max")

    results = [None] * len(tensors)
    for bucket in buckets:
        buffer, shapes = fusion.pack([tensors[i] for i in bucket.indices])
        wire, context = compression_lib.compress(
            buffer, compression if bucket.wire_dtype != bucket.dtype else None,
            num_workers, max_all_reduce,
        )
        reduce_buffer = algorithms.ALGORITHMS[bucket.algorithm]
        reduced = compression_lib.decompress(
            reduce_buffer(wire, groups, bucket.num_chunks), context
        )
        for i, tensor in zip(bucket.indices, fusion.unpack(reduced, shapes)):
            results[i] = tensor
    return results


class AllReduce:
    """What `tfscale.Strategy` hands its cross-device ops: `fn(tensors, world)`.

    Fuses tensors in backward order (last layer first: backprop produces those
    first, so their buckets can be reduced while earlier layers are still
    being differentiated), plans each bucket, and runs the plan. The plan of
    each distinct list of tensors is logged once, where `log_plans` is set
    (the chief).

    Args:
        topology: a `topology.Topology`.
        algorithm: one of `ALGORITHMS`.
        fusion_threshold_bytes: bucket size, see `fusion.bucket_indices`.
        hybrid_threshold_bytes: see `plan`.
        compression: see `plan`.
        cost_model: see `plan`.
        log_plans: whether to log each new plan (set it on the chief only).
        exposed_seconds: `None`, or a float64 `tf.Variable` to which each call
            adds its exposed communication time (see `timed_all_reduce`).
            Buckets reduced while backprop still runs are hidden from it;
            waiting for a slower worker is not.
    """

    def __init__(
        self, topology, algorithm, fusion_threshold_bytes,
        hybrid_threshold_bytes=None, compression=None, cost_model=None,
        log_plans=False, exposed_seconds=None,
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"Argument `algorithm` must be one of {list(ALGORITHMS)}. "
                f"Received: algorithm={algorithm!r}"
            )
        check_supported(topology, algorithm)
        self.topology = topology
        self.algorithm = algorithm
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.hybrid_threshold_bytes = hybrid_threshold_bytes
        self.compression = compression
        self.cost_model = cost_model or cost_model_lib.DEFAULT
        self.log_plans = log_plans
        self.exposed_seconds = exposed_seconds
        # Resolved once: the cost model's search is not free, and the log
        # should say where the value came from.
        self.threshold_bytes, self.threshold_source = (None, None)
        if algorithm == "hybrid":
            self.threshold_bytes, self.threshold_source = hybrid_threshold(
                topology, hybrid_threshold_bytes, self.cost_model
            )
        self._groups = {}
        self._logged = set()

    def plan(self, tensors):
        """The buckets for `tensors` (given in forward order)."""
        backward = list(reversed(tensors))
        return plan(
            [fusion.size_bytes(t) for t in backward],
            [t.dtype for t in backward],
            self.topology, self.algorithm, self.fusion_threshold_bytes,
            self.threshold_bytes, self.compression, self.cost_model,
        )

    def groups(self, world):
        """This worker's groups under `world`, created once."""
        if id(world) not in self._groups:
            if self.algorithm == "ring" or self.topology.is_flat:
                groups = algorithms.Groups(world=world)  # no sub-groups needed
            else:
                groups = make_groups(world, self.topology)
            # Holding `world` keeps its id from being reused.
            self._groups[id(world)] = (world, groups)
        return self._groups[id(world)][1]

    def __call__(self, tensors, world):
        """Sums `tensors` (dense, forward order) over all workers."""
        backward = list(reversed(tensors))
        buckets = self.plan(tensors)
        self._log(buckets)
        def reduce_fn(backward):
            return fused_all_reduce(
                backward, self.groups(world), buckets, self.compression
            )

        if self.exposed_seconds is None:
            return list(reversed(reduce_fn(backward)))
        return list(reversed(
            timed_all_reduce(reduce_fn, backward, self.exposed_seconds)
        ))

    def _log(self, buckets):
        key = tuple((b.indices, b.size_bytes, b.dtype, b.algorithm) for b in buckets)
        if not self.log_plans or key in self._logged:
            return
        self._logged.add(key)
        threshold = ""
        if self.algorithm == "hybrid" and self.threshold_source != "given":
            threshold = ", hybrid: each bucket by the cost model's faster prediction"
        elif self.algorithm == "hybrid":
            value = self.threshold_bytes
            shown = (
                "none (hierarchical at every size)" if value == math.inf
                else f"{value:,} bytes"
            )
            threshold = f", hybrid threshold {shown} ({self.threshold_source})"
        logging.info(
            "tfscale all-reduce of %d tensor(s) on %s: algorithm=%s, "
            "fusion_threshold_bytes=%s, compression=%s%s; %d bucket(s), "
            "last layers first:\n%s",
            sum(len(b.indices) for b in buckets), self.topology.describe(),
            self.algorithm, f"{self.fusion_threshold_bytes:,}", self.compression,
            threshold, len(buckets), describe_plan(buckets),
        )
