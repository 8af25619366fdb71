"""deploy/: the Dockerfile, the Kubeflow TFJob manifest and the SLURM script.

Each file is parsed; the environment each of its tasks would get is derived as
the Kubeflow training operator and SLURM write it; and the file's own
tfscale-train command runs with that environment on 127.0.0.1 (CPU), scaled
down by the explicit substitutions in `TINY`, so the files cannot drift from
tfscale-train's flags. Nothing here has run on a GPU or on a real cluster.

TF_CONFIG of a TFJob task: kubeflow/training-operator,
pkg/controller.v1/tensorflow/tensorflow.go (`genTFConfigJSONStr`,
`genClusterSpec`, the last v1 version, before commit 7858371 removed it):
every replica type, the Evaluator included, is a job of the cluster
(lower-cased), task I of job J at `<tfjob>-<j>-<I>.<namespace>.svc:<port of
the container port named tfjob-port, default 2222>`, with "environment":
"cloud"; the task is {"type": j, "index": I}.

SLURM environment of a task: what TensorFlow's SlurmClusterResolver reads
(SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST,
SLURM_STEP_TASKS_PER_NODE; python/distribute/cluster_resolver/
slurm_cluster_resolver.py) plus the job-level variables srun also sets, and
CUDA_VISIBLE_DEVICES as --gpus-per-task=1 binds one GPU per task.
"""

import json
import os
import re
import shlex
import sys

import pytest
import yaml

import multiworker
from tfscale.launch import ports
from multiworker import REPO_ROOT
from multiworker import start_process
from multiworker import worker_env

DEPLOY = os.path.join(REPO_ROOT, "deploy")
TRAIN = [sys.executable, "-m", "tfscale.launch.train"]  # what `tfscale-train` runs
# The only changes to the files' commands, so that they run in seconds on CPU:
# digits instead of ImageNet, a small AlexNet-BN instead of ResNet-50, a
# global batch the 2 workers share, 6 one-step epochs (the recipe warms up
# over 5), float32 (mixed_float16 is for GPUs; on CPU, 6 steps leave the model
# so undecided that the export check of digits finds float16 near-ties
# classified differently), and the shared storage in a temporary directory.
# None: dropped.
TINY = {
    "--model": "alexnet_bn",
    "--fc_units": "16",
    "--dataset": "digits",
    "--data_dir": None,
    "--manual_dir": None,
    "--global_batch_size": "32",
    "--epochs": "6",
    "--steps_per_epoch": "1",
    "--checkpoint_steps": "3",
    "--precision": "float32",
}
FINAL_STEP = 6


def read(name):
    with open(os.path.join(DEPLOY, name)) as f:
        return f.read()


def flag_args(args):
    """{"--name": value or None} of `args` ("--name=value" or "--name")."""
    parsed = {}
    for arg in args:
        assert arg.startswith("--"), f"not a flag: {arg!r}"
        name, _, value = arg.partition("=")
        parsed[name] = value if "=" in arg else None
    return parsed


def tiny(args, shared, extra=()):
    """`args` with `TINY` substituted and /shared moved to `shared`."""
    result = []
    for arg in args:
        name = arg.partition("=")[0]
        if name in TINY:
            continue
        result.append(arg.replace("=/shared/", f"={shared}/"))
    result += [f"{name}={value}" for name, value in TINY.items() if value is not None]
    return result + list(extra)


# --- Dockerfile ---------------------------------------------------------------

def dockerfile_instructions():
    """[(INSTRUCTION, arguments)] with continuation lines joined."""
    text = re.sub(r"\\\n", " ", read("Dockerfile"))
    lines = [l.strip() for l in text.splitlines()]
    return [tuple(l.split(None, 1)) for l in lines if l and not l.startswith("#")]


def test_dockerfile_installs_tfscale_with_the_gpu_build_in_one_pip_install():
    steps = dockerfile_instructions()
    runs = " && ".join(args for op, args in steps if op == "RUN")
    commands = [" ".join(c.split()) for c in runs.split("&&")]
    pips = [c for c in commands if c.startswith("pip ")]
    assert pips == ['pip install --no-cache-dir ".[gpu]"'], pips
    with open(os.path.join(REPO_ROOT, "setup.py")) as f:
        assert '"gpu": [f"tensorflow[and-cuda]{_TENSORFLOW}"]' in f.read()
    # What the image copies exists, and is all `pip install .` needs.
    for op, args in steps:
        if op == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert os.path.exists(os.path.join(REPO_ROOT, source)), source
    copied = {s for op, a in steps if op == "COPY" for s in a.split()[:-1]}
    assert {"setup.py", "README.md", "tfscale", "models", "launch"} <= copied
    entrypoint = json.loads(dict(steps)["ENTRYPOINT"])
    assert entrypoint == ["tfscale-train"]
    with open(os.path.join(REPO_ROOT, "setup.py")) as f:
        assert '"tfscale-train=tfscale.launch.train:run"' in f.read()


# --- Kubeflow TFJob -----------------------------------------------------------

