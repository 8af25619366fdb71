"""Profiles a few training steps and reports when backprop ops and the fused
all-reduces ran, from the TF profiler's host trace (XPlane).

An MLP of equal layers (1 MiB kernels) with 1 MiB buckets: one bucket per
layer or two, so the first buckets are ready while earlier layers are still
being differentiated. Each worker reports, per profiled step, the intervals
(milliseconds from the step's start) of every op under `gradient_tape/` and
of every CollectiveReduceV2.
"""

import glob
import os

import numpy as np
import tensorflow as tf
from absl import app
from tensorflow.tsl.profiler.protobuf import xplane_pb2

import keras
import tfscale
from report import report

LAYERS, WIDTH, GLOBAL_BATCH = 6, 512, 128
PROFILED_STEPS = (4, 7)  # first and last step traced (after warm-up)


def dataset_fn(input_context):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, WIDTH)).astype("float32")
    y = rng.integers(0, 10, 1024)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.batch(input_context.get_per_replica_batch_size(GLOBAL_BATCH),
                    drop_remainder=True)


class Profile(keras.callbacks.Callback):
    def __init__(self, logdir):
        super().__init__()
        self.logdir = logdir

    def on_train_batch_begin(self, batch, logs=None):
        if batch == PROFILED_STEPS[0]:
            tf.profiler.experimental.start(self.logdir)

    def on_train_batch_end(self, batch, logs=None):
        if batch == PROFILED_STEPS[1]:
            tf.profiler.experimental.stop()


def host_events(path):
    """(start_ns, end_ns, name) of every event on the host plane."""
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    plane = next(p for p in space.planes if p.name == "/host:CPU")
    events = []
    for line in plane.lines:
        for event in line.events:
            start = line.timestamp_ns + event.offset_ps / 1000
            events.append((start, start + event.duration_ps / 1000,
                           plane.event_metadata[event.metadata_id].name))
    return sorted(events)


def main(argv):
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm="ring", fusion_threshold_bytes=1 << 20, timeout_seconds=120))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)]
            + [keras.layers.Dense(10)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logdir = os.path.join(os.environ["TFSCALE_TEST_RESULTS"],
                          f"profile-{strategy.worker_index}")
    model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1,
              steps_per_epoch=PROFILED_STEPS[1] + 2, verbose=0,
              callbacks=[Profile(logdir)])

    (path,) = glob.glob(os.path.join(logdir, "plugins/profile/*/*.xplane.pb"))
    events = host_events(path)
    steps = []
    for start, end, name in events:
        if name != "multi_step_on_iterator":  # one Keras train-function call
            continue
        inside = [(s, e, n) for s, e, n in events if start <= s <= end]
        steps.append({
            "duration_ms": (end - start) / 1e6,
            "backprop": [((s - start) / 1e6, (e - start) / 1e6, n)
                         for s, e, n in inside if "gradient_tape/" in n],
            "all_reduce": [((s - start) / 1e6, (e - start) / 1e6, n)
                           for s, e, n in inside if n.endswith(":CollectiveReduceV2")],
        })
    plan = strategy._tfscale_all_reduce.plan(
        [v.value for v in model.trainable_variables])
    report({
        "worker_index": strategy.worker_index,
        "buckets": [[len(b.indices), b.size_bytes] for b in plan],
        "steps": steps,
    })


if __name__ == "__main__":
    app.run(main)
