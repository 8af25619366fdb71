"""All-reduce algorithms: pure functions of a 1-D buffer and collective groups.

Each function takes this worker's part and returns the element-wise sum over
all workers. The docstring of each states the topology it assumes.
"""


def ring_all_reduce(buffer, world):
    """Flat ring all-reduce over every worker.

    Topology: none assumed; one ring through all workers in `world` (TF's
    collective executor on CPU runs a ring: 2(n-1) steps, each moving 1/n of
    the buffer). Bandwidth-optimal, but its 2(n-1) latency steps dominate for
    small buffers on many workers.
    """
    return world.all_reduce(buffer)
