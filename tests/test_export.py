"""tfscale.export: serving signature and atomic replacement."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale import data
from tfscale import export

SPEC = data.spec("digits")


def tiny_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((12, 12, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(10)])


def serve(path, images):
    signature = tf.saved_model.load(path).signatures["serving_default"]
    return signature(images=tf.constant(images))["probabilities"].numpy()


def test_served_export_predicts_what_the_model_predicts_in_process(tmp_path):
    # The serving signature takes the stored uint8 images and runs the
    # training preprocessing inside; in process the model gets it done outside.
    model = tiny_model(0)
    path = export.export_classifier(model, str(tmp_path / "export"), SPEC, 12)
    images, _ = data.digits_arrays("test")
    logits = model.predict(data.preprocess(images[:64], SPEC, 12), verbose=0)
    expected = tf.nn.softmax(logits).numpy()
    served = serve(path, images[:64])
    assert len(set(expected.argmax(1))) > 1  # not one class for every image
    np.testing.assert_array_equal(served.argmax(1), expected.argmax(1))
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_interrupted_export_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    target = str(tmp_path / "export")
    export.export_classifier(tiny_model(0), target, SPEC, 12)
    images, _ = data.digits_arrays("test")
    before = serve(target, images[:4])

    def write_half_then_fail(self, filepath, **kwargs):
        os.makedirs(filepath)
        open(os.path.join(filepath, "saved_model.pb"), "wb").write(b"half")
        raise KeyboardInterrupt("interrupted midway")

    # ExportArchive() returns an instance of the backend's subclass.
    archive_class = type(keras.export.ExportArchive())
    monkeypatch.setattr(archive_class, "write_out", write_half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        export.export_classifier(tiny_model(1), target, SPEC, 12)
    np.testing.assert_array_equal(serve(target, images[:4]), before)
    assert os.listdir(tmp_path) == ["export"]


def test_a_new_export_replaces_the_old(tmp_path):
    target = str(tmp_path / "export")
    images, _ = data.digits_arrays("test")
    export.export_classifier(tiny_model(0), target, SPEC, 12)
    first = serve(target, images[:4])
    export.export_classifier(tiny_model(1), target, SPEC, 12)
    assert not np.allclose(serve(target, images[:4]), first)
    assert os.listdir(tmp_path) == ["export"]


def test_verify_export_refuses_an_export_of_another_model(tmp_path):
    images, _ = data.digits_arrays("test")
    model = tiny_model(0)
    path = export.export_classifier(model, str(tmp_path / "export"), SPEC, 12)
    served = export.verify_export(path, model, images[:64], SPEC, 12)
    np.testing.assert_allclose(served.sum(1), 1, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"classifies \d+ of 64 images differently"):
        export.verify_export(path, tiny_model(1), images[:64], SPEC, 12)
