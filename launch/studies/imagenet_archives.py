"""ImageNet archives in the real ILSVRC2012 layout, of generated images.

For the tests (tiny images, seconds to prepare) and for the input-pipeline
study (`launch.studies.imagenet_input`: ImageNet-sized JPEGs).

What tensorflow-datasets' `imagenet2012` builder reads from its manual_dir
(tensorflow_datasets/datasets/imagenet2012/imagenet2012_dataset_builder.py,
`_split_generators`):

- `ILSVRC2012_img_train.tar`: one member per synset, `nXXXXXXXX.tar`, each a
  tar of `nXXXXXXXX_<i>.JPEG` (the label is the inner tar's name);
- `ILSVRC2012_img_val.tar`: flat `ILSVRC2012_val_%08d.JPEG`, labelled by
  tensorflow-datasets' own `validation_labels.txt`, line i for the i-th name
  in sorted order: so the tar holds the first K names, as files at its root.

The synsets are the labels of those first K validation images, so every
validation class has training images too.
"""

import io
import os
import tarfile

import numpy as np
from PIL import Image


def _jpeg(rng, width, height, noise=0):
    """A smooth random colour field (plus Gaussian noise of std `noise`, which
    brings a 500x375 JPEG to about ImageNet's 110 KB), quality 90."""
    pixels = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
    image = Image.fromarray(pixels).resize((width, height), Image.BILINEAR)
    if noise:
        noisy = np.asarray(image, np.float32) + rng.normal(0, noise, (height, width, 3))
        image = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def validation_labels(count):
    """The synsets of the first `count` validation images (tfds's file)."""
    import tensorflow_datasets as tfds

    path = os.path.join(os.path.dirname(tfds.__file__), "datasets", "imagenet2012",
                        "validation_labels.txt")
    with open(path) as f:
        return f.read().split()[:count]


def write(manual_dir, num_validation=12, train_per_synset=6, seed=0,
          full_size=False):
    """Writes both archives into `manual_dir`; returns the synsets.

    Images are small (40-71 pixels a side), or with `full_size` ImageNet's
    most common 500x375 and 375x500, with noise: about 90 KB each.
    """
    os.makedirs(manual_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    synsets = sorted(set(validation_labels(num_validation)))
    noise = 16 if full_size else 0

    def size():  # of varied shapes, as ImageNet's vary
        if full_size:
            return (500, 375) if rng.random() < 0.75 else (375, 500)
        return int(rng.integers(40, 72)), int(rng.integers(40, 72))

    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_train.tar"), "w") as outer:
        for synset in synsets:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for i in range(train_per_synset):
                    _add(tar, f"{synset}_{i + 1}.JPEG", _jpeg(rng, *size(), noise))
            _add(outer, f"{synset}.tar", inner.getvalue())
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_val.tar"), "w") as tar:
        for i in range(1, num_validation + 1):
            _add(tar, f"ILSVRC2012_val_{i:08d}.JPEG", _jpeg(rng, *size(), noise))
    return synsets
