"""Fashion-MNIST's four IDX files: where they are, and their arrays.

Fashion-MNIST (Xiao, Rasul and Vollgraf 2017, arXiv 1708.07747; Zalando,
MIT licence): 60,000 training and 10,000 test images, 28x28 grey, 10
classes. The same four `.gz` files are found, in this order:

1. the directory the user gives (`data_dir`);
2. Keras's cache, where `keras.datasets.fashion_mnist.load_data()` downloads
   them: `$KERAS_HOME/datasets/fashion-mnist/`, by default
   `~/.keras/datasets/fashion-mnist/`;
3. Debian's `dataset-fashion-mnist` package: `/usr/share/datasets/fashion-mnist/`.

No TensorFlow here: `find` is a check of files alone, which tfscale-train
runs with its flags, before it builds a model.
"""

import functools
import gzip
import os

import numpy as np

FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
HOW_TO_GET = (
    "Fashion-MNIST's files were not found. Install them with `apt-get install "
    "dataset-fashion-mnist` (Debian/Ubuntu), or download them with `python -c "
    "\"import keras; keras.datasets.fashion_mnist.load_data()\"`, or pass the "
    "directory that holds the four .gz files as --data_dir (data_dir=)."
)
# IDX magic numbers (http://yann.lecun.com/exdb/mnist/, "file formats"):
# unsigned bytes with 3 dimensions (images) or 1 (labels).
_IMAGES_MAGIC = 0x00000803
_LABELS_MAGIC = 0x00000801


def keras_cache_dir():
    """Where Keras's `fashion_mnist.load_data()` keeps the files."""
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    return os.path.join(keras_home, "datasets", "fashion-mnist")


def search_dirs(data_dir=None):
    """The directories looked in, in order."""
    return [d for d in (data_dir, keras_cache_dir(), DEBIAN_DIR) if d]


def find(data_dir=None):
    """The first directory that holds all four files.

    Raises:
        FileNotFoundError: one line saying how to get them, and where they
            were looked for. A `data_dir` given but incomplete is an error
            of its own: the user meant those files.
    """
    names = [name for pair in FILES.values() for name in pair]

    def missing(directory):
        return [n for n in names if not os.path.isfile(os.path.join(directory, n))]

    if data_dir:
        absent = missing(data_dir)
        if absent:
            raise FileNotFoundError(
                f"data_dir={data_dir!r} lacks Fashion-MNIST's "
                f"{', '.join(absent)}. {HOW_TO_GET}")
        return data_dir
    for directory in search_dirs():
        if not missing(directory):
            return directory
    raise FileNotFoundError(
        f"{HOW_TO_GET} Looked in: {', '.join(search_dirs())}.")


def arrays(split, data_dir=None):
    """(uint8 images [N, 28, 28, 1], int64 labels) of "train" or "test"."""
    if split not in FILES:
        raise ValueError("Fashion-MNIST `split` must be 'train' or 'test'. "
                         f"Received: split={split!r}")
    directory = find(data_dir)
    images_file, labels_file = (os.path.join(directory, n) for n in FILES[split])
    return _read(images_file, labels_file)


@functools.lru_cache(maxsize=4)
def _read(images_file, labels_file):
    images = _read_idx(images_file, _IMAGES_MAGIC)
    labels = _read_idx(labels_file, _LABELS_MAGIC).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"{images_file} holds {len(images)} images but "
                         f"{labels_file} {len(labels)} labels.")
    images.setflags(write=False)  # cached: shared by every caller
    labels.setflags(write=False)
    return images[..., None], labels


def _read_idx(path, magic):
    """The array of an IDX file: a big-endian magic number, one big-endian
    int32 per dimension, then unsigned bytes."""
    with gzip.open(path, "rb") as f:
        content = f.read()
    found = int.from_bytes(content[:4], "big")
    if found != magic:
        raise ValueError(f"{path} is not an IDX file of {magic & 0xff} "
                         f"dimension(s) of unsigned bytes (magic {found:#010x}).")
    rank = magic & 0xff
    shape = [int.from_bytes(content[4 + 4 * i:8 + 4 * i], "big")
             for i in range(rank)]
    return np.frombuffer(content, np.uint8, offset=4 + 4 * rank).reshape(shape)
