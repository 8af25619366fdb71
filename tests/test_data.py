"""tfscale.data: digits, synthetic, ImageNet (offline with tfds mock data)."""

import concurrent.futures
import os
import re
import shutil
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tfscale.launch.studies import imagenet_archives
from tfscale import data
from tfscale import imagenet_source


def context(num_workers, index):
    return tf.distribute.InputContext(
        num_input_pipelines=num_workers, input_pipeline_id=index,
        num_replicas_in_sync=num_workers,
    )


def test_digits_is_the_real_bundled_set_with_a_fixed_split():
    train_x, train_y = data.digits_arrays("train")
    test_x, test_y = data.digits_arrays("test")
    assert train_x.shape == (1437, 8, 8, 1) and test_x.shape == (360, 8, 8, 1)
    assert train_x.dtype == np.uint8 and train_x.max() == 255
    assert sorted(set(test_y.tolist())) == list(range(10))
    again_x, again_y = data.digits_arrays("test")
    np.testing.assert_array_equal(again_x, test_x)
    assert data.num_examples("digits", "train") == 1437


def test_digits_pipeline_resizes_and_normalizes_with_the_export_transform():
    ds = data.digits("test", 40, image_size=16)
    images, labels = next(iter(ds))
    assert images.shape == (40, 16, 16, 1) and images.dtype == tf.float32
    raw, raw_labels = data.digits_arrays("test")
    expected = data.preprocess(raw[:40], data.spec("digits"), 16)
    np.testing.assert_allclose(images, expected, rtol=1e-6)
    np.testing.assert_array_equal(labels, raw_labels[:40])
    assert -1.0 <= float(tf.reduce_min(images)) and float(tf.reduce_max(images)) <= 1.0


def test_eval_pass_has_whole_global_batches_only():
    batches = list(data.digits("test", 64, image_size=8, input_context=context(2, 1)))
    assert len(batches) == 360 // 64
    assert all(b[0].shape[0] == 32 for b in batches)


def test_eval_pass_without_drop_remainder_has_every_example_in_order():
    batches = list(data.load("digits", "test", 64, 8, drop_remainder=False))
    assert [len(labels) for _, labels in batches] == [64] * 5 + [40]
    np.testing.assert_array_equal(np.concatenate([l for _, l in batches]),
                                  data.digits_arrays("test")[1])


@pytest.mark.parametrize("num_workers", [3, 7])
def test_every_worker_count_evaluates_every_example_once(num_workers):
    # 360 test images in global batches of 64 (22/21/21 on 3 workers), the
    # last of 40; interleaved step by step, the workers' batches give the
    # split in order.
    parts = [[labels.numpy() for _, labels in
              data.digits("test", 64, image_size=8, drop_remainder=False,
                          input_context=context(num_workers, i))]
             for i in range(num_workers)]
    assert len({len(p) for p in parts}) == 1  # a share may be empty, not missing
    steps = [np.concatenate([p[step] for p in parts]) for step in range(len(parts[0]))]
    np.testing.assert_array_equal(np.concatenate(steps), data.digits_arrays("test")[1])


@pytest.mark.parametrize("num_workers", [2, 3, 5])
def test_workers_together_see_the_one_worker_global_batches(num_workers):
    global_batch = 12  # 6/6, 4/4/4 and 3/3/2/2/2
    single = data.digits("train", global_batch, image_size=8, seed=7)
    shards = [data.digits("train", global_batch, image_size=8, seed=7,
                          input_context=context(num_workers, i))
              for i in range(num_workers)]
    iterators = [iter(s) for s in shards]
    # 1437 // 12 = 119 steps per epoch: step 130 is in the second epoch.
    for step, (_, labels) in enumerate(single.take(130)):
        parts = [next(it)[1].numpy() for it in iterators]
        assert [len(p) for p in parts] == [
            data.worker_share(global_batch, num_workers, i)[1] for i in range(num_workers)]
        np.testing.assert_array_equal(
            np.sort(np.concatenate(parts)), np.sort(labels.numpy()))


