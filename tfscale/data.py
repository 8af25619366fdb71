"""Input pipelines: digits (real, bundled), Fashion-MNIST (real, four files),
synthetic, ImageNet (tfds).

Each pipeline yields `(images, labels)` batches for ONE worker: with an
`input_context` (from `strategy.distribute_datasets_from_function`) it keeps
its share of each global batch (`worker_share`: any global batch on any number
of workers; the first `global_batch_size % num_workers` workers take one
example more, as tf.distribute splits a batch).
Images come out float32, resized to `image_size` and normalized by
`preprocess`, the same function the exported SavedModel runs on raw uint8
images, so training and serving see identical inputs.

Every worker reads one stream, a permutation of the split per epoch drawn
from the seed and the epoch alone, and cuts it into global batches; each
worker keeps its rows of each, so a global batch holds the same examples
whatever the number of workers, and a resumed pipeline continues the stream
exactly. A pipeline may start `start_example`
examples into that stream: where a phase of a growing batch
(`tfscale.batch_growth`) continues from the phase before it.
"""

import os

import numpy as np
import tensorflow as tf

from tfscale import _requirements
from tfscale import fashion_mnist_source
# Public here as well.
from tfscale.dataset_specs import SPECS
from tfscale.dataset_specs import DatasetSpec
from tfscale.dataset_specs import names
from tfscale.dataset_specs import spec


# scikit-learn's digits: 1,797 8x8 images with 17 gray levels (0-16). A fixed
# stratified 80/20 split: 1,437 train, 360 test.
_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0


def preprocess(images, dataset_spec, image_size):
    """uint8 images [batch, H, W, C] -> normalized float32 model inputs.

    Resizes to `image_size` x `image_size` (ImageNet: shorter side to
    image_size / 0.875, then a center crop, the standard eval transform).
    """
    images = tf.cast(images, tf.float32)
    if dataset_spec.name == "imagenet":
        images = _resize_shorter_and_center_crop(images, image_size)
    elif (dataset_spec.stored_shape or (None, None))[:2] != (image_size, image_size):
        images = tf.image.resize(images, (image_size, image_size))
    return _normalize(images, dataset_spec)


def _normalize(images, dataset_spec):
    mean = tf.constant(dataset_spec.mean, tf.float32)
    std = tf.constant(dataset_spec.std, tf.float32)
    return (images - mean) / std


def check_batch(global_batch_size, num_examples, split, accumulation_steps=1):
    """Refuses a global batch the split cannot fill, or one that does not cut
    into `accumulation_steps` equal micro-batches.

    Any number of workers can share any global batch (`worker_share`).
    """
    if global_batch_size < 1:
        raise ValueError(
            "`global_batch_size` must be >= 1. "
            f"Received: global_batch_size={global_batch_size}"
        )
    if accumulation_steps > 1 and global_batch_size % accumulation_steps:
        raise ValueError(
            f"`global_batch_size` must be divisible by `accumulation_steps` "
            f"({accumulation_steps}), so that every update averages equal "
            f"micro-batches. Received: global_batch_size={global_batch_size}; "
            f"use e.g. {max(1, global_batch_size // accumulation_steps) * accumulation_steps}."
        )
    if num_examples is not None and num_examples < global_batch_size:
        raise ValueError(
            f"The {split!r} split has {num_examples} examples, fewer than one "
            f"global batch. Received: global_batch_size={global_batch_size}; "
            f"use at most {num_examples}."
        )


def worker_share(global_batch_size, num_workers, worker):
    """`(start, size)`: worker `worker`'s rows of each global batch.

    Split as tf.distribute splits a batch among replicas: each worker takes
    `global_batch_size // num_workers` consecutive rows and the first
    `global_batch_size % num_workers` workers one more (32 on 3 workers: 11,
    11, 10). A worker's share may be empty (fewer examples than workers);
    `tfscale.Strategy` weights each worker by the examples it holds.
    """
    base, extra = divmod(global_batch_size, num_workers)
    return worker * base + min(worker, extra), base + (worker < extra)


