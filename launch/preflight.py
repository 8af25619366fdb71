"""Checks run before a worker starts anything: bad input fails here, clearly.

Nothing is created or written by these checks.
"""

import json
import os


class PreflightError(ValueError):
    """Input that would make the job fail or hang later."""


def check_tf_config(environ=os.environ):
    """Validates TF_CONFIG, if set, as TensorFlow's resolver will read it."""
    raw = environ.get("TF_CONFIG")
    if not raw:
        return
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as error:
        raise PreflightError(
            f"TF_CONFIG is not valid JSON ({error}). Received: TF_CONFIG={raw!r}"
        ) from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not cluster:
        raise PreflightError(
            'TF_CONFIG needs a "cluster" object, e.g. {"cluster": {"worker": '
            '["host0:2222", "host1:2222"]}, "task": {"type": "worker", '
            f'"index": 0}}}}. Received: TF_CONFIG={raw!r}'
        )
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not all(
            isinstance(a, str) and ":" in a for a in addresses
        ):
            raise PreflightError(
                f'TF_CONFIG cluster "{job}" must be a list of "host:port" '
                f"strings. Received: TF_CONFIG={raw!r}"
            )
    if not isinstance(task, dict) or task.get("type") not in cluster:
        raise PreflightError(
            f'TF_CONFIG "task" must name a job of the cluster '
            f"({', '.join(cluster)}) as its \"type\". Received: TF_CONFIG={raw!r}"
        )
    index = task.get("index")
    size = len(cluster[task["type"]])
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < size:
        raise PreflightError(
            f'TF_CONFIG task index must be an integer in [0, {size}) for the '
            f'{size} "{task["type"]}" addresses. Received: index={index!r}'
        )


def tf_config_task_type(environ=os.environ):
    """TF_CONFIG's task type ("chief", "worker", "evaluator", ...), as
    TensorFlow's resolver reads it; None without TF_CONFIG. Check it first
    (`check_tf_config`)."""
    raw = environ.get("TF_CONFIG")
    return json.loads(raw)["task"]["type"] if raw else None


def check_writable_dir(flag, path):
    """Refuses a directory flag that could not be created or written to."""
    if not path:
        return
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise PreflightError(
            f"--{flag} must be a directory; {path} is a file. Received: {flag}={path}"
        )
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(
            f"--{flag} cannot be written: {existing} is not a writable directory. "
            f"Received: {flag}={path}"
        )
