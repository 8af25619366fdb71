"""ImageNet as tensorflow-datasets prepares it, read by example index.

tensorflow-datasets writes ILSVRC2012 as TFRecord files (1024 for training
and 64 for validation at full size; one each for a few hundred images) and
reads them a file per worker (`tfds.ReadConfig(input_context=...)`): no more
workers than files, and other examples for another number of workers. tfscale
reads them by example instead:

- `prepare` runs tensorflow-datasets' own preparation from the archives
  (`ILSVRC2012_img_train.tar`, `ILSVRC2012_img_val.tar` in `manual_dir`),
  then indexes where each record of each split starts: the TFRecord framing
  (an 8-byte length, a 4-byte CRC, the record, a 4-byte CRC) read header by
  header, about 20 bytes an example, saved beside the prepared files.
- `RecordSource` reads any example's serialized `tf.train.Example` with one
  `pread`, so each worker reads only its own rows of each global batch
  (`tfscale.data.imagenet`), on any number of workers, and a resume skips
  whole global batches without reading them.
- `ensure_prepared` lets one worker prepare while the others wait for it,
  with progress in their logs and a timeout that names what they wait for.
  tensorflow-datasets prepares in an `incomplete.*` folder that it renames
  when done, and the index is written to a temporary file and renamed: a
  preparation killed half-way is never read as complete (its folder is left
  for tensorflow-datasets to ignore; the next preparation starts anew).

Record order is tensorflow-datasets': fixed by the file names of the
archives, the same on every machine that prepares the same archives.
"""

import os
import struct
import threading
import time

from absl import logging
import numpy as np

from tfscale import _requirements

NAME = "imagenet2012"
SPLITS = ("train", "validation")
ARCHIVES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")
# How often a waiting worker logs that it is still waiting.
LOG_SECONDS = 60


def _builder(data_dir):
    return _tfds().builder(NAME, data_dir=data_dir)


def _tfds():
    """tensorflow_datasets (a slow import, only when used; the [imagenet]
    extra)."""
    return _requirements.import_extra("tensorflow_datasets", "imagenet", "ImageNet")


def _index_path(version_dir, split):
    return os.path.join(version_dir, f"tfscale-record-index-{split}.npz")


def prepared_dir(data_dir):
    """The prepared data set's folder if preparation and indexing are
    complete, else None."""
    version_dir = _builder(data_dir).data_dir
    complete = [os.path.join(version_dir, "dataset_info.json")] + [
        _index_path(version_dir, split) for split in SPLITS]
    return version_dir if all(os.path.exists(p) for p in complete) else None


def num_examples(data_dir, split):
    """Examples of a prepared split, or None before preparation."""
    version_dir = prepared_dir(data_dir)
    if version_dir is None:
        return None
    with np.load(_index_path(version_dir, split)) as index:
        return len(index["offsets"])


def _missing_archives(manual_dir):
    return [name for name in ARCHIVES
            if not os.path.exists(os.path.join(manual_dir, name))]


def default_manual_dir(data_dir):
    """tensorflow-datasets' default `manual_dir`: `<data_dir>/downloads/manual`."""
    version_dir = _builder(data_dir).data_dir  # <root>/imagenet2012/<version>
    root = os.path.dirname(os.path.dirname(version_dir))
    return os.path.join(root, "downloads", "manual")


def prepare(data_dir=None, manual_dir=None):
    """Prepares ImageNet from its archives (tensorflow-datasets) and indexes
    its records; does nothing where both are done. Returns the folder.

    Raises:
        FileNotFoundError: naming the archives missing from `manual_dir`.
    """
    tfds = _tfds()
    builder = _builder(data_dir)
    version_dir = builder.data_dir
    if not os.path.exists(os.path.join(version_dir, "dataset_info.json")):
        manual_dir = manual_dir or default_manual_dir(data_dir)
        missing = _missing_archives(manual_dir)
        if missing:
            raise FileNotFoundError(
                "ImageNet is not prepared and its archives were not found: "
                f"place {' and '.join(ARCHIVES)} in --manual_dir (missing: "
                f"{', '.join(missing)} in {manual_dir}; data_dir={data_dir!r}).")
        stale = _incomplete_folders(version_dir)
        if stale:
            logging.warning(
                "Earlier preparations of ImageNet that did not finish left %s; "
                "tensorflow-datasets ignores them (delete them to free the "
                "space).", ", ".join(stale))
        logging.info("Preparing ImageNet in %s from the archives in %s "
                     "(tensorflow-datasets; hours for the full archives).",
                     version_dir, manual_dir)
        start = time.monotonic()
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
        logging.info("Prepared ImageNet in %.0f s.", time.monotonic() - start)
    for split in SPLITS:
        path = _index_path(version_dir, split)
        if not os.path.exists(path):
            _write_index(builder, split, path)
    return version_dir