def describe_share(global_batch_size, num_workers):
    """`"11 per worker"`, or `"10-11 per worker"` where the shares differ."""
    low, high = global_batch_size // num_workers, -(-global_batch_size // num_workers)
    return f"{low} per worker" if low == high else f"{low}-{high} per worker"


def _this_worker(input_context):
    """`(num_workers, worker)` of an input context (None: one pipeline)."""
    if input_context is None:
        return 1, 0
    return input_context.num_input_pipelines, input_context.input_pipeline_id


def num_examples(name, split, data_dir=None):
    """Number of examples in a split; None for synthetic (endless). ImageNet
    before it is prepared: the sizes of the full ILSVRC2012 archives."""
    if name == "digits":
        return len(digits_arrays(split)[1])
    if name == "fashion_mnist":
        return len(fashion_mnist_source.arrays(split, data_dir)[1])
    if name == "imagenet":
        from tfscale import imagenet_source

        split = _imagenet_split(split)
        prepared = imagenet_source.num_examples(data_dir, split)
        return _IMAGENET_SPLIT_SIZES[split] if prepared is None else prepared
    return None


def load(name, split, global_batch_size, image_size=None, *, training=None,
         input_context=None, seed=0, start_step=0, data_dir=None, manual_dir=None,
         drop_remainder=True, start_example=0, prepare_timeout_seconds=None):
    """The pipeline of data set `name`; see `digits`, `synthetic`, `imagenet`."""
    spec(name)
    kwargs = dict(input_context=input_context, seed=seed)
    if name == "synthetic":  # every batch is the same: no position to skip to
        return synthetic(global_batch_size, image_size, **kwargs)
    kwargs.update(training=training, start_step=start_step,
                  drop_remainder=drop_remainder, start_example=start_example)
    if name == "digits":
        return digits(split, global_batch_size, image_size, **kwargs)
    if name == "fashion_mnist":
        return fashion_mnist(split, global_batch_size, image_size,
                             data_dir=data_dir, **kwargs)
    return imagenet(split, global_batch_size, image_size,
                    data_dir=data_dir, manual_dir=manual_dir,
                    prepare_timeout_seconds=prepare_timeout_seconds, **kwargs)


def digits(split, global_batch_size, image_size=None, *, training=None,
           input_context=None, seed=0, start_step=0, drop_remainder=True,
           start_example=0):
    """scikit-learn's handwritten digits: real data, bundled, no download.

    Args:
        split: "train" (1,437 images) or "test" (360).
        global_batch_size: examples per step over all workers.
        image_size: model input side (default 67); 8x8 images are resized.
        training: shuffle and repeat forever (default: split == "train");
            otherwise one pass over the largest multiple of the global batch.
        input_context: this worker's `tf.distribute.InputContext`.
        seed: shuffle seed; must be the same on every worker.
        start_step: training batches to skip: where a resumed run continues
            (the stream is the same for the same seed).
        drop_remainder: evaluation only; False keeps a last, smaller batch,
            so that every example is evaluated once.
        start_example: training examples of the stream to skip before the
            first batch (before `start_step`'s batches): where a phase of a
            batch schedule starts.
    """
    images, labels = digits_arrays(split)
    return _batched(
        images, labels, SPECS["digits"], split, global_batch_size,
        image_size, training, input_context, seed, start_step, drop_remainder,
        start_example,
    )


