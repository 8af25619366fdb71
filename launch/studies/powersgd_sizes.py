"""Bytes on the wire per step of ResNet-50's and AlexNet-BN's gradients under PowerSGD.

    python -m tfscale.launch.studies.powersgd_sizes

For each model (published sizes, 1000 classes) and ranks 1, 2 and 4, the
total line of `tfscale.collectives.powersgd.describe`
(float32 gradients against what PowerSGD sends: the P and Q factors of each
compressed matrix, every other tensor as it is), and at rank 4 how the
compressed matrices and the tensors left uncompressed contribute. One
process, nothing trained: the sizes follow from the shapes.
"""

from tfscale import models
from tfscale.collectives import powersgd

RANKS = (1, 2, 4)


def main():
    for name in ("resnet50", "alexnet_bn"):
        variables = models.get(name, num_classes=1000).trainable_variables
        shapes = [v.shape for v in variables]
        dtypes = [v.dtype for v in variables]
        for rank in RANKS:
            matrices = powersgd.plan(shapes, dtypes, rank)
            text = powersgd.describe(matrices, shapes, dtypes, [v.path for v in variables])
            print(f"{name} rank {rank}: {text.splitlines()[-1]}")
        matrices = powersgd.plan(shapes, dtypes, 4)
        compressed = {m.index for m in matrices}
        left = [s.num_elements() * 4 for i, s in enumerate(shapes) if i not in compressed]
        print(f"{name} rank 4: {len(matrices)} of {len(shapes)} tensors compressed, "
              f"{sum(m.size_bytes for m in matrices):,} bytes -> "
              f"{sum(m.compressed_bytes for m in matrices):,}; {len(left)} tensors "
              f"uncompressed, {sum(left):,} bytes")


if __name__ == "__main__":
    main()