def tfjob_documents():
    docs = list(yaml.safe_load_all(read("tfjob.yaml")))
    return {doc["kind"]: doc for doc in docs}


def tfjob_port(replica_spec):
    """The port TF_CONFIG names: the container port named tfjob-port."""
    container = replica_spec["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return ports.get("tfjob-port", 2222)


def tfjob_tf_configs(tfjob, replicas=None, address=None):
    """{(type, index): TF_CONFIG} as the training operator writes them.

    `replicas`: {replica type: count} overriding the manifest's; `address`:
    `(type, index, port) -> "host:port"`, default the replica's service.
    """
    name = tfjob["metadata"]["name"]
    namespace = tfjob["metadata"].get("namespace", "default")
    specs = tfjob["spec"]["tfReplicaSpecs"]
    cluster = {}
    for rtype, spec in specs.items():
        job = rtype.lower()
        count = (replicas or {}).get(rtype, spec.get("replicas", 1))
        port = tfjob_port(spec)
        cluster[job] = [
            address(job, i, port) if address else
            f"{name}-{job}-{i}.{namespace}.svc:{port}" for i in range(count)]
    return {(job, i): json.dumps({"cluster": cluster,
                                  "task": {"type": job, "index": i},
                                  "environment": "cloud"})
            for job, addresses in cluster.items() for i in range(len(addresses))}


def containers(tfjob):
    return {rtype: spec["template"]["spec"]["containers"][0]
            for rtype, spec in tfjob["spec"]["tfReplicaSpecs"].items()}


def test_tfjob_runs_one_gpu_per_task_and_the_same_command_in_every_replica():
    docs = tfjob_documents()
    tfjob = docs["TFJob"]
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert sorted(specs) == ["Chief", "Evaluator", "Worker"]
    assert specs["Chief"]["replicas"] == specs["Evaluator"]["replicas"] == 1
    assert specs["Worker"]["replicas"] >= 1
    commands = set()
    for rtype, container in containers(tfjob).items():
        assert container["name"] == "tensorflow"  # the operator's container
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}, rtype
        assert specs[rtype]["restartPolicy"] == "OnFailure"
        commands.add(json.dumps([container["command"], container["args"]]))
    assert len(commands) == 1, commands
    command, args = json.loads(commands.pop())
    assert command == ["tfscale-train"]
    # 256 examples per GPU of the chief and workers.
    workers = specs["Chief"]["replicas"] + specs["Worker"]["replicas"]
    assert int(flag_args(args)["--global_batch_size"]) == 256 * workers


def test_tfjob_keeps_model_and_export_dirs_on_the_shared_claim():
    docs = tfjob_documents()
    claim = docs["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on many nodes
    for rtype, spec in docs["TFJob"]["spec"]["tfReplicaSpecs"].items():
        pod = spec["template"]["spec"]
        volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                   for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]]
                  for m in pod["containers"][0]["volumeMounts"]}
        args = flag_args(pod["containers"][0]["args"])
        for flag in ("--model_dir", "--export_dir", "--tensorboard_dir"):
            on = [path for path in mounts if args[flag].startswith(path + "/")]
            assert on and mounts[on[0]] == claim["metadata"]["name"], (rtype, flag)


def test_network_policy_admits_only_the_jobs_pods_to_the_workers_port():
    docs = tfjob_documents()
    tfjob, policy = docs["TFJob"], docs["NetworkPolicy"]
    # The training operator labels every pod of the job with its name.
    job_pods = {"training.kubeflow.org/job-name": tfjob["metadata"]["name"]}
    assert policy["spec"]["podSelector"] == {"matchLabels": job_pods}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": job_pods}}]
    ports = {tfjob_port(spec) for spec in tfjob["spec"]["tfReplicaSpecs"].values()}
    assert rule["ports"] == [{"protocol": "TCP", "port": port} for port in ports]


def test_tfjob_tf_config_names_chief_workers_and_evaluator():
    configs = tfjob_tf_configs(tfjob_documents()["TFJob"])
    assert json.loads(configs["worker", 2]) == {
        "cluster": {
            "chief": ["tfscale-resnet50-chief-0.default.svc:2222"],
            "worker": [f"tfscale-resnet50-worker-{i}.default.svc:2222"
                       for i in range(3)],
            "evaluator": ["tfscale-resnet50-evaluator-0.default.svc:2222"],
        },
        "task": {"type": "worker", "index": 2},
        "environment": "cloud",
    }
    assert len(configs) == 5


# --- SLURM --------------------------------------------------------------------

def slurm_script():
    """({#SBATCH option: value}, srun options, the command srun runs)."""
    text = read("slurm.sbatch")
    assert text.startswith("#!/bin/bash\n")
    sbatch = dict(re.findall(r"^#SBATCH (--[\w-]+)=(\S+)", text, re.MULTILINE))
    joined = re.sub(r"\\\n", " ", text)
    (srun,) = [l for l in joined.splitlines() if l.strip().startswith("srun ")]
    words = shlex.split(srun)[1:]
    options = {}
    while words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        options[name] = value
    return sbatch, options, words


