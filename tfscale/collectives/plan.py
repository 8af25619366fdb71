"""The all-reduce plan: fused buckets, each with its algorithm and chunking.

`plan` is a pure function of static information (tensor sizes and dtypes, the
topology, the options), so every worker computes the same plan and issues the
same collectives in the same order.
"""

import dataclasses

import tensorflow as tf

from tfscale import communication_names
from tfscale.collectives import autotune
from tfscale.collectives import compression as compression_lib
from tfscale.collectives import cost_model as cost_model_lib
from tfscale.collectives import fusion
from tfscale.collectives import topology as topology_lib

# Algorithms a user can ask for: one of the buffer algorithms, or "hybrid":
# per bucket, "hierarchical" below the hybrid threshold and "ring" at or
# above it (Jia et al. 2018, section 4.3); without a threshold, the faster
# of ring and hierarchical by the cost model; or "auto", chosen per bucket by
# measuring the job (`autotune`). Benchmarks compare the fixed ones.
FIXED_ALGORITHMS = communication_names.FIXED_ALGORITHMS
ALGORITHMS = communication_names.ALGORITHMS
# What "hybrid" chooses from. Not halving_doubling, the latency-optimal
# algorithm on paper: TensorFlow has no point-to-point op, so each of its
# 2 log2(n) steps is a collective op of its own over a pair group, and each
# op has a fixed cost whatever its size, so its ops cost more than the one
# op of a ring (`tfscale-bench fixedcost`; BENCHMARKS.md, section "The fixed
# cost of one collective"). The
# alpha-beta cost model, which counts link latency and not that cost,
# predicts it fastest on small buffers, where it measured slowest.
HYBRID_CANDIDATES = ("ring", "hierarchical")
COMPRESSIONS = communication_names.COMPRESSIONS
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
        algorithm: one of `communication_names.BUFFER_ALGORITHMS`, or "auto": one of
            `candidates`, chosen at run time (`autotune`).
        num_chunks: independent chains the buffer is split into.
        candidates: "auto" only: `(algorithm, num_chunks)` of each
            algorithm tried, the cost model's fastest for the plan first.
    """

    indices: tuple
    size_bytes: int
    dtype: tf.DType
    wire_dtype: tf.DType
    algorithm: str
    num_chunks: int
    candidates: tuple = ()

    @property
    def wire_bytes(self):
        return self.size_bytes // self.dtype.size * self.wire_dtype.size


def check_supported(topology, algorithm):
    """Raises if `algorithm` cannot run on `topology`.

    "2d" needs nodes of equal size (its shards are 1/k of a node's buffer,
    the same k everywhere) of at most `MAX_2D_LOCAL_SIZE`;
    "halving_doubling" a pair group for each pair of workers that exchange
    (`topology.halving_doubling_fits`).
    """
    if algorithm == "halving_doubling" and not topology_lib.halving_doubling_fits(
            topology):
        raise NotImplementedError(
            "algorithm='halving_doubling' needs more pair groups on "
            f"{topology.num_workers:,} workers than a strategy's collective "
            "keys hold. Use algorithm='ring', 'hierarchical' or 'hybrid'."
        )
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
            the faster of `HYBRID_CANDIDATES` by the cost model's prediction
            (ties go to the one listed first).
        compression: `None` or one of `COMPRESSIONS`; applies to float32
            buckets of more than one element.
        cost_model: a `cost_model.CostModel` for the hybrid threshold and
            chunk counts; `None`: `cost_model.DEFAULT`.

    Returns:
        A list of `Bucket`.
    """
    model = cost_model or cost_model_lib.DEFAULT
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
            # crossovers may run either way (a fitted model can favour the
            # ring for small buffers and hierarchical for large ones).
            chosen = min(HYBRID_CANDIDATES, key=lambda a: model.predict(
                a, wire_bytes, topology.node_sizes))
        elif algorithm == "hybrid":
            chosen = "hierarchical" if wire_bytes < hybrid_threshold_bytes else "ring"
        # A shape known only at run time (a data batch Keras reduces once)
        # cannot be split into static chunks or shards; a ring handles it.
        # Without a hierarchy the hierarchical algorithms are a ring.
        if any(sizes_bytes[i] == 0 for i in indices) or (
                topology.is_flat and chosen in ("hierarchical", "2d")):
            chosen = "ring"
        num_chunks = 1
        if chosen != "ring":
            num_chunks = model.best_num_chunks(chosen, wire_bytes, topology.node_sizes)
        buckets.append(Bucket(
            indices=tuple(indices), size_bytes=size, dtype=dtype,
            wire_dtype=wire_dtype, algorithm=chosen, num_chunks=num_chunks,
        ))
    return buckets


def supports(topology, algorithm):
    """Whether `algorithm` runs on `topology` (`check_supported`)."""
    try:
        check_supported(topology, algorithm)
    except NotImplementedError:
        return False
    return True


def auto_plan(sizes_bytes, dtypes, topology, fusion_threshold_bytes,
              compression=None, cost_model=None, order=None):
    """The plan of algorithm="auto": `plan`'s buckets, each with the
    candidates `autotune` tries (`Bucket.candidates`), ordered by the cost
    model's prediction for the whole plan (or as `order` lists them: the
    plans of one call's thresholds share one order). With one candidate
    (one node, one worker per node) its plain plan."""
    model = cost_model or cost_model_lib.DEFAULT
    names = autotune.candidates(topology, lambda a: supports(topology, a))
    plans = {a: plan(sizes_bytes, dtypes, topology, a, fusion_threshold_bytes,
                     compression=compression, cost_model=model) for a in names}

    def predicted(algorithm):
        return sum(model.predict(b.algorithm, b.wire_bytes, topology.node_sizes,
                                 b.num_chunks) for b in plans[algorithm])

    names = sorted(names, key=predicted) if order is None else list(order)
    if len(names) == 1:
        return plans[names[0]]
    buckets = []
    for alike in zip(*(plans[a] for a in names)):
        choices = tuple((b.algorithm, b.num_chunks) for b in alike)
        if len({b.algorithm for b in alike}) == 1:  # a size known only at run time
            buckets.append(alike[0])
        else:
            buckets.append(dataclasses.replace(
                alike[0], algorithm=autotune.NAME, num_chunks=1, candidates=choices))
    return buckets


def describe_plan(buckets):
    """One line per bucket, for the log."""
    lines = []
    for i, b in enumerate(buckets):
        wire = ""
        if b.wire_dtype != b.dtype:
            wire = f" -> {b.wire_bytes:,} bytes {b.wire_dtype.name} on the wire"
        chunks = f" in {b.num_chunks} chunks" if b.num_chunks > 1 else ""
        if b.candidates:
            chunks = " of " + ", ".join(
                a + (f" in {n} chunks" if n > 1 else "") for a, n in b.candidates)
        lines.append(
            f"  bucket {i}: {len(b.indices)} tensor(s), {b.size_bytes:,} bytes "
            f"{b.dtype.name}{wire}: {b.algorithm}{chunks}"
        )
    return "\n".join(lines)
