"""The names `tfscale.CommunicationOptions` takes, without TensorFlow.

The modules of `tfscale.collectives` that implement each name take them from
here. The launchers (tfscale-bench) list and check them in a process that
never imports TensorFlow, so `--help` and a mistyped name answer at once.
"""

# The all-reduce of one buffer (`collectives.algorithms.BUFFER_ALGORITHMS`,
# in this order).
BUFFER_ALGORITHMS = ("ring", "hierarchical", "2d", "halving_doubling")
# Per bucket, ring or hierarchical (`collectives.plan`).
HYBRID = "hybrid"
# Per bucket, chosen by measuring the job (`collectives.autotune`).
AUTO = "auto"
FIXED_ALGORITHMS = (*BUFFER_ALGORITHMS, HYBRID)
ALGORITHMS = (*FIXED_ALGORITHMS, AUTO)
# 16-bit wire formats of float32 buffers (`collectives.compression`).
COMPRESSIONS = ("bfloat16", "float16")
# Low-rank gradient compression (`collectives.powersgd`).
POWERSGD = "powersgd"
# Who carries the collectives out (`collectives.implementation`).
IMPLEMENTATIONS = ("auto", "ring", "nccl")
