"""SavedModel export of a trained classifier, written atomically."""

import os
import shutil
import uuid

import keras
import tensorflow as tf

from tfscale import data


def export_classifier(model, export_dir, dataset_spec, image_size):
    """Writes a SavedModel serving raw images, replacing `export_dir` atomically.

    Its `serving_default` signature takes uint8 images `[batch, H, W, C]` as
    the data set stores them (digits: 8x8x1 on the 0-255 scale) and returns
    class probabilities `[batch, num_classes]`; resizing and normalization
    run inside, exactly as in training.

    The SavedModel is written next to `export_dir` and renamed into place, so
    an interrupted export leaves any previous one intact and loadable.
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
    parent = os.path.dirname(export_dir)
    os.makedirs(parent, exist_ok=True)
    partial = f"{export_dir}.partial-{uuid.uuid4().hex[:8]}"
    previous = f"{export_dir}.previous-{uuid.uuid4().hex[:8]}"
    try:
        archive.write_out(partial, verbose=False)
        if os.path.exists(export_dir):
            os.rename(export_dir, previous)
        os.rename(partial, export_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(previous, ignore_errors=True)
    return export_dir
