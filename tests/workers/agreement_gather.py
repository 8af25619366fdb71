"""`tfscale.agreement.gather` of arrays of each dtype and shape it takes,
and of one it refuses: reports what each worker got back. Worker i
contributes values made from i, so the test can tell whose row landed
where."""

import numpy as np

import tfscale
from report import report
from tfscale import agreement


def main():
    strategy = tfscale.Strategy()
    index = strategy.worker_index
    arrays = {
        "float32": np.array([index + 0.5], np.float32),
        "float64": np.array([index / 3, -index], np.float64),
        "int32": np.arange(3, dtype=np.int32) + 10 * index,
        "int64": np.array([2**40 + index], np.int64),
        "matrix": np.full((2, 3), index, np.float32),
    }
    try:
        agreement.gather(strategy, np.array([index], np.uint8))
    except ValueError as error:
        refused = str(error)
    report({"worker_index": index, "refused": refused,
            "gathered": {name: {"dtype": str(g.dtype), "shape": list(g.shape),
                                "values": g.tolist()}
                         for name, g in ((name, agreement.gather(strategy, a))
                                         for name, a in arrays.items())}})


if __name__ == "__main__":
    main()