def fashion_mnist(split, global_batch_size, image_size=None, *, data_dir=None,
                  training=None, input_context=None, seed=0, start_step=0,
                  drop_remainder=True, start_example=0, num_examples=None):
    """Fashion-MNIST (Xiao et al. 2017): 60,000 train / 10,000 test 28x28
    grey images of 10 kinds of clothing, read from its four IDX files.

    The files are looked for in `data_dir`, Keras's cache and Debian's
    `dataset-fashion-mnist` (`tfscale.fashion_mnist_source`); where they are
    nowhere, a FileNotFoundError says how to get them. Sharded as `digits`:
    the same global batches for any number of workers and any batch.

    Args:
        image_size: model input side (default 67, for alexnet_bn); 28 keeps
            the images as stored.
        num_examples: only the split's first N examples (default: all), e.g.
            for a quick run.
        Others as in `digits`.
    """
    images, labels = fashion_mnist_source.arrays(split, data_dir)
    if num_examples is not None:
        if not 0 < num_examples <= len(labels):
            raise ValueError(
                f"`num_examples` must be between 1 and the {split} split's "
                f"{len(labels)} examples. Received: num_examples={num_examples}")
        images, labels = images[:num_examples], labels[:num_examples]
    return _batched(
        images, labels, SPECS["fashion_mnist"], split, global_batch_size,
        image_size, training, input_context, seed, start_step, drop_remainder,
        start_example,
    )