def global_batches(num_workers, steps, start_step=0, global_batch=12,
                   start_example=0):
    """The first `steps` global batches of `num_workers` workers from
    `start_step`, each as its examples (image bytes + label) in sorted order."""
    iterators = [iter(data.digits("train", global_batch, image_size=8, seed=7,
                                  start_step=start_step,
                                  start_example=start_example,
                                  input_context=context(num_workers, i)))
                 for i in range(num_workers)]
    batches = []
    for _ in range(steps):
        examples = []
        for iterator in iterators:
            images, labels = next(iterator)
            examples += [image.tobytes() + bytes([label])
                         for image, label in zip(images.numpy(), labels.numpy())]
        batches.append(sorted(examples))
    return batches


def test_a_resume_on_fewer_workers_trains_on_the_same_global_batches():
    # A checkpoint of 3 workers at step 100, resumed on 2: steps 100-139
    # (into the second epoch at 119) hold the same examples as the 3 would
    # have trained on, in the same order of steps.
    three = global_batches(3, 140)
    two = global_batches(2, 40, start_step=100)
    assert len(set(three[0])) == 12  # whole examples: the check can tell them apart
    assert two == three[100:]
    assert three[100] != three[101]


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_a_grown_batch_continues_the_stream_for_any_number_of_workers(num_workers):
    # A batch schedule's second phase (batch 24 from example 1200, i.e.
    # after 100 steps of 12) reads on where the first stopped: its batch j
    # holds the examples of the first phase's batches 100 + 2j and 101 + 2j,
    # with 1, 2 or 3 workers; and resumed 5 steps into the phase likewise.
    small = global_batches(1, 140)
    grown = global_batches(num_workers, 20, global_batch=24, start_example=1200)
    assert grown == [sorted(small[100 + 2 * j] + small[101 + 2 * j])
                     for j in range(20)]
    assert global_batches(num_workers, 3, start_step=5, global_batch=24,
                          start_example=1200) == grown[5:8]


def test_a_negative_start_example_is_refused():
    with pytest.raises(ValueError, match=r"`start_example` must be >= 0. "
                       r"Received: start_example=-1"):
        data.digits("train", 12, input_context=context(2, 0), start_example=-1)


def test_training_reshuffles_each_epoch():
    ds = data.digits("train", 1437 - 1437 % 3, image_size=8, seed=0)
    first, second = [labels.numpy() for _, labels in ds.take(2)]
    assert not np.array_equal(first, second)


def test_worker_share_splits_as_tf_distribute_does():
    assert [data.worker_share(32, 3, i) for i in range(3)] == [(0, 11), (11, 11), (22, 10)]
    assert [data.worker_share(2, 3, i) for i in range(3)] == [(0, 1), (1, 1), (2, 0)]
    assert data.describe_share(32, 3) == "10-11 per worker"
    assert data.describe_share(32, 4) == "8 per worker"


def test_a_global_batch_the_workers_cannot_share_evenly_is_taken():
    # 64 on 3 workers: 22, 21, 21, and together the one-worker batch.
    shares = [next(iter(data.digits("train", 64, image_size=8, seed=3,
                                    input_context=context(3, i))))[1].numpy()
              for i in range(3)]
    assert [len(s) for s in shares] == [22, 21, 21]
    whole = next(iter(data.digits("train", 64, image_size=8, seed=3)))[1].numpy()
    np.testing.assert_array_equal(np.concatenate(shares), whole)


def test_split_smaller_than_a_global_batch_is_refused():
    with pytest.raises(ValueError, match=r"'test' split has 360 examples, fewer than "
                       r"one global batch. Received: global_batch_size=512"):
        data.digits("test", 512)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="Unknown data set: 'cifar'. Known: "
                       "digits, fashion_mnist, imagenet, synthetic"):
        data.spec("cifar")
    with pytest.raises(ValueError, match="`split` must be 'train' or 'test'. "
                       "Received: split='validation'"):
        data.digits("validation", 8)