def _incomplete_folders(version_dir):
    parent = os.path.dirname(version_dir)
    if not os.path.isdir(parent):
        return []
    return sorted(os.path.join(parent, name) for name in os.listdir(parent)
                  if name.startswith("incomplete."))


def _write_index(builder, split, path):
    """Indexes the records of `split`'s files into `path` (atomically)."""
    start = time.monotonic()
    files, offsets, lengths = [], [], []
    instructions = builder.info.splits[split].file_instructions
    for number, instruction in enumerate(instructions):
        file_offsets, file_lengths = record_offsets(os.fspath(instruction.filename))
        end = instruction.skip + instruction.take
        offsets.append(file_offsets[instruction.skip:end])
        lengths.append(file_lengths[instruction.skip:end])
        files.append(np.full(len(offsets[-1]), number, np.int32))
    temporary = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(temporary, files=np.concatenate(files), offsets=np.concatenate(offsets),
             lengths=np.concatenate(lengths),
             names=np.array([os.path.basename(os.fspath(i.filename))
                             for i in instructions]))
    os.replace(temporary, path)
    logging.info("Indexed the %d %s records of ImageNet in %.1f s.",
                 sum(len(o) for o in offsets), split, time.monotonic() - start)


def record_offsets(path):
    """(offsets, lengths) of the records of a TFRecord file: where each
    record's data starts and how long it is, from the framing alone."""
    offsets, lengths = [], []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        position = 0
        while position < size:
            f.seek(position)
            (length,) = struct.unpack("<Q", f.read(8))
            offsets.append(position + 12)
            lengths.append(length)
            position += 12 + length + 4
    return np.array(offsets, np.int64), np.array(lengths, np.int64)


def ensure_prepared(data_dir=None, manual_dir=None, prepares=True,
                    timeout_seconds=None, log_seconds=LOG_SECONDS, who="worker 0"):
    """The prepared folder, once ready: prepared here if `prepares`, else
    waited for (another worker, `who`, prepares it into the same `data_dir`).

    Raises:
        TimeoutError: after `timeout_seconds` (None: no limit) of waiting,
            naming the folder and what is missing from it.
    """
    if prepares:
        return prepare(data_dir, manual_dir)
    start = last_log = time.monotonic()
    while True:
        version_dir = prepared_dir(data_dir)
        if version_dir:
            return version_dir
        waited = time.monotonic() - start
        if timeout_seconds is not None and waited >= timeout_seconds:
            raise TimeoutError(
                f"Waited {waited:.0f} s for {who} to prepare ImageNet in "
                f"{_builder(data_dir).data_dir} (dataset_info.json and the "
                "tfscale-record-index files), which never appeared. Is "
                "--data_dir on storage every worker shares? Prepare it once "
                "beforehand with `tfscale-train --dataset=imagenet "
                "--prepare_only`, or raise --prepare_timeout.")
        if time.monotonic() - last_log >= log_seconds:
            last_log = time.monotonic()
            logging.info("Waiting for %s to prepare ImageNet in %s (%.0f s so far%s).",
                         who, _builder(data_dir).data_dir, waited,
                         "" if timeout_seconds is None else
                         f"; giving up after {timeout_seconds:g} s")
        left = (5.0 if timeout_seconds is None else timeout_seconds - waited)
        time.sleep(max(0.05, min(5.0, log_seconds, left)))


class RecordSource:
    """The serialized `tf.train.Example`s of one prepared split, by index.

    Args:
        version_dir: the prepared folder (`prepare`, `ensure_prepared`).
        split: "train" or "validation".
    """

    def __init__(self, version_dir, split):
        with np.load(_index_path(version_dir, split)) as index:
            self._files, self._offsets, self._lengths = (
                index["files"], index["offsets"], index["lengths"])
            self._paths = [os.path.join(version_dir, str(name)) for name in index["names"]]
        self.num_examples = len(self._offsets)
        self._files_open = {}  # closed with this object
        # tf.data calls `read` from several threads at once (a parallel map).
        # Unguarded, two first reads of a file both open it, and the file
        # object the second replaces is closed under the first one's pread.
        self._opening = threading.Lock()

    def read(self, ids):
        """The records of example indices `ids` (a numpy array) as an object
        array of bytes; safe to call from several threads at once."""
        records = np.empty(len(ids), dtype=object)
        for row, example in enumerate(ids):
            records[row] = os.pread(self._file(int(self._files[example])).fileno(),
                                    int(self._lengths[example]), int(self._offsets[example]))
        return records

    def _file(self, number):
        opened = self._files_open.get(number)
        if opened is None:
            with self._opening:
                opened = self._files_open.get(number)
                if opened is None:
                    opened = self._files_open[number] = open(self._paths[number], "rb")
        return opened
