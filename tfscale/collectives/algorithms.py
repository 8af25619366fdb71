"""All-reduce algorithms: pure functions of a 1-D buffer and collective groups.

Each function takes this worker's buffer and returns the element-wise sum over
all workers. The docstring of each states the topology it assumes. They only
issue collectives through the `CollectiveGroup` handles in `Groups`, and every
member of a group issues that group's collectives in the same order, whatever
its place in the topology.

Stages on different groups run concurrently through TensorFlow's ring (each
group orders only its own collectives); through NCCL every collective of a
worker is on one chain, in program order (see `CollectiveGroup`). The hierarchical algorithms split a buffer into `num_chunks`
chunks, each its own chain of stages, so that chunk i crosses between nodes
while chunk i + 1 is reduced inside the node: a pipeline.
"""

import dataclasses

import tensorflow as tf

from tfscale import communication_names
from tfscale.collectives import topology as topology_lib


@dataclasses.dataclass(frozen=True)
class Groups:
    """This worker's collective groups for one topology.

    Attributes:
        world: all workers.
        intra_in: this node's workers, for the first stage; `None` in a node
            of one worker.
        intra_out: the same workers under another group key, for the last
            stage; `None` in a node of one worker.
        cross: the workers with this worker's local rank in every node (for
            local rank 0: the node leaders); `None` if no other node has one.
        local_rank: this worker's index in its node (0: the leader).
        local_size: number of workers in this worker's node.
        rank: this worker's rank in `world`.
        pairs: `{partner rank: 2-member group}` for halving-doubling (see
            `topology.pair_subgroup_indices`); empty when not created.
    """

    world: object
    intra_in: object = None
    intra_out: object = None
    cross: object = None
    local_rank: int = 0
    local_size: int = 1
    rank: int = 0
    pairs: dict = dataclasses.field(default_factory=dict, hash=False)


def ring_all_reduce(buffer, groups, num_chunks=1):
    """Flat ring all-reduce over every worker.

    Topology: none assumed; one ring through all workers (TF's collective
    executor on CPU runs a ring: 2(n-1) steps, each moving 1/n of the buffer).
    Bandwidth-optimal, but its 2(n-1) latency steps dominate for small
    buffers on many workers, and each of them crosses the slowest link.

    Args:
        buffer: 1-D tensor.
        groups: `Groups`; only `world` is used.
        num_chunks: ignored (the ring pipelines internally).
    """
    del num_chunks
    return groups.world.all_reduce(buffer)


def hierarchical_all_reduce(buffer, groups, num_chunks=1):
    """Reduce within each node, all-reduce among node leaders, broadcast back.

    Topology: workers partitioned into nodes of any sizes (unequal sizes
    work); local rank 0 of each node is its leader. Latency steps:
    2(k-1) + 2(m-1) + ceil(log2 k) for m nodes of k, against 2(mk-1) for a
    flat ring; only leaders send across nodes, 2(m-1)/m of the buffer each.

    The reduce to the leader is an all-reduce within the node: TensorFlow has
    no reduce-to-one collective on CPU (nor reduce-scatter). A ring
    all-reduce sends 2(k-1)/k of the buffer per worker, at most twice what a
    ring reduce would, over the fast links inside the node. Only the leader
    uses the node sum; the others receive the total from it. Through NCCL
    that broadcast is an all-reduce to which only the leader contributes
    (NCCL's broadcast cannot be ordered, see `CollectiveGroup`): 2(k-1)/k of
    the buffer per worker instead of one copy.

    Args:
        buffer: 1-D tensor with a static length when `num_chunks > 1`.
        groups: `Groups` with `intra_in`/`intra_out` (unless the node has one
            worker) and, on leaders, `cross` (unless there is one node).
        num_chunks: number of independent chains to split the buffer into.

    Returns:
        The sum over all workers, same shape and dtype as `buffer`.
    """
    results = []
    for chunk in _split(buffer, num_chunks):
        node_sum = chunk
        if groups.intra_in is not None:
            node_sum = groups.intra_in.all_reduce(chunk)
        if groups.local_rank == 0:
            total = node_sum
            if groups.cross is not None:
                total = groups.cross.all_reduce(node_sum)
            if groups.intra_out is not None:
                total = groups.intra_out.broadcast_send(total)
        else:
            # The node sum is unused here, but its all-reduce must run: the
            # leader waits for this worker's share.
            with tf.control_dependencies([node_sum]):
                total = groups.intra_out.broadcast_recv(tf.shape(chunk), chunk.dtype)
        results.append(total)
    return results[0] if len(results) == 1 else tf.concat(results, axis=0)


