"""PowerSGD: gradient matrices all-reduced as two thin factors, with error feedback.

Each float32 gradient with two or more axes is viewed as a matrix M of
n x m (all axes but the last are rows: a Dense kernel (in, out) stays as it
is, a conv kernel (kh, kw, in, out) becomes (kh*kw*in) x out) and sent as
two rank-r factors instead of its n*m values (Vogels, Karimireddy and Jaggi
2019, Algorithms 1 and 2):

```python
M = G + E                      # this worker's gradient plus its error feedback
P = sum_workers(M @ orthogonalize(Q))     # n x r, one all-reduce for all Ps
P = orthogonalize(P)
Q = sum_workers(M.T @ P)                  # m x r, one all-reduce for all Qs
out = P @ Q.T                             # ~ the sum of every worker's M
E = M - out / num_workers                 # kept on this worker
Q = Q / num_workers                       # warm start of the next step
```

The choices follow PyTorch's production hook
(torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py):

- Only matrices that shrink at least `min_compression_rate`-fold are
  compressed, `(n + m) * r * min_compression_rate < n * m`
  (`_should_compress`); vectors (biases, BatchNorm) and small matrices are
  fused and all-reduced as any gradient is without compression.
- The matrices are grouped in backward order (last layer first) into
  buckets of about `bucket_bytes` of gradient; the Ps of a bucket travel
  in one buffer, and so do its Qs (PyTorch's `p_memory_dict` /
  `q_memory_dict`, per DDP bucket: the hook runs on each bucket as soon as
  backprop has filled it). So the first buckets' products, all-reduces and
  error feedback run while earlier layers are still differentiated;
  `bucket_bytes=None` makes one bucket of all matrices, started after the
  last gradient.
- `batch_same_shapes=True` computes matrices of the same shape together:
  their products, orthogonalization and error feedback as one batched op
  each (PyTorch's `batch_tensors_with_same_shape`, off by default there and
  here; see the argument).
- Orthogonalization is Gram-Schmidt with `epsilon` added to each norm
  (`_orthogonalize`), so a zero gradient gives zero, not NaN.
- Warm start: each step's power iteration starts from the last step's
  (orthogonalized) Q; the first Q is a seeded normal draw, the same on every
  worker.
- Error feedback stores `M - mean approximation` on each worker (PyTorch's
  `error_dict`; the paper's reference code does the same), only for the
  compressed matrices: the other tensors are all-reduced exactly.
- `start_step`: plain all-reduce of every gradient for the first updates
  (`start_powerSGD_iter`): early training is the most sensitive to
  inexact gradients.

Mean and sum. tfscale's all-reduce sums: Keras divides the loss by the number
of workers, so each worker's M is its share of the mean gradient and the sum
of the Ms is the gradient the optimizer needs. `out` above is that sum; a
worker's error is its M minus its share, `out / num_workers`, so that the
errors of all workers add up to exactly what the sum missed,
`sum(M) - out`. (PyTorch's hook averages instead: each worker passes its
own mean gradient, and it divides the Q sum by the number of workers.)

References:
    - [Vogels, Karimireddy and Jaggi, 2019. PowerSGD: Practical Low-Rank
      Gradient Compression for Distributed Optimization](
      https://arxiv.org/abs/1905.13727)
    - PyTorch, `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`
      (`PowerSGDState`, `powerSGD_hook`).
"""

import dataclasses
import math

from absl import logging
import tensorflow as tf

from tfscale import communication_names
from tfscale.collectives import fusion

