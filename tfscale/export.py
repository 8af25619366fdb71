"""SavedModel export of a trained classifier, written atomically."""

import ctypes
import errno
import glob
import os
import shutil
import uuid

import keras
import numpy as np
import tensorflow as tf

from tfscale import data


def export_classifier(model, export_dir, dataset_spec, image_size):
    """Writes a SavedModel serving raw images, replacing `export_dir` atomically.

    Its `serving_default` signature takes uint8 images `[batch, H, W, C]` as
    the data set stores them (digits: 8x8x1 on the 0-255 scale) and returns
    class probabilities `[batch, num_classes]`; resizing and normalization
    run inside, exactly as in training.

    The SavedModel is written next to `export_dir` and swapped into place in
    one atomic step, so a process killed at any moment leaves a complete,
    loadable export at `export_dir`: the previous one, or the new one.
    """
    height, width, channels = dataset_spec.stored_shape or (None, None, None)
    channels = channels or dataset_spec.channels

    def serve(images):
        inputs = data.preprocess(images, dataset_spec, image_size)
        logits = model(inputs, training=False)
        return {"probabilities": tf.nn.softmax(tf.cast(logits, tf.float32))}

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(
        name="serving_default",
        fn=serve,
        input_signature=[
            tf.TensorSpec([None, height, width, channels], tf.uint8, name="images")
        ],
    )
    export_dir = os.path.abspath(export_dir)
    os.makedirs(os.path.dirname(export_dir), exist_ok=True)
    _clean_up_interrupted(export_dir)
    partial = f"{export_dir}{_PARTIAL}{uuid.uuid4().hex[:8]}"
    try:
        archive.write_out(partial, verbose=False)
        replace_directory(partial, export_dir)
    finally:
        # After the swap `partial` holds the previous export.
        shutil.rmtree(partial, ignore_errors=True)
    return export_dir


def served_probabilities(export_dir, images):
    """Class probabilities the SavedModel at `export_dir` serves for `images`
    (uint8, as the data set stores them)."""
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    return np.concatenate([
        serve(images=tf.constant(chunk))["probabilities"].numpy()
        for chunk in _chunks(images)])


def _chunks(images, size=500):
    """`images` in slices of `size`: 10,000 test images upsampled for
    alexnet_bn at once would take gigabytes."""
    return [images[i:i + size] for i in range(0, len(images), size)]


def verify_export(export_dir, model, images, dataset_spec, image_size):
    """Checks that the export serves what `model` predicts in this process.

    Returns:
        The served probabilities for `images`.

    Raises:
        RuntimeError: naming how many images the two classify differently.
    """
    served = served_probabilities(export_dir, images)
    in_process = np.concatenate([
        tf.nn.softmax(tf.cast(model(data.preprocess(chunk, dataset_spec, image_size),
                                    training=False), tf.float32)).numpy()
        for chunk in _chunks(images)])
    differ = int(np.sum(served.argmax(1) != in_process.argmax(1)))
    if differ:
        raise RuntimeError(
            f"The export at {export_dir} classifies {differ} of {len(images)} "
            "images differently from the trained model; it was not written "
            "from this model, or its preprocessing differs from training's."
        )
    return served


# Siblings of an export directory: one being written (or, after the swap, the
# previous export being removed), and one a two-rename swap moved aside.
_PARTIAL = ".partial-"
_PREVIOUS = ".previous-"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def replace_directory(source, target):
    """Moves directory `source` to `target`, replacing it atomically.

    A new `target` is a plain rename. An existing one is exchanged with
    `source` by Linux's `renameat2(RENAME_EXCHANGE)`, so `target` is never
    missing; `source` then holds the old contents, for the caller to delete.
    Where the exchange is unsupported (another OS or filesystem), the old
    `target` is renamed aside first; a crash between the two renames leaves
    it at `target.previous-*`, which the next export puts back.
    """
    if not os.path.exists(target):
        os.rename(source, target)
        return
    if _exchange(source, target):
        return
    previous = f"{target}{_PREVIOUS}{uuid.uuid4().hex[:8]}"
    os.rename(target, previous)
    os.rename(source, target)
    os.rename(previous, source)


def _exchange(a, b):
    """Atomically swaps paths `a` and `b`; False where the OS cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                 _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def _clean_up_interrupted(export_dir):
    """Puts back an export a crash left aside, and deletes partial writes.

    One process exports to a directory at a time (the chief), so any
    sibling left from an earlier export is stale.
    """
    previous = sorted(glob.glob(glob.escape(export_dir) + _PREVIOUS + "*"))
    if previous and not os.path.exists(export_dir):
        os.rename(previous.pop(), export_dir)
    for stale in previous + glob.glob(glob.escape(export_dir) + _PARTIAL + "*"):
        shutil.rmtree(stale, ignore_errors=True)
