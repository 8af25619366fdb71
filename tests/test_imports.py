"""The import graph of tfscale/, read from the source: no circle anywhere,
and the private layer (tfscale/_private/) at the bottom, importing nothing of
tfscale but itself."""

import ast
import json
import os
import subprocess
import sys

import pytest

from multiworker import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "tfscale")


def modules():
    """{module name: path} of every module and package of tfscale."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path, known):
    """The tfscale modules `path` imports: `from P import x` is P.x where that
    is a module, else P (a name its `__init__` defines)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfscale"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
    return found & set(known)


def graph():
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def circles(edges):
    """Every circle of `edges`, each once, as a list of modules."""
    found, seen = [], set()

    def walk(start, node, path):
        for following in sorted(edges[node]):
            if following == start and frozenset(path) not in seen:
                seen.add(frozenset(path))
                found.append(path + [start])
            elif following not in path and following > start:
                walk(start, following, path + [following])

    for start in sorted(edges):
        walk(start, start, [start])
    return found


def test_the_checker_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c", "a"]]


def test_no_import_circle_in_tfscale():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_private_layer_imports_nothing_of_tfscale():
    outside = {name: sorted(d for d in deps if not d.startswith("tfscale._private"))
               for name, deps in graph().items() if name.startswith("tfscale._private")}
    assert not any(outside.values()), outside


def imported_names(folder):
    """{path: every module name an import statement of it names} for the
    .py files under REPO_ROOT/`folder`."""
    found = {}
    for root, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            names = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            found[os.path.relpath(path, REPO_ROOT)] = names
    return found


def test_the_layers_import_only_downward():
    """tfscale never imports launch (tfscale.launch); models (tfscale.models)
    imports nothing of tfscale but itself (DESIGN.md, Layers)."""
    upward = {path: sorted(n for n in names if n.startswith("tfscale.launch"))
              for path, names in imported_names("tfscale").items()}
    assert not any(upward.values()), upward
    outside = {path: sorted(n for n in names if n.startswith("tfscale")
                            and not n.startswith("tfscale.models") and n != "tfscale")
               for path, names in imported_names("models").items()}
    assert not any(outside.values()), outside
    assert not any("tfscale" in names for names in imported_names("models").values())


