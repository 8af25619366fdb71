"""tfscale.data's Fashion-MNIST: its four files found where users keep them,
read as Keras reads them, sharded like digits. The tests that need the files
skip, with the line that says how to get them, where they are absent."""

import gzip
import os

import numpy as np
import pytest
import tensorflow as tf

from tfscale import data
from tfscale import fashion_mnist_source as source
from skips import FASHION_MNIST_MISSING
from skips import needs_fashion_mnist


# Where the files are on this machine, before any test hides them.
FOUND = None if FASHION_MNIST_MISSING else source.find()


def context(num_workers, index):
    return tf.distribute.InputContext(
        num_input_pipelines=num_workers, input_pipeline_id=index,
        num_replicas_in_sync=num_workers)


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No Keras cache and no Debian package: only what a test puts in place."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setattr(source, "DEBIAN_DIR", str(tmp_path / "no-debian"))
    return tmp_path


def link_files(directory):
    directory.mkdir(parents=True, exist_ok=True)
    for pair in source.FILES.values():
        for name in pair:
            os.symlink(os.path.join(FOUND, name), directory / name)
    return directory


@needs_fashion_mnist
def test_the_splits_are_the_60000_and_10000_images_of_10_balanced_classes():
    train_x, train_y = source.arrays("train")
    test_x, test_y = source.arrays("test")
    assert train_x.shape == (60000, 28, 28, 1) and test_x.shape == (10000, 28, 28, 1)
    assert train_x.dtype == np.uint8 and train_y.dtype == np.int64
    assert np.bincount(train_y).tolist() == [6000] * 10
    assert np.bincount(test_y).tolist() == [1000] * 10
    assert data.num_examples("fashion_mnist", "test") == 10000
    # The normalization constants are the training set's own statistics.
    spec = data.spec("fashion_mnist")
    assert abs(train_x.mean() - spec.mean[0]) < 0.01
    assert abs(train_x.std() - spec.std[0]) < 0.01


@needs_fashion_mnist
def test_keras_cache_is_found_through_keras_home(nowhere):
    link_files(nowhere / "keras_home" / "datasets" / "fashion-mnist")
    assert source.find() == str(nowhere / "keras_home" / "datasets" / "fashion-mnist")
    assert source.arrays("test")[0].shape == (10000, 28, 28, 1)


@needs_fashion_mnist
def test_a_given_directory_comes_first(nowhere):
    given = link_files(nowhere / "mine")
    link_files(nowhere / "keras_home" / "datasets" / "fashion-mnist")
    assert source.find(str(given)) == str(given)


def test_files_nowhere_say_in_one_line_how_to_get_them(nowhere):
    with pytest.raises(FileNotFoundError) as raised:
        source.find()
    message = str(raised.value)
    assert "\n" not in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "keras.datasets.fashion_mnist.load_data()" in message
    assert str(nowhere / "keras_home" / "datasets" / "fashion-mnist") in message
    with pytest.raises(FileNotFoundError, match="apt-get install"):
        data.fashion_mnist("train", 128)


def test_an_incomplete_directory_names_the_missing_files(nowhere):
    (nowhere / "mine").mkdir()
    with pytest.raises(FileNotFoundError) as raised:
        source.find(str(nowhere / "mine"))
    assert "lacks Fashion-MNIST's train-images-idx3-ubyte.gz" in str(raised.value)


def test_a_file_that_is_not_idx_is_refused(nowhere):
    mine = nowhere / "mine"
    mine.mkdir()
    for pair in source.FILES.values():
        for name in pair:
            with gzip.open(mine / name, "wb") as f:
                f.write(b"<html>not found</html>")
    with pytest.raises(ValueError, match="is not an IDX file"):
        source.arrays("train", str(mine))


@needs_fashion_mnist
def test_the_pipeline_keeps_28x28_as_stored_and_normalizes_as_the_export():
    images, labels = next(iter(data.fashion_mnist("test", 50, image_size=28)))
    raw, raw_labels = source.arrays("test")
    expected = (raw[:50].astype(np.float32) - 72.94) / 90.02
    np.testing.assert_allclose(images, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(labels, raw_labels[:50])
    upsampled, _ = next(iter(data.load("fashion_mnist", "test", 8, None)))
    assert upsampled.shape == (8, 67, 67, 1)  # alexnet_bn's default input


@needs_fashion_mnist
def test_num_examples_trains_on_the_first_examples_of_the_split_only():
    raw, _ = source.arrays("train")
    first = (raw[:100].astype(np.float32) - 72.94) / 90.02
    # Two epochs of 100 examples in batches of 50: each a shuffled order of
    # exactly the first 100.
    batches = [x.numpy() for x, _ in data.fashion_mnist(
        "train", 50, 28, num_examples=100).take(4)]
    for epoch in range(2):
        images = np.concatenate(batches[2 * epoch:2 * epoch + 2])
        distances = np.abs(images[:, None] - first[None]).reshape(100, 100, -1).max(-1)
        assert sorted(np.argmin(distances, axis=1)) == list(range(100))
        assert np.all(distances.min(axis=1) < 1e-4)
    with pytest.raises(ValueError, match="between 1 and the test split's "
                                         "10000 examples. Received: num_examples=10001"):
        data.fashion_mnist("test", 50, 28, num_examples=10001)


@needs_fashion_mnist
@pytest.mark.parametrize("num_workers", [2, 3])
def test_workers_together_see_the_one_worker_global_batches(num_workers):
    global_batch = 7000  # 8 steps an epoch: step 9 is in the second epoch
    single = data.fashion_mnist("train", global_batch, 28, seed=3)
    iterators = [iter(data.fashion_mnist("train", global_batch, 28, seed=3,
                                         input_context=context(num_workers, i)))
                 for i in range(num_workers)]
    for images, labels in single.take(10):
        parts = [next(iterator) for iterator in iterators]
        assert [len(p[1]) for p in parts] == [
            data.worker_share(global_batch, num_workers, i)[1]
            for i in range(num_workers)]
        np.testing.assert_array_equal(
            np.concatenate([p[1] for p in parts]), labels.numpy())
        np.testing.assert_array_equal(
            np.concatenate([p[0] for p in parts]), images.numpy())
