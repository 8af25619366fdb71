r"""ImageNet input pipeline speed per core, beside what a model step consumes.

    python -m tfscale.launch.studies.imagenet_input

Writes archives in the real ILSVRC2012 layout of generated ImageNet-sized
JPEGs (500x375 and 375x500, about 90 KB each, as ImageNet's average of about
110 KB; `launch.studies.imagenet_archives`), lets tensorflow-datasets prepare
them and tfscale index them (`tfscale.imagenet_source`), then on ONE core
(every TensorFlow thread pool of this process limited to one thread) times:

- one worker's training pipeline of `tfscale.data.imagenet` at 224 px
  (read by example, random-resized crop decoding only the window, flip,
  normalization), as worker 1 of 4 sharing a global batch;
- the validation pipeline (decode, shorter side to 256, center crop 224);
- the time to the first training batch at step 0 and after resuming at step
  1,000,000 (nothing read or decoded for the steps skipped);
- ResNet-50 v1.5 training at 224 px (`model.fit` on the same batch
  repeated: forward, backward and SGD with momentum), float32, in images/s on
  the same one core: what one worker's model step consumes.

Prints images/s and CPU milliseconds per image (this process's user + system
time) for each, and how many cores of input work one core of training needs.
"""

import os
import resource
import shutil
import statistics
import tempfile
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_integer("train_per_synset", 40, "Training images per synset "
                         "(the synsets of the first --num_validation images).")
    flags.DEFINE_integer("num_validation", 32, "Validation images.")
    flags.DEFINE_integer("global_batch", 256, "Global batch (4 workers share it).")
    flags.DEFINE_integer("batches", 8, "Timed batches per pipeline.")
    flags.DEFINE_integer("rounds", 3, "Rounds; the median is reported.")
    flags.DEFINE_integer("model_batch", 16, "ResNet-50's batch per step.")
    flags.DEFINE_integer("model_steps", 3, "ResNet-50's timed steps per round.")
    flags.DEFINE_string("work_dir", None, "Where the archives and the prepared "
                        "data go; default: a temporary folder, deleted after.")


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_core(dataset):
    import tensorflow as tf

    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.autotune.cpu_budget = 1
    return dataset.with_options(options)


def time_pipeline(make, batches):
    """(images/s, CPU ms/image, first batch s) of `batches` batches after the
    first, of the dataset `make()` builds."""
    start = time.perf_counter()
    iterator = iter(one_core(make()))
    images, _ = next(iterator)
    first = time.perf_counter() - start
    count, cpu, start = 0, cpu_seconds(), time.perf_counter()
    for _ in range(batches):
        images, _ = next(iterator)
        count += int(images.shape[0])
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if not count:
        return None, None, first
    return count / seconds, 1000 * cpu / count, first


def time_model(batch, steps):
    """(images/s, CPU ms/image) of ResNet-50 training steps at 224 px."""
    import keras
    import tensorflow as tf

    from tfscale import models

    keras.utils.set_random_seed(0)
    model = models.resnet50(num_classes=1000)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = tf.random.normal([batch, 224, 224, 3])
    labels = tf.zeros([batch], tf.int64)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)  # traced
    cpu, start = cpu_seconds(), time.perf_counter()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return batch * steps / seconds, 1000 * cpu / (batch * steps)


def main(argv):
    del argv
    import tensorflow as tf

    # One core: every pool of this process (the pipelines also get their own
    # one-thread pool, `one_core`).
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    from tfscale.launch.studies import imagenet_archives
    from tfscale import data
    from tfscale import imagenet_source

    work_dir = FLAGS.work_dir or tempfile.mkdtemp(prefix="tfscale-imagenet-input-")
    manual_dir, data_dir = (os.path.join(work_dir, "manual"),
                            os.path.join(work_dir, "data"))
    try:
        start = time.perf_counter()
        synsets = imagenet_archives.write(
            manual_dir, FLAGS.num_validation, FLAGS.train_per_synset, full_size=True)
        train_tar = os.path.getsize(os.path.join(manual_dir, "ILSVRC2012_img_train.tar"))
        count = len(synsets) * FLAGS.train_per_synset
        print(f"archives: {count} training images in {len(synsets)} synsets, "
              f"{train_tar / count / 1024:.0f} KB each on average; "
              f"{FLAGS.num_validation} validation images "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        start = time.perf_counter()
        imagenet_source.prepare(data_dir, manual_dir)
        print(f"prepared and indexed in {time.perf_counter() - start:.1f} s", flush=True)
        context = tf.distribute.InputContext(num_input_pipelines=4,
                                             input_pipeline_id=1,
                                             num_replicas_in_sync=4)

        def train(start_step=0):
            return data.imagenet("train", FLAGS.global_batch, 224,
                                 data_dir=data_dir, input_context=context,
                                 start_step=start_step)

        def validation():
            return data.imagenet("validation", 8, 224, data_dir=data_dir,
                                 drop_remainder=False).repeat()

        rows = {"training pipeline (crop window decoded, flip)": [],
                "validation pipeline (resize 256, crop 224)": [],
                "ResNet-50 training step, float32": []}
        firsts = {0: [], 1_000_000: []}
        for _ in range(FLAGS.rounds):
            rate, cpu, first = time_pipeline(train, FLAGS.batches)
            rows["training pipeline (crop window decoded, flip)"].append((rate, cpu))
            firsts[0].append(first)
            rate, cpu, _ = time_pipeline(validation, FLAGS.batches * 4)
            rows["validation pipeline (resize 256, crop 224)"].append((rate, cpu))
            firsts[1_000_000].append(time_pipeline(lambda: train(1_000_000), 0)[2])
            rows["ResNet-50 training step, float32"].append(
                time_model(FLAGS.model_batch, FLAGS.model_steps))
    finally:
        if not FLAGS.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)

    print("\nOne core (medians of %d rounds):\n" % FLAGS.rounds)
    print("| what | images/s | CPU ms per image |\n|---|---|---|")
    medians = {}
    for name, values in rows.items():
        rate = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        medians[name] = rate
        print(f"| {name} | {rate:.1f} | {cpu:.2f} |")
    model = medians["ResNet-50 training step, float32"]
    train_rate = medians["training pipeline (crop window decoded, flip)"]
    print(f"\nTime to the first training batch: {statistics.median(firsts[0]):.2f} s at "
          f"step 0, {statistics.median(firsts[1_000_000]):.2f} s resumed at step "
          "1,000,000.")
    print(f"One core of ResNet-50 training consumes {model:.1f} images/s; one core "
          f"of input prepares {train_rate:.0f}: {model / train_rate:.3f} cores of "
          "input per core of training on this CPU.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
