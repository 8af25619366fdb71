"""Collective algorithms over TensorFlow's own collective ops.

Pure tensor functions, and the plan that ties them together for
`tfscale.Strategy`:

- `topology`: which workers share a node; the sub-groups that follow.
- `fusion`: bucketing in backward order, pack/unpack.
- `compression`: 16-bit wire formats for float32 buffers.
- `implementation`: NCCL on GPUs or TensorFlow's ring, and what NCCL changes.
- `algorithms`: ring, hierarchical, 2d and halving-doubling all-reduce of
  one buffer.
- `cost_model`: alpha-beta predictions, the hybrid threshold, chunk counts.
- `plan`: per fused bucket, the algorithm and its chunking.
- `autotune`: algorithm="auto", each bucket's algorithm chosen by measuring it.
- `powersgd`: gradient matrices as low-rank factors, with error feedback.
- `all_reduce`: `AllReduce` carries a plan out on this worker's groups.
- `watchdog`: the collective timeout, kept by one thread per worker.
- `flight_recorder`: this worker's last collectives, to say where a job broke.
"""

from tfscale.collectives import algorithms
from tfscale.collectives import autotune
from tfscale.collectives import compression
from tfscale.collectives import cost_model
from tfscale.collectives import flight_recorder
from tfscale.collectives import fusion
from tfscale.collectives import implementation
from tfscale.collectives import powersgd
from tfscale.collectives import timeline_stamps
from tfscale.collectives import topology
from tfscale.collectives import watchdog
from tfscale.collectives.algorithms import Groups
from tfscale.collectives.all_reduce import AllReduce
from tfscale.collectives.all_reduce import fused_all_reduce
from tfscale.collectives.all_reduce import make_groups
from tfscale.collectives.all_reduce import timed_all_reduce
from tfscale.collectives.plan import ALGORITHMS
from tfscale.collectives.plan import FIXED_ALGORITHMS
from tfscale.collectives.plan import COMPRESSIONS
from tfscale.collectives.plan import MAX_2D_LOCAL_SIZE
from tfscale.collectives.plan import Bucket
from tfscale.collectives.plan import check_supported
from tfscale.collectives.plan import describe_plan
from tfscale.collectives.plan import hybrid_threshold
from tfscale.collectives.plan import plan
