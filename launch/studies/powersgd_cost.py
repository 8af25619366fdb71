r"""PowerSGD's own arithmetic per step, batched by shape or matrix by matrix.

    python -m tfscale.launch.studies.powersgd_cost [--model=resnet50] [--rank=4]

One process, no peers: PowerSGD's all-reduce of a model's gradients
(random, float32) with a sum that is the identity, so that what is timed is
only what PowerSGD computes on a worker: M = G + E, the products M Q and
M^T P, the two orthogonalizations, the reconstruction P Q^T and the error
feedback. Four variants in one `tf.function` each, called `--rounds` times
alternating: one matrix at a time (the default), matrices of the same shape
together (`batch_same_shapes=True`), one at a time compiled by XLA
(`jit_compile=True`, as a step compiled whole would be), and no compression
at all (the gradients returned as they are: the floor of the call). Prints
each variant's median per call and the ops in its graph.
"""

import statistics
import time

import tensorflow as tf
from absl import app
from absl import flags

from tfscale import models
from tfscale.collectives import powersgd

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_enum("model", "resnet50", models.names(), "Whose gradient shapes.")
    flags.DEFINE_integer("num_classes", 1000, "The model's classes (its last layer).")
    flags.DEFINE_integer("rank", powersgd.DEFAULT_RANK, "PowerSGD's rank.")
    flags.DEFINE_integer("rounds", 10, "Timed calls of each variant.")


def _variant(variables, batch, jit_compile=False):
    """A tf.function running PowerSGD's all-reduce of gradients of
    `variables` with a local identity for the sum (None: no compression)."""
    if batch is None:
        return tf.function(lambda grads: [tf.identity(g) for g in grads])
    compressor = powersgd.PowerSGD(lambda tensors: list(tensors), num_workers=4,
                                   rank=FLAGS.rank, start_step=0,
                                   batch_same_shapes=batch)
    optimizer = object()  # the state's key: one per variant
    compressor.state(optimizer, variables)
    return tf.function(lambda grads: compressor.all_reduce(grads, optimizer, variables, 0),
                       jit_compile=jit_compile)


def main(argv):
    del argv
    variables = models.get(FLAGS.model, num_classes=FLAGS.num_classes).trainable_variables
    grads = [tf.random.normal(v.shape, seed=i) for i, v in enumerate(variables)]
    matrices = powersgd.plan([v.shape for v in variables], [v.dtype for v in variables],
                             FLAGS.rank)
    batches = powersgd.same_shape_batches(matrices)
    print(f"{FLAGS.model}: {len(variables)} gradients, {len(matrices)} compressed at "
          f"rank {FLAGS.rank}, in {len(batches)} batches of one shape "
          f"(sizes {sorted((len(b) for b in batches), reverse=True)})")
    variants = {"one matrix at a time": _variant(variables, False),
                "batched by shape": _variant(variables, True),
                "one at a time, XLA": _variant(variables, False, jit_compile=True),
                "no compression": _variant(variables, None)}
    ops = {}
    for name, fn in variants.items():
        ops[name] = len(fn.get_concrete_function(grads).graph.get_operations())
        fn(grads)  # warm-up
    times = {name: [] for name in variants}
    for _ in range(FLAGS.rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            out = fn(grads)
            out[-1].numpy()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name in variants:
        print(f"{name:22s} median {medians[name] * 1e3:8.1f} ms per step "
              f"({FLAGS.rounds} calls), {ops[name]:6d} ops in its graph")
    floor = medians["no compression"]
    single = medians["one matrix at a time"] - floor
    for name in ("batched by shape", "one at a time, XLA"):
        print(f"{name}: PowerSGD's arithmetic (median minus the floor) "
              f"{(medians[name] - floor) / single:.2f} x one matrix at a time's "
              f"({(medians[name] - floor) * 1e3:.1f} vs {single * 1e3:.1f} ms)")


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