@pytest.mark.multiworker
def test_tfscale_launch_imports_neither_tensorflow_nor_keras():
    """tfscale-launch only starts and watches workers: `import tfscale` is
    lazy, so it stays a small process that starts at once."""
    probe = ("import sys, tfscale.launch.local; "
             "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout


# Runs an entry point's `run()`: the module is sys.argv[1], the program's
# name sys.argv[2], its arguments after. The last two lines of stderr say
# which of TensorFlow and Keras it loaded, then its exit code.
_ENTRY_PROBE = """
import importlib, sys
module, sys.argv = sys.argv[1], sys.argv[2:]
try:
    importlib.import_module(module).run()
except SystemExit as stop:
    code = stop.code
else:
    code = 0
print(sorted(m for m in ("tensorflow", "keras") if m in sys.modules), file=sys.stderr)
print(code, file=sys.stderr)
"""


def run_entry(module, program, args, env=None):
    """`(done, loaded, code)`: the finished process of `program args`, the
    modules of TensorFlow and Keras it loaded, and its exit code, as text."""
    done = subprocess.run([sys.executable, "-c", _ENTRY_PROBE, module, program, *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    *_, loaded, code = done.stderr.strip().splitlines()
    return done, loaded, code


# Each subcommand's --help: its description and one of its own flags.
_HELP = {"allreduce": "--sizes", "train": "--per_worker_batch", "project": "--measurements",
         "gpucheck": "--ring_only", "scale": "--worker_counts", "fixedcost": "--warmup"}


@pytest.mark.multiworker
@pytest.mark.parametrize("args, code, messages", [
    # absl's --help exits with 1.
    *[([name, "--help"], 1, [f"tfscale-bench {name}", flag]) for name, flag in _HELP.items()],
    (["allreduce", "--algorithms=stock,ringg"], 1,
     ["tfscale-bench allreduce: --algorithms: 'ringg' is unknown; choose from stock, "
      "ring, hierarchical, 2d, halving_doubling, hybrid, auto."]),
    (["train", "--compression=powersgdd"], 1,
     ["--compression values must be none or one of bfloat16, float16, powersgd."]),
    (["scale", "--algorithms=default,ringg"], 1,
     ["tfscale-bench scale: --algorithms: 'ringg' is unknown; choose from default, "
      "ring, hierarchical, 2d, halving_doubling, hybrid, auto."]),
])
def test_tfscale_bench_answers_help_and_bad_names_without_tensorflow(args, code, messages):
    """tfscale-bench's own process, which only starts and watches workers,
    lists a subcommand's flags and refuses an unknown algorithm or
    compression without importing TensorFlow or Keras
    (tfscale.communication_names): at once, where importing TensorFlow takes
    seconds."""
    done, loaded, exit_code = run_entry("tfscale.launch.bench", "tfscale-bench", args)
    assert (loaded, exit_code) == ("[]", str(code)), done.stderr[-3000:]
    for message in messages:
        assert message in done.stdout + done.stderr, done.stdout[-3000:]


_EVALUATOR = json.dumps({"cluster": {"worker": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]},
                         "task": {"type": "evaluator", "index": 0}})


@pytest.mark.multiworker
@pytest.mark.parametrize("args, tf_config, said", [
    (["--help"], None, "--global_batch_size"),
    (["--model=vgg"], None, "tfscale-train: --model='vgg' is unknown. Known: alexnet_bn, "
                            "alexnet_bn_small, resnet50"),
    (["--dataset=cifar"], None, "--dataset='cifar' is unknown. Known: digits, fashion_mnist, imagenet, "
                               "synthetic"),
    (["--batch_schedule=30"], None, "must be comma-separated epoch:factor"),  # Settings' own check
    ([], "{not json", "tfscale-train: TF_CONFIG is not valid JSON"),
    ([], _EVALUATOR, "tfscale-train: The evaluator needs --model_dir"),
])
def test_tfscale_train_answers_help_and_refuses_bad_flags_without_tensorflow(
        args, tf_config, said):
    """tfscale-train lists its flags and refuses bad flags and a bad
    TF_CONFIG before it imports TensorFlow or Keras: a worker's mistake is
    said at once, not after seconds of imports."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    if tf_config:
        env["TF_CONFIG"] = tf_config
    done, loaded, code = run_entry("tfscale.launch.train", "tfscale-train", args, env)
    assert loaded == "[]", done.stderr[-3000:]
    if args == ["--help"]:  # absl's --help lists the flags, then exits with 1
        assert code == "1" and said in done.stdout, done.stdout[-3000:]
    else:  # main's one line, as sys.exit's message (exit status 1)
        assert code.startswith("tfscale-train: ") and said in code, done.stderr[-3000:]


@pytest.mark.multiworker
@pytest.mark.parametrize("args, said", [
    (["--rows=sgd@128,adam@1024"],
     "--rows must name rows of the study: sgd@128, sgd@1024"),
    (["--epochs=2"], "--growth's event at epoch 4 is not before the end of "
                     "training (--epochs=2)."),
    (["--growth=4:2"], "--growth must grow batch 1024 to the largest of "
                       "--batches (16384); it reaches 2048."),
    (["--lars_learning_rates=10,-1"],
     "--lars_learning_rates must be numbers > 0. Received: ['10', '-1']"),
    (["--warmup_epochs=8"], "--warmup_epochs must be shorter than --epochs"),
    (["--rows=lars@8192", "--train_examples=8000"],
     "--train_examples=8000 holds no whole batch of lars@8192"),
    # Batch growth reaches 16384: its first batch, 1024, is not enough.
    (["--rows=batch_growth@16384", "--train_examples=8192"],
     "--train_examples=8192 holds no whole batch of batch_growth@16384"),
])
def test_the_large_batch_study_refuses_bad_flags_without_tensorflow(args, said):
    """python -m tfscale.launch.studies.large_batch checks its flags, the
    settings of each row included, before it imports TensorFlow, and
    trains nothing."""
    done, loaded, code = run_entry("tfscale.launch.studies.large_batch.__main__",
                                   "large_batch", args)
    assert (loaded, code) == ("[]", "1"), done.stderr[-3000:]
    assert said in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
