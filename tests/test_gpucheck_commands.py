"""The commands `tfscale-bench gpucheck` prints for a GPU machine
(`gpucheck.proving_commands`) stay runnable and recorded.

Nobody here can run them (no GPU), so each is parsed, without running it, by
a fresh absl FlagValues holding exactly the flags its program defines (its
`define_flags()`, with tfscale-launch's), validators included; then the
values its `main` would refuse are checked as it checks them. Renaming or
dropping a flag, or an algorithm, breaks these tests. Also: `--commands`
prints them and starts nothing; after a check on GPUs they follow the verdict;
BENCHMARKS.md's section holds the ones for 8 GPUs.

Fast: starts no process (not multiworker).
"""

import functools
import importlib
import inspect
import os
import re
import shlex
import sys

import pytest
from absl import flags

from tfscale import collectives
from tfscale import recipes
from tfscale.collectives import implementation
from tfscale.launch import local  # noqa: F401 (imported before any FLAGS is swapped)
from tfscale.launch.bench import allreduce
from tfscale.launch.bench import cluster
from tfscale.launch.bench import gpucheck
from tfscale.launch.bench import stats
from tfscale.launch.bench import train
from tfscale.launch.studies import precision_speed

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_FLAGS = flags.FLAGS
GPU_COUNTS = (2, 4, 6, 8, 16)


@pytest.fixture
def fresh_flags(monkeypatch):
    """A new FlagValues that absl's DEFINE_* and validators, and the FLAGS of
    every tfscale.launch module, use until the test ends: each program
    defines its flags as when it runs alone (tfscale-bench's subcommands
    share names with one another and with tfscale-train)."""
    fresh = flags.FlagValues()
    for name in dir(flags):
        function = getattr(flags, name)
        if name.startswith("_") or isinstance(function, type) or not callable(function):
            continue
        try:
            takes = inspect.signature(function).parameters
        except (TypeError, ValueError):
            continue
        if "flag_values" in takes:
            monkeypatch.setattr(flags, name, functools.partial(function, flag_values=fresh))
    monkeypatch.setattr(flags, "FLAGS", fresh)
    for module in launch_modules():
        if module.FLAGS is GLOBAL_FLAGS:
            monkeypatch.setattr(module, "FLAGS", fresh)
    yield fresh
    # A module first imported during the test took `flags.FLAGS`: fresh.
    for module in launch_modules():
        if module.FLAGS is fresh:
            module.FLAGS = GLOBAL_FLAGS


def launch_modules():
    """The imported tfscale.launch modules that hold a FLAGS."""
    return [m for name, m in list(sys.modules.items())
            if name.startswith("tfscale.launch") and hasattr(m, "FLAGS")]