def two_d_all_reduce(buffer, groups, num_chunks=1):
    """2D all-reduce: within nodes, then between nodes shard by shard.

    Topology: m nodes of exactly k workers each (a k x m torus: rows are
    nodes, columns the workers with the same local rank). Stages:
    all-reduce within the node; each worker all-reduces its 1/k shard of the
    node sum with the workers of its column (k rings between nodes in
    parallel, each moving 1/k of the buffer); all-gather of the shards within
    the node. The link out of a node carries as much as the hierarchical
    algorithm's, but every worker drives it, and the last stage is an
    all-gather ((k-1)/k of the buffer) instead of a broadcast.

    The first stage is an all-reduce, not a reduce-scatter: TensorFlow has no
    CPU kernel for CollectiveReduceScatterV2.

    Args:
        buffer: 1-D tensor with a static length.
        groups: `Groups` with `intra_in`, `intra_out` and `cross` (`cross`
            may be `None` with one node).
        num_chunks: number of independent chains to split the buffer into.

    Returns:
        The sum over all workers, same shape and dtype as `buffer`.
    """
    k = groups.local_size
    length = buffer.shape.num_elements()
    if length is None:
        raise ValueError(
            "two_d_all_reduce needs a buffer of static length. "
            f"Received: buffer with shape {buffer.shape}"
        )
    # Pad so that every chunk splits into k equal shards.
    padded = -(-length // (k * num_chunks)) * k * num_chunks
    if padded != length:
        buffer = tf.concat([buffer, tf.zeros([padded - length], buffer.dtype)], 0)
    results = []
    for chunk in _split(buffer, num_chunks):
        node_sum = groups.intra_in.all_reduce(chunk)
        shard = tf.reshape(node_sum, [k, -1])[groups.local_rank]
        if groups.cross is not None:
            shard = groups.cross.all_reduce(shard)
        # All-gather concatenates in TensorFlow's ranking of the members'
        # device names, which need not be local-rank order (names compared
        # as strings put "task:10" before "task:2"): tag each shard with its
        # local rank and put the shards back in order.
        tag = tf.constant([groups.local_rank], dtype=shard.dtype)
        gathered = groups.intra_out.all_gather(tf.concat([shard, tag], 0))
        rows = tf.reshape(gathered, [k, -1])
        order = tf.math.invert_permutation(tf.cast(rows[:, -1], tf.int32))
        results.append(tf.reshape(tf.gather(rows[:, :-1], order), [-1]))
    total = results[0] if len(results) == 1 else tf.concat(results, axis=0)
    return total[:length] if padded != length else total


def halving_doubling_all_reduce(buffer, groups, num_chunks=1):
    """Recursive halving (reduce-scatter), then recursive doubling (all-gather).

    Topology: none assumed; works best when nodes hold consecutive ranks (the
    first, largest exchanges then stay inside a node). Rabenseifner's
    algorithm (Thakur, Rabenseifner and Gropp 2005; Goyal et al. 2017,
    section 4, chose it for its few steps); the pairing follows
    `topology.halving_doubling`, the padding Gloo's `AllreduceHalvingDoubling`
    (facebookincubator/gloo, gloo/allreduce_halving_doubling.h: pieces of
    ceil(n / 2^k) elements).
    On p = 2^k workers: k halving steps, in each of which a worker sends half
    of its current segment to its partner and adds the partner's copy of the
    half it keeps, until it holds 1/p of the sum; then k doubling steps that
    exchange the summed pieces back. 2 log2(p) latency steps instead of the
    ring's 2(p-1), the same bytes: 2(p-1)/p of the buffer per worker. With
    p = 2^k + r, r workers first fold their buffer into a partner and receive
    the result from it last: 2 more steps of the whole buffer.

    TensorFlow has no point-to-point op: each exchange is an all-gather over
    the pair's 2-member group, and the fold a broadcast (through NCCL an
    all-reduce to which only the sender contributes). Each element is
    summed on one worker and copied to the others, so every worker ends with
    the same bits.

    Args:
        buffer: 1-D tensor with a static length.
        groups: `Groups` with `rank` and `pairs`.
        num_chunks: ignored (the steps of one buffer depend on each other).

    Returns:
        The sum over all workers, same shape and dtype as `buffer`.
    """
    del num_chunks
    length = buffer.shape.num_elements()
    if length is None:
        raise ValueError(
            "halving_doubling_all_reduce needs a buffer of static length. "
            f"Received: buffer with shape {buffer.shape}"
        )
    schedule = topology_lib.halving_doubling(groups.world.size)
    fold_partner, is_extra, steps = schedule.role(groups.rank)
    if is_extra:
        fold = groups.pairs[fold_partner]
        sent = fold.broadcast_send(buffer)
        with tf.control_dependencies([sent]):
            return fold.broadcast_recv([length], buffer.dtype)
    if fold_partner is not None:
        buffer = buffer + groups.pairs[fold_partner].broadcast_recv(
            [length], buffer.dtype)
    # Pad to a multiple of 2^k so that every halving splits evenly and both
    # members of a pair gather pieces of one shape.
    parts = 1 << len(steps)
    padded = -(-length // parts) * parts
    segment = buffer
    if padded != length:
        segment = tf.concat([buffer, tf.zeros([padded - length], buffer.dtype)], 0)
    for partner, keeps_lower in steps:
        lower, upper = tf.split(segment, 2)
        kept, given = (lower, upper) if keeps_lower else (upper, lower)
        segment = kept + _exchange(groups.pairs[partner], given, keeps_lower)
    for partner, keeps_lower in reversed(steps):
        theirs = _exchange(groups.pairs[partner], segment, keeps_lower)
        segment = tf.concat([segment, theirs] if keeps_lower else [theirs, segment], 0)
    total = segment[:length] if padded != length else segment
    if fold_partner is not None:
        total = groups.pairs[fold_partner].broadcast_send(total)
    return total


def _exchange(pair, piece, is_lower):
    """Sends `piece` to the other member of the 2-member group `pair` and
    returns the piece (of the same shape) it sent."""
    # All-gather orders the members by device name, not by rank: tag each
    # piece with its sender's side of the pair and take the other one.
    tag = tf.constant([1 if is_lower else 0], piece.dtype)
    width = piece.shape[0] + 1  # static, so that the result's shape is too
    rows = tf.reshape(pair.all_gather(tf.concat([piece, tag], 0)), [2, width])
    theirs = tf.cast(tf.equal(rows[0, -1], tag[0]), tf.int32)
    return tf.gather(rows[:, :-1], theirs)


def _split(buffer, num_chunks):
    """`num_chunks` consecutive pieces of nearly equal length."""
    if num_chunks == 1:
        return [buffer]
    length = buffer.shape.num_elements()
    if length is None:
        raise ValueError(
            "A buffer split into chunks needs a static length. "
            f"Received: buffer with shape {buffer.shape}, num_chunks={num_chunks}"
        )
    base, extra = divmod(length, num_chunks)
    sizes = [base + (1 if i < extra else 0) for i in range(num_chunks)]
    return tf.split(buffer, [s for s in sizes if s], axis=0)


# Name -> function.
BUFFER_ALGORITHMS = {
    "ring": ring_all_reduce,
    "hierarchical": hierarchical_all_reduce,
    "2d": two_d_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
}
# The launchers list and check the names without TensorFlow: the same ones.
assert tuple(BUFFER_ALGORITHMS) == communication_names.BUFFER_ALGORITHMS