def test_synthetic_is_imagenet_shaped_and_per_worker():
    images, labels = next(iter(data.synthetic(32, 64, input_context=context(4, 2))))
    assert images.shape == (8, 64, 64, 3) and labels.shape == (8,)
    images, _ = next(iter(data.synthetic(32, 16, input_context=context(3, 2))))
    assert images.shape[0] == 10
    assert 0 <= int(tf.reduce_min(labels)) and int(tf.reduce_max(labels)) < 1000


@pytest.fixture(scope="module")
def imagenet_dirs(tmp_path_factory):
    """Archives in the real ILSVRC2012 layout (tests/imagenet_archives.py),
    prepared as a first run does: by the first call of `data.imagenet`."""
    root = tmp_path_factory.mktemp("imagenet")
    synsets = imagenet_archives.write(str(root / "manual"), num_validation=12,
                                      train_per_synset=6)
    data_dir, manual_dir = str(root / "data"), str(root / "manual")
    next(iter(data.imagenet("validation", 4, 32, data_dir=data_dir,
                            manual_dir=manual_dir)))
    return data_dir, manual_dir, synsets


def test_imagenet_is_prepared_from_archives_in_the_real_layout(imagenet_dirs):
    data_dir, _, synsets = imagenet_dirs
    assert data.num_examples("imagenet", "train", data_dir) == 6 * len(synsets)
    assert data.num_examples("imagenet", "validation", data_dir) == 12
    # One TFRecord file per split: fewer files than the workers below.
    version_dir = imagenet_source.prepared_dir(data_dir)
    assert len([f for f in os.listdir(version_dir) if "train.tfrecord" in f]) == 1
    # Validation labels are tensorflow-datasets' own (in the order it wrote).
    labels = np.concatenate([y.numpy() for _, y in data.imagenet(
        "validation", 5, 32, data_dir=data_dir, drop_remainder=False)])
    names = tfds.builder("imagenet2012", data_dir=data_dir).info.features["label"].names
    assert (sorted(names[label] for label in labels)
            == sorted(imagenet_archives.validation_labels(12)))


@pytest.mark.parametrize("num_workers", [2, 3, 9])
def test_imagenet_global_batches_are_the_same_for_any_number_of_workers(
        imagenet_dirs, num_workers):
    # 9 workers on one file, and a batch of 8: one worker gets no rows.
    data_dir, _, _ = imagenet_dirs

    def steps(num_workers, **kwargs):
        parts = [list(data.imagenet("train", 8, 32, data_dir=data_dir, seed=3,
                                    input_context=context(num_workers, i),
                                    **kwargs).take(12))
                 for i in range(num_workers)]
        return [(np.concatenate([p[t][0] for p in parts]),
                 np.concatenate([p[t][1] for p in parts])) for t in range(12)]

    one, many = steps(1), steps(num_workers)
    for (images, labels), (their_images, their_labels) in zip(one, many):
        np.testing.assert_array_equal(their_labels, labels)
        np.testing.assert_array_equal(their_images, images)  # same crops
    # A resume at step 5 reads on exactly there.
    resumed = steps(num_workers, start_step=5)
    np.testing.assert_array_equal(resumed[0][0], one[5][0])
    # The first epoch (72 examples: step 9 crosses into the second) is a
    # permutation of the split.
    count = data.num_examples("imagenet", "train", data_dir)
    first_epoch = np.concatenate([labels for _, labels in one])[:count]
    assert sorted(first_epoch.tolist()) == sorted(
        np.concatenate([y.numpy() for _, y in data.imagenet(
            "train", count, 32, data_dir=data_dir, training=False)]).tolist())