def split(command):
    """(environment, program module, flag arguments) of a printed command."""
    words = shlex.split(command)
    env = {}
    while re.match(r"^[A-Z_]+=", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "tfscale-bench":
        assert words[1] in importlib.import_module("tfscale.launch.bench").SUBCOMMANDS
        module, rest = f"tfscale.launch.bench.{words[1]}", words[2:]
    else:
        assert words[:2] == ["python", "-m"], command
        module, rest = words[2], words[3:]
    assert all(w.startswith("--") for w in rest), f"not a flag in {command}"
    return env, importlib.import_module(module), rest


def parse(command, fresh):
    """Parses the command's flags as its program would, in `fresh` emptied
    first (each program alone); returns its environment, module and flags."""
    env, module, arguments = split(command)
    for name in list(fresh):
        delattr(fresh, name)
    module.define_flags()
    fresh([module.__name__, *arguments])  # unknown flag or bad value: raises
    return env, module, fresh


def check_values(module, parsed):
    """What each program's main refuses after parsing (names in lists,
    sizes); returns the configurations of allreduce and train."""
    if "precisions" in parsed:
        assert set(parsed.precisions) <= set(recipes.PRECISIONS), parsed.precisions
    if module not in (allreduce, train):
        return None
    more = (collectives.powersgd.NAME,) if module is train else ()
    configs = cluster.configs(more_compressions=more)  # raises on a bad name
    if module is allreduce and not parsed.gradients:
        stats.parse_sizes(parsed.sizes)
    return configs


@pytest.mark.parametrize("num_gpus", GPU_COUNTS)
def test_each_printed_command_parses_with_its_programs_flags(num_gpus, fresh_flags):
    local_size = gpucheck.default_local_size(num_gpus)
    for command in gpucheck.proving_commands(num_gpus, local_size):
        env, module, parsed = parse(command, fresh_flags)
        check_values(module, parsed)
        if module is precision_speed:
            assert env == {"CUDA_VISIBLE_DEVICES": "0"}, command  # one GPU
            assert parsed.deterministic_too, command
            continue
        assert env == {}, command
        assert parsed.num_workers == parsed.gpus_per_node == num_gpus, command
        assert parsed.local_size == local_size, command
        assert parsed.emulate_nodes is None, command


def test_they_compare_every_algorithm_over_nccl_with_the_default_and_stock(fresh_flags):
    """allreduce: every algorithm (hybrid too) and stock, small to large;
    train: the NCCL default against hybrid, hierarchical and stock."""
    default = implementation.default_algorithm("nccl")
    assert default == "ring"
    commands = gpucheck.proving_commands(8, gpucheck.default_local_size(8))
    seen = {}
    for command in commands:
        _, module, parsed = parse(command, fresh_flags)
        names = {algorithm for _, algorithm, _ in check_values(module, parsed) or []}
        values = parsed.flag_values_dict()  # the next command clears `parsed`
        seen.setdefault(module.__name__, []).append((names, values))
    for names, values in seen[allreduce.__name__]:
        assert names == {cluster.STOCK, *collectives.FIXED_ALGORITHMS}
    sizes = stats.parse_sizes(seen[allreduce.__name__][0][1]["sizes"])
    assert min(sizes) <= 64 * 1024 and max(sizes) >= 64 * 2**20
    assert seen[allreduce.__name__][1][1]["gradients"] == "resnet50"
    models = set()
    for names, values in seen[train.__name__]:
        assert {cluster.STOCK, default, "hybrid", "hierarchical"} <= names
        models.add(values["model"])
    assert models == {"resnet50", "alexnet_bn"}
    assert len(seen[precision_speed.__name__]) == 1
    # Sub-groups on one machine: two nodes of 4 (one node: no hierarchy).
    assert gpucheck.default_local_size(8) == 4 and gpucheck.default_local_size(2) is None


@pytest.mark.parametrize("num_gpus", GPU_COUNTS)
def test_outputs_go_under_docs_bench_named_for_the_gpus(num_gpus):
    commands = gpucheck.proving_commands(num_gpus, gpucheck.default_local_size(num_gpus))
    outputs = [re.search(r"--output=(\S+)", c).group(1) for c in commands if "--output=" in c]
    assert len(outputs) == sum(c.startswith("tfscale-bench") for c in commands)
    assert len(set(outputs)) == len(outputs)
    for output in outputs:
        assert re.fullmatch(rf"docs/bench/\w+_gpu{num_gpus}\.json", output), output


def test_commands_flag_prints_them_and_starts_nothing(fresh_flags, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("--commands must not look for GPUs or start workers")

    monkeypatch.setattr(cluster, "launch_workers", refuse)
    monkeypatch.setattr(gpucheck, "gpus_here", refuse)
    gpucheck.define_flags()
    fresh_flags(["gpucheck", "--commands", "--num_workers=8"])
    assert gpucheck.main() == gpucheck.proving_commands(8, 4)
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    assert printed == gpucheck.next_steps(8, 4, checked=False).split("\n")
    assert printed[0].startswith("To prove the other paths on 8 GPUs and record "
                                 "them in BENCHMARKS.md, run on that machine")
    assert printed[1:-1] == gpucheck.proving_commands(8, 4)
    assert f'section "{gpucheck.BENCHMARKS_SECTION}"' in printed[-1]


@pytest.mark.parametrize("ring_only", [False, True])
def test_after_a_check_on_gpus_the_commands_follow_the_verdict(
        ring_only, fresh_flags, monkeypatch, capsys):
    monkeypatch.setattr(gpucheck, "gpus_here", lambda: 0 if ring_only else 8)
    monkeypatch.setattr(cluster, "launch_workers", lambda *args, **kwargs: [])
    monkeypatch.setattr(gpucheck.report, "summarize", lambda *args: [])
    monkeypatch.setattr(gpucheck, "verdict", lambda *args: "VERDICT")
    gpucheck.define_flags()
    fresh_flags(["gpucheck", "--num_workers=8"] + (["--ring_only"] if ring_only else []))
    gpucheck.main()
    printed = capsys.readouterr().out
    if ring_only:  # CPU workers: nothing about GPUs to run next
        assert printed.rstrip().endswith("VERDICT") and "Next:" not in printed
        return
    after = printed.split("VERDICT\n", 1)[1].rstrip("\n")
    assert after == gpucheck.next_steps(8, 4, checked=True)
    assert after.startswith("Next: to prove the other paths on these 8 GPUs and "
                            "record them in BENCHMARKS.md, run:\n")


def benchmarks_section():
    """The text of BENCHMARKS.md's section named by gpucheck."""
    with open(os.path.join(REPO_ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        text = f.read()
    heading = f"## {gpucheck.BENCHMARKS_SECTION}\n"
    assert heading in text, f"BENCHMARKS.md has no heading {heading.strip()!r}"
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_benchmarks_md_names_the_section_and_the_commands_for_8_gpus():
    section = benchmarks_section()
    prose = " ".join(section.split())
    assert "tfscale-bench gpucheck --commands --num_workers=8" in prose
    blocks = re.findall(r"^```\n(.*?)^```$", section, re.S | re.M)
    commands = [" ".join(c.split()) for c in re.sub(r"\\\n", " ", blocks[0]).splitlines()]
    assert commands == gpucheck.proving_commands(8, gpucheck.default_local_size(8))


def test_the_printed_bench_commands_give_each_worker_one_gpu(
        fresh_flags, monkeypatch, tmp_path):
    given = {}

    def launch(command, num_workers, **options):
        given.update(options, num_workers=num_workers)
        return 1  # as if the workers failed: nothing runs

    monkeypatch.setattr(local, "launch", launch)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # launch_workers sets these
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    command = gpucheck.proving_commands(8, 4)[0]
    assert command.startswith("tfscale-bench allreduce")
    parse(command, fresh_flags)
    with pytest.raises(RuntimeError, match="workers failed"):
        cluster.launch_workers({"command": "allreduce"}, str(tmp_path), "probe")
    assert given["num_workers"] == 8 and given["gpus_per_node"] == 8
