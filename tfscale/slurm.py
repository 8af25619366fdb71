r"""The cluster of a SLURM job step that runs one tfscale worker per task.

    # srun --ntasks-per-node=4 --gpus-per-task=1 python train.py
    strategy = tfscale.Strategy(cluster_resolver=tfscale.slurm.ClusterResolver())

TensorFlow's `tf.distribute.cluster_resolver.SlurmClusterResolver` reads
SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and
SLURM_STEP_TASKS_PER_NODE; task I of the step is worker I, at
`host:port_base + its place on its host`. Left to its defaults it does not fit
one task per GPU: it takes the node's GPU count from CUDA_VISIBLE_DEVICES (or
`nvidia-smi`), divides it among the tasks of the node and overwrites
CUDA_VISIBLE_DEVICES. Under `srun --gpus-per-task=1` SLURM has already bound
one GPU to each task, so the count is 1 and 1 GPU // 4 tasks gives each
task 0 GPUs, which TensorFlow's resolver cannot handle (`range()` with a step
of 0). On a machine without GPUs and without `nvidia-smi` it fails as well.

`ClusterResolver` keeps the GPUs SLURM gave the task (it sets nothing) and
reports as the task's accelerators the GPUs this process sees: one under
`--gpus-per-task=1`, none on CPUs. A task that sees several GPUs is refused
by `tfscale.Strategy` (one process per GPU): bind them with
`--gpus-per-task=1` (or set CUDA_VISIBLE_DEVICES per task).
"""

import os

import tensorflow as tf

DEFAULT_PORT_BASE = 8888  # TensorFlow's SlurmClusterResolver's


class ClusterResolver(tf.distribute.cluster_resolver.SlurmClusterResolver):
    """TensorFlow's `SlurmClusterResolver` for one worker per SLURM task.

    Args:
        port_base: the port of each host's first task; the host's other
            tasks listen on the ports after it. None: `DEFAULT_PORT_BASE`.
        num_gpus: GPUs this task uses; default: those TensorFlow sees in this
            process (CUDA_VISIBLE_DEVICES, as SLURM set it, applies).

    Raises:
        RuntimeError: the SLURM environment is missing or inconsistent
            (TensorFlow's message names the variable).
    """

    def __init__(self, port_base=None, num_gpus=None):
        if port_base is None:
            port_base = DEFAULT_PORT_BASE
        if num_gpus is None:
            num_gpus = len(tf.config.list_physical_devices("GPU"))
        self._tfscale_num_gpus = num_gpus
        # TensorFlow's arithmetic needs >= 1 GPU per task and enough per node
        # for all of a node's tasks; it only numbers them here, since
        # auto_set_gpu=False leaves CUDA_VISIBLE_DEVICES as SLURM set it.
        # (Outside a SLURM step, TensorFlow names the missing variable.)
        num_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
        super().__init__(port_base=port_base, gpus_per_task=1,
                         gpus_per_node=num_tasks, auto_set_gpu=False)
        self.cluster_spec()  # sets task_type and task_id

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """`{"GPU": n}` for the n GPUs this task uses; `{}` on CPUs."""
        del task_type, task_id, config_proto
        return {"GPU": self._tfscale_num_gpus} if self._tfscale_num_gpus else {}