NAME = communication_names.POWERSGD
DEFAULT_RANK = 4
DEFAULT_START_STEP = 10  # PyTorch's default start_powerSGD_iter
DEFAULT_MIN_COMPRESSION_RATE = 2.0  # PyTorch's default min_compression_rate
EPSILON = 1e-8  # PyTorch's `_orthogonalize`
# Seed of every Q's first draw (stateless: the same on every worker and run).
SEED = 1905


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One gradient that travels compressed.

    Attributes:
        index: its position in the list of gradients.
        shape: the gradient's shape.
        rows, cols: the matrix it is viewed as.
        rank: `min(rank, rows, cols)`.
    """

    index: int
    shape: tuple
    rows: int
    cols: int
    rank: int

    @property
    def size_bytes(self):
        return self.rows * self.cols * 4

    @property
    def compressed_bytes(self):
        """float32 bytes of its P and Q on the wire."""
        return (self.rows + self.cols) * self.rank * 4


def should_compress(rows, cols, rank, min_compression_rate):
    """Whether a rows x cols matrix shrinks enough at `rank` (PyTorch's rule)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def plan(shapes, dtypes, rank, min_compression_rate=DEFAULT_MIN_COMPRESSION_RATE):
    """Which gradients travel compressed, as what matrix.

    A pure function of static shapes: every worker computes the same plan.

    Args:
        shapes: each gradient's shape (lists or `tf.TensorShape`).
        dtypes: each gradient's dtype; only float32 is compressed.
        rank: the approximation rank r.
        min_compression_rate: see `should_compress`.

    Returns:
        A list of `Matrix`, in the order given.
    """
    matrices = []
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        shape = tf.TensorShape(shape)
        if (tf.as_dtype(dtype) != tf.float32 or shape.rank is None
                or shape.rank < 2 or not shape.is_fully_defined()):
            continue
        dims = shape.as_list()
        rows, cols = math.prod(dims[:-1]), dims[-1]
        matrix_rank = min(rank, rows, cols)
        if should_compress(rows, cols, matrix_rank, min_compression_rate):
            matrices.append(Matrix(index, tuple(dims), rows, cols, matrix_rank))
    return matrices


def _size_bytes(shape, dtype):
    return (tf.TensorShape(shape).num_elements() or 0) * tf.as_dtype(dtype).size


def wire_bytes(matrices, shapes, dtypes):
    """`(gradient_bytes, wire_bytes)`: the gradients' bytes, and what PowerSGD
    sends for them per step (P and Q of each of `matrices`, every other
    gradient as it is)."""
    compressed = {m.index: m.compressed_bytes for m in matrices}
    sizes = [_size_bytes(shape, dtype) for shape, dtype in zip(shapes, dtypes)]
    return sum(sizes), sum(compressed.get(i, size) for i, size in enumerate(sizes))


def describe(matrices, shapes, dtypes, names=None):
    """One line per gradient with its bytes on the wire, and the total."""
    by_index = {m.index: m for m in matrices}
    lines = []
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        shape = tf.TensorShape(shape)
        dtype = tf.as_dtype(dtype)
        size = _size_bytes(shape, dtype)
        name = names[index] if names else f"tensor {index}"
        matrix = by_index.get(index)
        if matrix is None:
            lines.append(f"  {name} {shape.as_list()}: {size:,} bytes {dtype.name}, "
                         "uncompressed")
            continue
        lines.append(
            f"  {name} {list(matrix.shape)}: {size:,} bytes -> {matrix.rows}x"
            f"{matrix.cols} at rank {matrix.rank}: {matrix.compressed_bytes:,} "
            f"bytes (P {matrix.rows}x{matrix.rank} + Q {matrix.cols}x{matrix.rank}, "
            f"{size / matrix.compressed_bytes:.1f}x)")
    before, after = wire_bytes(matrices, shapes, dtypes)
    ratio = before / after if after else 1.0
    lines.append(f"  total: {before:,} bytes -> {after:,} bytes on the wire "
                 f"({ratio:.1f}x smaller), {len(matrices)} of {len(shapes)} "
                 "tensors compressed")
    return "\n".join(lines)


def orthogonalize(matrix, epsilon=EPSILON):
    """Orthonormal columns by modified Gram-Schmidt (PyTorch's `_orthogonalize`).

    Column i is divided by its norm plus `epsilon`, then removed from the
    columns after it. `matrix` is n x r, or a batch of them (..., n, r),
    each orthogonalized on its own.
    """
    columns = []
    for i in range(matrix.shape[-1]):
        column = matrix[..., i]
        for done in columns:
            column = column - tf.reduce_sum(done * column, axis=-1, keepdims=True) * done
        columns.append(column / (tf.norm(column, axis=-1, keepdims=True) + epsilon))
    return tf.stack(columns, axis=-1)


def backward_buckets(matrices, bucket_bytes):
    """Positions in `matrices` compressed and all-reduced together: in
    backward order (last gradient first, as backprop produces them), a
    bucket closed once it holds at least `bucket_bytes` of gradient (as
    `fusion.bucket_indices` closes its buffers); one bucket of all
    when `bucket_bytes` is None.

    Each bucket lists its positions in the order given (its Ps travel in
    that order).
    """
    if bucket_bytes is None:
        return [list(range(len(matrices)))] if matrices else []
    backward = sorted(range(len(matrices)), key=lambda i: -matrices[i].index)
    buckets = fusion.bucket_indices([matrices[i].size_bytes for i in backward],
                                    [tf.float32] * len(backward), bucket_bytes)
    return [sorted(backward[j] for j in bucket) for bucket in buckets]


def same_shape_batches(matrices, batch=True):
    """Positions in `matrices` computed together, as one batch of products
    and one orthogonalization: those of one (rows, cols, rank), in the order
    first seen (PyTorch's `batch_tensors_with_same_shape`); each alone
    unless `batch`."""
    if not batch:
        return [[i] for i in range(len(matrices))]
    batches = {}
    for i, m in enumerate(matrices):
        batches.setdefault((m.rows, m.cols, m.rank), []).append(i)
    return list(batches.values())


def _stack(matrices):
    """A batch of `matrices`; one alone is not copied."""
    return tf.expand_dims(matrices[0], 0) if len(matrices) == 1 else tf.stack(matrices)


def _unstack(batch):
    """The matrices of `batch`; a batch of one is not copied."""
    return [tf.reshape(batch, batch.shape[1:])] if batch.shape[0] == 1 else tf.unstack(batch)


def _concat(parts):
    return tf.concat([tf.reshape(p, [-1]) for p in parts], axis=0)


def _split(buffer, shapes):
    sizes = [math.prod(shape) for shape in shapes]
    return [tf.reshape(part, shape)
            for part, shape in zip(tf.split(buffer, sizes), shapes)]


def first_factors(ms, qs, epsilon=EPSILON):
    """This worker's Ps, `M @ orthogonalize(Q)`, in one flat buffer (each of
    `ms` a batch of matrices, b x rows x cols; `qs` b x cols x rank)."""
    return _concat([tf.linalg.matmul(m, orthogonalize(q, epsilon)) for m, q in zip(ms, qs)])


def second_factors(ms, p_sum, ranks, epsilon=EPSILON):
    """The orthogonalized summed Ps, and this worker's Qs `M.T @ P` in one
    flat buffer."""
    shapes = [(m.shape[0], m.shape[1], r) for m, r in zip(ms, ranks)]
    ps = [orthogonalize(p, epsilon) for p in _split(p_sum, shapes)]
    return ps, _concat([tf.linalg.matmul(m, p, transpose_a=True) for m, p in zip(ms, ps)])


def approximations(ps, q_sum, cols):
    """Each batch's `P @ Q.T` from the summed Qs, and the Qs themselves."""
    qs = _split(q_sum, [(p.shape[0], c, p.shape[-1]) for c, p in zip(cols, ps)])
    return [tf.linalg.matmul(p, q, transpose_b=True) for p, q in zip(ps, qs)], qs


class State(tf.Module):
    """This worker's PowerSGD state for one optimizer's variables.

    Attributes:
        matrices: the `plan`.
        error: one variable per compressed gradient (rows x cols): this
            worker's error feedback; differs between workers.
        q: one variable per compressed gradient (cols x rank): the last
            step's Q (the mean over workers), the same on every worker.
    """

    def __init__(self, matrices):
        super().__init__(name="powersgd")
        self.matrices = tuple(matrices)
        self.error = [
            tf.Variable(tf.zeros([m.rows, m.cols]), trainable=False,
                        name=f"error_{m.index}",
                        aggregation=tf.VariableAggregation.NONE)
            for m in matrices]
        self.q = [
            tf.Variable(tf.random.stateless_normal([m.cols, m.rank], seed=[SEED, m.index]),
                        trainable=False, name=f"q_{m.index}",
                        aggregation=tf.VariableAggregation.NONE)
            for m in matrices]


class PowerSGD:
    """Sums gradients over all workers as rank-r factors (see the module).

    Args:
        sum_fn: `fn(list of tensors) -> list of tensors`: their sum over all
            workers, without `merge_call` (it runs inside `tf.cond`).
        num_workers: workers summed over.
        rank: approximation rank r >= 1.
        start_step: optimizer updates all-reduced uncompressed first.
        min_compression_rate: see `should_compress`.
        log_plans: log each optimizer's plan once (set it on the chief).
        batch_same_shapes: compute matrices of the same shape together
            (`same_shape_batches`): a few batched ops instead of the same
            small ops once per matrix, at the price of copying them into
            one batch. Off by default, as in PyTorch: on CPU the arithmetic
            is bound by memory traffic, not by the number of ops, and the
            copies make it slower (`python -m
            tfscale.launch.studies.powersgd_cost` times both); where each
            op has a fixed launch cost (GPUs) it may pay. The
            sums on the wire are the same; results agree within float32
            rounding.
        bucket_bytes: gradient bytes per bucket of matrices compressed and
            all-reduced together (`backward_buckets`); each bucket starts as
            soon as its gradients are ready, so the compression of the last
            layers overlaps the backprop of the first. `None`: one bucket,
            after the last gradient. `tfscale.Strategy` passes
            `PowerSGDOptions.bucket_bytes`. Buckets change only how the sums
            are split into all-reduces: results agree within float32
            rounding.
    """

    def __init__(self, sum_fn, num_workers, rank=DEFAULT_RANK,
                 start_step=DEFAULT_START_STEP,
                 min_compression_rate=DEFAULT_MIN_COMPRESSION_RATE, log_plans=False,
                 batch_same_shapes=False, bucket_bytes=None):
        self.sum_fn = sum_fn
        self.bucket_bytes = bucket_bytes
        self.batch_same_shapes = batch_same_shapes
        self.num_workers = num_workers
        self.rank = rank
        self.start_step = start_step
        self.min_compression_rate = min_compression_rate
        self.log_plans = log_plans
        self._states = {}  # id(optimizer) -> (optimizer, State)

    def state(self, optimizer, variables):
        """The `State` of `optimizer` (a wrapping `LossScaleOptimizer` stands
        for its inner one) over `variables`, created on first use.

        Create it in cross-replica context inside the strategy's scope; its
        variables are created eagerly even while a step is traced.
        """
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        if id(optimizer) not in self._states:
            shapes = [v.shape for v in variables]
            dtypes = [v.dtype for v in variables]
            matrices = plan(shapes, dtypes, self.rank, self.min_compression_rate)
            with tf.init_scope():
                state = State(matrices)
            self._states[id(optimizer)] = (optimizer, state)
            if self.log_plans:
                logging.info(
                    "tfscale PowerSGD, rank %d, from optimizer step %d (uncompressed "
                    "before), min_compression_rate %g; gradients on the wire:\n%s",
                    self.rank, self.start_step, self.min_compression_rate,
                    describe(matrices, shapes, dtypes,
                             [getattr(v, "path", None) or v.name for v in variables]))
        return self._states[id(optimizer)][1]

    def all_reduce(self, grads, optimizer, variables, step):
        """Sums `grads` (this worker's, of `variables`) over all workers.

        Call it in replica context, on every worker, once per update.

        Args:
            grads: dense gradients, one per variable.
            optimizer: the optimizer applying them.
            variables: the variables.
            step: the optimizer's update count; below `start_step` every
                gradient is all-reduced uncompressed.

        Returns:
            The summed gradients (compressed ones: their rank-r approximation).
        """
        grads = [tf.convert_to_tensor(g) for g in grads]
        key = id(getattr(optimizer, "inner_optimizer", optimizer))
        if key not in self._states:
            tf.distribute.get_replica_context().merge_call(
                lambda _: self.state(optimizer, variables))
        state = self._states[key][1]
        if not state.matrices:
            return self.sum_fn(grads)
        if self.start_step == 0:
            return self._compressed(grads, state)
        return tf.cond(tf.convert_to_tensor(step) >= self.start_step,
                       lambda: self._compressed(grads, state),
                       lambda: self.sum_fn(grads))

    def _compressed(self, grads, state):
        matrices = state.matrices
        compressed = {m.index for m in matrices}
        rest = [i for i in range(len(grads)) if i not in compressed]
        results = [None] * len(grads)
        if rest:
            for i, summed in zip(rest, self.sum_fn([grads[i] for i in rest])):
                results[i] = summed
        updates = []
        for bucket in backward_buckets(matrices, self.bucket_bytes):
            updates += self._compress_bucket(
                grads, state, bucket, results)
        with tf.control_dependencies(updates):
            return [tf.identity(r) for r in results]

    def _compress_bucket(self, grads, state, bucket, results):
        """Sums the gradients of `bucket` (positions in `state.matrices`)
        through their factors into `results`; returns the state updates."""
        matrices = state.matrices
        batches = [[bucket[j] for j in batch] for batch in same_shape_batches(
            [matrices[i] for i in bucket], self.batch_same_shapes)]
        # M = G + E, each batch stacked: b x rows x cols.
        ms = [_stack([tf.reshape(grads[matrices[i].index],
                                 [matrices[i].rows, matrices[i].cols])
                      + state.error[i].read_value() for i in batch]) for batch in batches]
        qs = [_stack([state.q[i].read_value() for i in batch]) for batch in batches]
        (p_sum,) = self.sum_fn([first_factors(ms, qs)])
        ps, q_local = second_factors(ms, p_sum, [matrices[b[0]].rank for b in batches])
        (q_sum,) = self.sum_fn([q_local])
        outs, qs = approximations(ps, q_sum, [matrices[b[0]].cols for b in batches])
        updates = []
        for batch, M, out, q in zip(batches, ms, outs, qs):
            # The error feedback of the whole batch in one op, then split.
            errors = _unstack(M - out / self.num_workers)
            for i, error, each_out, each_q in zip(batch, errors, _unstack(out),
                                                  _unstack(q / self.num_workers)):
                updates.append(state.error[i].assign(error))
                updates.append(state.q[i].assign(each_q))
                results[matrices[i].index] = tf.reshape(each_out, matrices[i].shape)
        return updates