def synthetic(global_batch_size, image_size=None, *, input_context=None, seed=0,
              num_classes=1000, channels=3):
    """Endless ImageNet-shaped random batches, for throughput measurements.

    One random batch is made once and repeated, so the host does no work per
    step and the measurement is of the model and the all-reduce alone.
    """
    image_size = image_size or SPECS["synthetic"].default_image_size
    check_batch(global_batch_size, None, "synthetic")
    _, batch = worker_share(global_batch_size, *_this_worker(input_context))
    generator = tf.random.Generator.from_seed(seed)
    images = generator.normal([batch, image_size, image_size, channels])
    labels = generator.uniform([batch], maxval=num_classes, dtype=tf.int64)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def imagenet(split, global_batch_size, image_size=None, *, training=None,
             data_dir=None, manual_dir=None, input_context=None, seed=0,
             start_step=0, drop_remainder=True, start_example=0,
             prepare_timeout_seconds=None):
    """ImageNet (ILSVRC2012) through tensorflow-datasets, read by example.

    ImageNet cannot be downloaded automatically: place ILSVRC2012_img_train.tar
    and ILSVRC2012_img_val.tar in `manual_dir` (default
    `<data_dir>/downloads/manual`). The first run prepares them (pipeline 0
    prepares, the others wait for it; `tfscale.imagenet_source`).

    Training: one stream of example indices, a fresh permutation of the split
    each epoch that depends only on `seed` and the epoch, cut into global
    batches; each worker reads and decodes only its rows of each
    (`worker_share`), so the global batches are the same for any number of
    workers, more workers than files included. Random-resized-crop (scale
    0.08-1, aspect 3/4-4/3; only the crop window is decoded) and a random
    flip, both drawn from the example's position in the stream: the same
    crop whatever the number of workers, and after a resume. A resume skips
    whole global batches without reading them.

    Evaluation: the split in order, resized and center-cropped (`preprocess`),
    every example once with `drop_remainder=False`.

    Args:
        split: "train" or "validation" ("test" is an alias of "validation").
        data_dir, manual_dir: tensorflow-datasets directories.
        prepare_timeout_seconds: how long a pipeline other than 0 waits for
            pipeline 0 to prepare the data set (None: no limit).
        Others as in `digits`.
    """
    from tfscale import imagenet_source

    dataset_spec = SPECS["imagenet"]
    image_size = image_size or dataset_spec.default_image_size
    tfds_split = _imagenet_split(split)
    training = (tfds_split == "train") if training is None else training
    num_workers, worker = _this_worker(input_context)
    version_dir = imagenet_source.ensure_prepared(
        data_dir, manual_dir, prepares=worker == 0,
        timeout_seconds=prepare_timeout_seconds)
    source = imagenet_source.RecordSource(version_dir, tfds_split)
    count = source.num_examples
    check_batch(global_batch_size, count, split)
    if start_example < 0:
        raise ValueError("`start_example` must be >= 0. "
                         f"Received: start_example={start_example}")
    start, size = worker_share(global_batch_size, num_workers, worker)
    if training:
        steps = tf.data.Dataset.range(start_step, np.iinfo(np.int64).max)
    else:
        steps = tf.data.Dataset.range(
            count // global_batch_size if drop_remainder
            else -(-count // global_batch_size))

    def read(step):
        positions = (start_example + step * global_batch_size + start
                     + tf.range(size, dtype=tf.int64))
        if training and size:  # (the op refuses an empty share)
            examples = _shuffled_examples(positions, count, seed)
        elif training:
            examples = positions
        else:
            positions = positions[positions < count]  # the last, partial batch
            examples = positions
        records = tf.numpy_function(source.read, [examples], tf.string, stateful=False)
        parsed = tf.io.parse_example(records, {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)})
        return positions, parsed["image"], parsed["label"]

    if training:
        transform = _random_resized_crop_fn(image_size, seed)
    else:
        def transform(jpeg, position):
            del position
            image = tf.io.decode_jpeg(jpeg, channels=3)
            return preprocess(image[None], dataset_spec, image_size)[0]

    def decode(positions, jpegs, labels):
        images = tf.map_fn(
            lambda args: transform(*args), (jpegs, positions),
            fn_output_signature=tf.TensorSpec([image_size, image_size, 3], tf.float32))
        if training:
            images = _normalize(images, dataset_spec)
        return images, tf.ensure_shape(labels, [None])

    batches = steps.map(read, num_parallel_calls=tf.data.AUTOTUNE)
    batches = batches.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    return batches.prefetch(tf.data.AUTOTUNE)


def _shuffled_examples(positions, count, seed):
    """The example at each stream position: epoch `position // count` is a
    permutation of the split drawn from `(seed, epoch)` alone
    (`tf.random.experimental.index_shuffle`'s op, computed per position)."""
    epochs = positions // count
    # One seed row per position: a batch may straddle two epochs. TF 2.21's
    # `index_shuffle` wrapper pads a [k, 2] seed along the wrong axis, so
    # build the rows it builds for a [2] seed: [498247692, seed, epoch].
    seeds = tf.stack([tf.fill(tf.shape(epochs), tf.constant(498247692, tf.int64)),
                      tf.fill(tf.shape(epochs), tf.constant(seed, tf.int64)),
                      epochs], axis=-1)
    return tf.raw_ops.RandomIndexShuffle(
        index=positions % count, seed=seeds,
        max_index=tf.constant(count - 1, tf.int64), rounds=4)


def check_imagenet_source(data_dir=None, manual_dir=None):
    """Raises FileNotFoundError unless ImageNet is prepared or can be.

    Cheap enough to run before anything starts: it only looks for the
    prepared data set in `data_dir` and for the archives in `manual_dir`.
    """
    from tfscale import imagenet_source

    tfds = _requirements.import_extra("tensorflow_datasets", "imagenet", "ImageNet")
    builder = tfds.builder(imagenet_source.NAME, data_dir=data_dir)
    if tf.io.gfile.exists(os.path.join(builder.data_dir, "dataset_info.json")):
        return
    manual_dir = manual_dir or imagenet_source.default_manual_dir(data_dir)
    missing = [name for name in imagenet_source.ARCHIVES
               if not tf.io.gfile.exists(os.path.join(manual_dir, name))]
    if missing:
        raise FileNotFoundError(
            "ImageNet is not prepared and its archives were not found: place "
            f"{' and '.join(imagenet_source.ARCHIVES)} in --manual_dir (missing: "
            f"{', '.join(missing)} in {manual_dir}; data_dir={data_dir!r}).")


# Split sizes of ILSVRC2012 as tensorflow-datasets prepares it.
_IMAGENET_SPLIT_SIZES = {"train": 1_281_167, "validation": 50_000}


def _imagenet_split(split):
    split = {"test": "validation"}.get(split, split)
    if split not in _IMAGENET_SPLIT_SIZES:
        raise ValueError(
            "ImageNet `split` must be 'train' or 'validation'. "
            f"Received: split={split!r}"
        )
    return split


def digits_arrays(split):
    """(uint8 images [N, 8, 8, 1] on the 0-255 scale, int64 labels) of a split."""
    if split not in ("train", "test"):
        raise ValueError(
            f"Digits `split` must be 'train' or 'test'. Received: split={split!r}"
        )
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    labels = bunch.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=_DIGITS_TEST_FRACTION,
        random_state=_DIGITS_SPLIT_SEED, stratify=labels,
    )
    return (train_x, train_y) if split == "train" else (test_x, test_y)


