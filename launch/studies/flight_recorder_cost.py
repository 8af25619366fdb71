r"""The flight recorder's cost per collective, and per training step.

    python -m tfscale.launch.studies.flight_recorder_cost

One process, no peers: times a `tf.function` that records `--collectives`
collectives' issue and completion (what `watchdog.Watchdog` adds around each
collective: two row writes and two timestamps) against the same function
without the recorder, and with the recorder of the timeline (which also
stamps each completion's time), `--rounds` times each, alternating. Then scales the
difference to a step: a step issues one collective per gradient bucket plus
one for the examples per worker (`--collectives_per_step`; the plan a
worker logs says how many buckets), against the training step of
`python -m tfscale.launch.studies.precision_speed` (`--step_seconds`).
"""

import statistics
import time

import tensorflow as tf
from absl import app
from absl import flags

from tfscale.collectives import flight_recorder

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_integer("collectives", 1000, "Recorded collectives per call.")
    flags.DEFINE_integer("rounds", 20, "Timed calls of each variant.")
    flags.DEFINE_integer("collectives_per_step", 5,
                         "Collectives of one training step (ResNet-50 at a "
                         "32 MiB fusion threshold: 4 buckets and the examples "
                         "per worker).")
    flags.DEFINE_float("step_seconds", 2.61,
                       "The training step it is compared with (ResNet-50, "
                       "224 px, batch 8, float32, on one core: 8 x the ms per "
                       "image that python -m tfscale.launch.studies.imagenet_input "
                       "measures there).")


def _body(recorder, count):
    def run(values):
        total = tf.constant(0.0)
        for sequence in range(1, count + 1):
            marks = []
            if recorder is not None:
                marks.append(recorder.issued(tf.constant(sequence, tf.int64),
                                             {"op": "all_reduce"}))
            with tf.control_dependencies(marks):
                total += values[sequence % 16]  # the "collective"
            if recorder is not None:
                recorder.completed(tf.constant(sequence, tf.int64), after=[total])
        return total
    return tf.function(run)


def main(argv):
    del argv
    recorder = flight_recorder.FlightRecorder("/cpu:0", worker=0)
    values = tf.ones([16])
    variants = {"without": _body(None, FLAGS.collectives),
                "with the recorder": _body(recorder, FLAGS.collectives)}
    for fn in variants.values():
        fn(values)  # traced
    # Traced last: the timeline unorders tf.timestamp for the whole process
    # (tfscale._private.graph_order), which the two above must not see.
    variants["with the timeline"] = _body(
        flight_recorder.FlightRecorder("/cpu:0", worker=0, timeline=True),
        FLAGS.collectives)
    variants["with the timeline"](values)
    times = {name: [] for name in variants}
    for _ in range(FLAGS.rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(values).numpy()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    per_collective = (medians["with the recorder"] - medians["without"]) / FLAGS.collectives
    per_step = per_collective * FLAGS.collectives_per_step
    for name, median in medians.items():
        print(f"{name:18s} median {median * 1e3:.2f} ms per {FLAGS.collectives} "
              f"collectives ({FLAGS.rounds} rounds)")
    print(f"recorder: {per_collective * 1e6:.1f} us per collective; "
          f"{FLAGS.collectives_per_step} collectives per step: {per_step * 1e6:.0f} us, "
          f"{100 * per_step / FLAGS.step_seconds:.4f} % of a {FLAGS.step_seconds:g} s step")
    timeline = (medians["with the timeline"] - medians["without"]) / FLAGS.collectives
    print(f"timeline (recorder and completion times): {timeline * 1e6:.1f} us per "
          "collective")


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
