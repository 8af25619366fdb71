"""Each worker's share of this machine's cores, as its intra-op threads.

TensorFlow gives every process an intra-op pool of one thread per core it
may run on (tensorflow/core/common_runtime/process_util.cc, unless
TF_NUM_INTRAOP_THREADS says otherwise), so N workers on one machine run N
threads per core. torchrun sets OMP_NUM_THREADS=1 when it starts several
processes per node "to avoid your system being overloaded"
(torch/distributed/run.py); tfscale-launch gives each worker
`cores // workers` threads, at least one, unless the launcher's environment
sets TF_NUM_INTRAOP_THREADS. A synchronous step waits for the slowest worker,
which oversubscribed cores slow down; with the share, steps are shorter than
with TensorFlow's default pools (to compare: `tfscale-bench train` with and
without TF_NUM_INTRAOP_THREADS set to the number of cores).
"""

import os

VARIABLE = "TF_NUM_INTRAOP_THREADS"


def usable_cores():
    """The cores this process may run on (its CPU affinity, as TensorFlow
    counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_environment(num_workers, environ=os.environ):
    """`{TF_NUM_INTRAOP_THREADS: share}` for each of `num_workers` workers
    on this machine; `{}` when `environ` sets it (the user's choice) or for
    one worker (TensorFlow's default is then the whole machine already)."""
    if VARIABLE in environ or num_workers <= 1:
        return {}
    return {VARIABLE: str(max(1, usable_cores() // num_workers))}


def describe(num_workers, environ=os.environ):
    """The launcher's one line about it, or None when the user set it."""
    share = worker_environment(num_workers, environ)
    if not share:
        return None
    return (f"tfscale-launch: each worker gets {VARIABLE}={share[VARIABLE]} "
            f"({usable_cores()} cores for {num_workers} workers; set "
            f"{VARIABLE} to choose).")