def _batched(images, labels, dataset_spec, split, global_batch_size, image_size,
             training, input_context, seed, start_step, drop_remainder=True,
             start_example=0):
    """This worker's share of each global batch of an in-memory split,
    preprocessed.

    Training: stream position p holds example `_shuffled_examples(p)`, a
    permutation of the split per epoch drawn from `(seed, epoch)` alone, as
    for ImageNet. The global batches are cut from that stream and each worker
    keeps its rows (`worker_share`). The stream is a function of the position
    only, so a pipeline that starts at `start_step` (a resume) continues the
    same stream exactly: a `shuffle(reshuffle_each_iteration=True)` draws
    each epoch's order from a generator that every iterator of the dataset
    advances (Keras's first-batch peek included), and a resume in a later
    epoch then read another order. Evaluation: one pass, in order; with
    `drop_remainder` whole global batches only, else a last, smaller one too
    (a worker left without rows of it runs out of data first).
    """
    image_size = image_size or dataset_spec.default_image_size
    training = (split == "train") if training is None else training
    count = len(labels)
    check_batch(global_batch_size, count, split)
    if start_example < 0:
        raise ValueError("`start_example` must be >= 0. "
                         f"Received: start_example={start_example}")
    start, size = worker_share(global_batch_size, *_this_worker(input_context))
    images, labels = tf.constant(images), tf.constant(labels)
    if training:
        def rows(step):
            positions = (start_example + step * global_batch_size + start
                         + tf.range(size, dtype=tf.int64))
            # (the op refuses an empty share)
            return _shuffled_examples(positions, count, seed) if size else positions

        batches = tf.data.Dataset.range(start_step, np.iinfo(np.int64).max).map(rows)
    else:
        def rows(step):
            first = step * global_batch_size
            end = tf.minimum(first + global_batch_size, count)
            return tf.range(tf.minimum(first + start, end),
                            tf.minimum(first + start + size, end))

        batches = tf.data.Dataset.range(
            count // global_batch_size if drop_remainder
            else -(-count // global_batch_size)).map(rows)
    batches = batches.map(
        lambda rows: (preprocess(tf.gather(images, rows), dataset_spec, image_size),
                      tf.gather(labels, rows)),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    return batches.prefetch(tf.data.AUTOTUNE)


def _resize_shorter_and_center_crop(images, image_size, crop_fraction=0.875):
    """Resize so the shorter side is image_size / crop_fraction, then crop."""
    shape = tf.shape(images)
    height = tf.cast(shape[1], tf.float32)
    width = tf.cast(shape[2], tf.float32)
    scale = (image_size / crop_fraction) / tf.minimum(height, width)
    new_h = tf.cast(tf.math.ceil(height * scale), tf.int32)
    new_w = tf.cast(tf.math.ceil(width * scale), tf.int32)
    images = tf.image.resize(images, tf.stack([new_h, new_w]))
    top = (new_h - image_size) // 2
    left = (new_w - image_size) // 2
    return images[:, top:top + image_size, left:left + image_size, :]


def _random_resized_crop_fn(image_size, seed):
    """Inception-style crop (Szegedy et al. 2015) + horizontal flip of one
    JPEG, drawn from `(seed, position)`: only the crop window is decoded."""

    def crop(jpeg, position):
        draw = tf.stack([tf.constant(seed, tf.int64), tf.cast(position, tf.int64)])
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.image.extract_jpeg_shape(jpeg),
            bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
            seed=draw,
            min_object_covered=0.1,
            aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=(0.08, 1.0),
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        window = tf.stack([begin[0], begin[1], size[0], size[1]])
        image = tf.image.decode_and_crop_jpeg(jpeg, window, channels=3)
        image = tf.image.resize(tf.cast(image, tf.float32), (image_size, image_size))
        return tf.image.stateless_random_flip_left_right(image, seed=draw + 1)

    return crop
