"""Compares the weights two runs of the study kept (`--weights_dir`): the
same run on 1 worker and on N workers, say.

    python -m tfscale.launch.studies.large_batch.compare DIR_A DIR_B

Prints, per run found in both, the largest absolute difference of any
weight and the largest relative to that weight's tensor's largest value.
"""

import glob
import os
import sys

import numpy as np


def differences(path_a, path_b):
    """(largest absolute, largest relative) difference of two .npz files."""
    a, b = np.load(path_a), np.load(path_b)
    if sorted(a.files) != sorted(b.files):
        raise ValueError(f"{path_a} and {path_b} hold different weights.")
    absolute = relative = 0.0
    for name in a.files:
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        if x.shape != y.shape:
            raise ValueError(f"{name}: shapes {x.shape} and {y.shape} differ.")
        gap = float(np.max(np.abs(x - y))) if x.size else 0.0
        absolute = max(absolute, gap)
        scale = float(np.max(np.abs(x))) if x.size else 0.0
        relative = max(relative, gap / scale if scale else gap)
    return absolute, relative


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    dir_a, dir_b = argv[1:]
    names = sorted(set(map(os.path.basename, glob.glob(os.path.join(dir_a, "*.npz"))))
                   & set(map(os.path.basename, glob.glob(os.path.join(dir_b, "*.npz")))))
    if not names:
        print(f"No run's weights are in both {dir_a} and {dir_b}.", file=sys.stderr)
        return 1
    for name in names:
        absolute, relative = differences(os.path.join(dir_a, name),
                                         os.path.join(dir_b, name))
        print(f"{name[:-4]}: largest difference {absolute:.3g} absolute, "
              f"{relative:.3g} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