@pytest.mark.parametrize("num_workers", [1, 3, 13])
def test_imagenet_evaluation_reads_every_example_once(imagenet_dirs, num_workers):
    data_dir, _, _ = imagenet_dirs
    parts = [[y.numpy() for _, y in data.imagenet(
        "validation", 5, 32, data_dir=data_dir, drop_remainder=False,
        input_context=context(num_workers, i))] for i in range(num_workers)]
    assert len({len(p) for p in parts}) == 1  # 3 steps each: 5, 5 and 2
    in_order = np.concatenate([np.concatenate([p[t] for p in parts])
                               for t in range(len(parts[0]))])
    whole = np.concatenate([y.numpy() for _, y in data.imagenet(
        "validation", 12, 32, data_dir=data_dir)])
    np.testing.assert_array_equal(in_order, whole)


def test_imagenet_records_are_read_from_many_threads_at_once(imagenet_dirs, monkeypatch):
    # tf.data's parallel map calls `read` from several threads: their first
    # reads of a file must share one open file, not close each other's.
    data_dir, _, _ = imagenet_dirs
    version_dir = imagenet_source.prepared_dir(data_dir)
    opened, real_open = [], open

    def slow_open(path, *args):  # widens the window between check and open
        opened.append(path)
        time.sleep(0.05)
        return real_open(path, *args)

    monkeypatch.setattr(imagenet_source, "open", slow_open, raising=False)
    source = imagenet_source.RecordSource(version_dir, "validation")
    ids = np.arange(source.num_examples)
    expected = imagenet_source.RecordSource(version_dir, "validation").read(ids)
    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        results = list(threads.map(lambda _: source.read(ids), range(8)))
    assert len(opened) == 2  # the expected's one file, then the source's one
    for records in results:
        assert records.tolist() == expected.tolist()


def test_a_waiting_worker_names_what_it_waits_for(tmp_path):
    with pytest.raises(TimeoutError, match=r"Waited \d+ s for worker 0 to prepare "
                       r"ImageNet in .*imagenet2012.* \(dataset_info.json and the "
                       r"tfscale-record-index files\), which never appeared"):
        data.imagenet("train", 8, 32, data_dir=str(tmp_path),
                      input_context=context(2, 1), prepare_timeout_seconds=0.2)


def test_a_half_prepared_folder_is_never_read_as_complete(imagenet_dirs, tmp_path):
    # A preparation killed half-way leaves tensorflow-datasets' incomplete.*
    # folder, and an index being written its temporary file.
    data_dir, manual_dir, _ = imagenet_dirs
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    version_dir = imagenet_source.prepared_dir(str(copy))
    os.remove(os.path.join(version_dir, "tfscale-record-index-validation.npz"))
    assert imagenet_source.prepared_dir(str(copy)) is None
    incomplete = tmp_path / "fresh" / "imagenet2012" / "incomplete.ABC123_5.1.0"
    incomplete.mkdir(parents=True)
    (incomplete / "imagenet2012-train.tfrecord-00000-of-00001").write_bytes(b"partial")
    assert imagenet_source.prepared_dir(str(tmp_path / "fresh")) is None
    # The next preparation completes both.
    assert imagenet_source.prepare(str(copy), manual_dir) == version_dir
    assert imagenet_source.prepared_dir(str(copy)) == version_dir


def test_imagenet_without_archives_names_the_files(tmp_path):
    with pytest.raises(FileNotFoundError,
                       match="ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar"):
        data.imagenet("validation", 8, data_dir=str(tmp_path / "data"),
                      manual_dir=str(tmp_path / "missing"))


def test_serving_transform_center_crops_imagenet():
    images = tf.zeros([2, 300, 400, 3], tf.uint8)
    out = data.preprocess(images, data.spec("imagenet"), 224)
    assert out.shape == (2, 224, 224, 3)


def test_check_batch_refuses_unequal_micro_batches():
    data.check_batch(36, None, "train", accumulation_steps=4)
    with pytest.raises(ValueError, match=re.escape(
            "`global_batch_size` must be divisible by `accumulation_steps` (4), "
            "so that every update averages equal micro-batches. Received: "
            "global_batch_size=38; use e.g. 36.")):
        data.check_batch(38, None, "train", accumulation_steps=4)