def test_slurm_script_runs_one_task_per_gpu_with_the_slurm_resolver():
    sbatch, srun, command = slurm_script()
    assert sbatch["--gpus-per-task"] == srun["--gpus-per-task"] == "1"
    assert sbatch["--ntasks-per-node"] == srun["--ntasks-per-node"]
    assert sbatch["--cpus-per-task"] == srun["--cpus-per-task"]
    assert int(sbatch["--nodes"]) >= 1
    assert command[:2] == ["tfscale-train", "--cluster_resolver=slurm"]
    tasks = int(sbatch["--nodes"]) * int(sbatch["--ntasks-per-node"])
    assert int(flag_args(command[1:])["--global_batch_size"]) == 256 * tasks


def slurm_task_env(rank, ntasks, node, gpu):
    """What srun sets for task `rank` of `ntasks`, all on `node`."""
    return {
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NODELIST": node, "SLURM_STEP_NODELIST": node,
        "SLURM_JOB_NODELIST": node,
        "SLURM_TASKS_PER_NODE": str(ntasks), "SLURM_STEP_TASKS_PER_NODE": str(ntasks),
        "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1",
        "CUDA_VISIBLE_DEVICES": gpu,
    }


# --- Flags --------------------------------------------------------------------

def test_every_flag_the_files_use_is_a_tfscale_train_flag_with_a_valid_value():
    from absl import flags

    from tfscale import models
    from tfscale.launch import train_flags
    from tfscale import data

    train_flags.define_flags()
    tfjob_args = containers(tfjob_documents()["TFJob"])["Chief"]["args"]
    _, _, slurm_command = slurm_script()
    for args in (tfjob_args, slurm_command[1:]):
        for name, value in flag_args(args).items():
            flag = flags.FLAGS[name[2:]]  # KeyError: no such flag
            if value is None:
                assert flag.boolean, name
            else:
                flag.parser.parse(value)  # ValueError: not a valid value
        parsed = flag_args(args)
        assert parsed["--model"] in models.names()
        assert parsed["--dataset"] in data.names()
    for name in TINY:
        assert name[2:] in flags.FLAGS, name


# --- The commands, run -------------------------------------------------------

def wait_all(processes, tmp_path, timeout=300):
    outputs = {}
    try:
        for task, (process, log) in processes.items():
            code = process.wait(timeout=timeout)
            outputs[task] = (tmp_path / log).read_text()
            assert code == 0, f"{task} failed:\n{outputs[task][-4000:]}"
    finally:
        for process, _ in processes.values():
            process.kill()
    return outputs


@pytest.mark.multiworker
def test_tfjob_command_trains_on_chief_and_worker_and_the_evaluator_follows(tmp_path):
    tfjob = tfjob_documents()["TFJob"]
    args = tiny(containers(tfjob)["Chief"]["args"], tmp_path / "shared")
    picked = iter(ports.free_ports("127.0.0.1", 3))
    configs = tfjob_tf_configs(tfjob, replicas={"Worker": 1},
                               address=lambda job, i, port: f"127.0.0.1:{next(picked)}")
    assert sorted(configs) == [("chief", 0), ("evaluator", 0), ("worker", 0)]
    processes = {}
    for task in (("evaluator", 0), ("chief", 0), ("worker", 0)):  # evaluator waits
        log = f"{task[0]}-{task[1]}.log"
        processes[task] = (start_process(TRAIN + args, tmp_path, log, configs[task]),
                           log)
    outputs = wait_all(processes, tmp_path)
    assert "Training alexnet_bn on digits: 2 worker(s), global batch 32" in (
        outputs["chief", 0])
    assert os.path.isfile(tmp_path / "shared/resnet50/export/saved_model.pb")
    assert (f"Evaluation of the checkpoint of step {FINAL_STEP} of {FINAL_STEP}: "
            "accuracy=") in outputs["evaluator", 0], outputs["evaluator", 0][-3000:]


@pytest.mark.multiworker
def test_slurm_command_trains_on_two_tasks_of_one_node(tmp_path):
    _, _, command = slurm_script()
    assert command[0] == "tfscale-train"
    port = ports.free_ports("127.0.0.1", 2, consecutive=True)[0]
    # The one addition: ports that are free here instead of 8888, 8889.
    args = tiny(command[1:], tmp_path / "shared", [f"--slurm_port_base={port}"])
    processes = {}
    for rank in range(2):  # 1 node x 2 tasks instead of 2 x 4
        log = f"task-{rank}.log"
        slurm = slurm_task_env(rank, 2, "127.0.0.1", str(rank))
        with open(tmp_path / log, "w") as out:
            # SLURM's variables: read by the resolver, once training starts.
            process = multiworker.popen(TRAIN + args, tmp_path, worker_env(tmp_path, slurm),
                                        out, run_time=tuple(slurm))
        processes[rank] = (process, log)
    outputs = wait_all(processes, tmp_path)
    assert "Training alexnet_bn on digits: 2 worker(s), global batch 32" in outputs[0]
    assert os.path.isfile(tmp_path / "shared/resnet50-slurm/export/saved_model.pb")
