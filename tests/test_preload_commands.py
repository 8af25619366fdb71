"""Which commands `tfscale-launch --preload` can fork (launch/preload.py's
`python_target`): Python run by the launcher's interpreter, as a script, a
module or a console script; anything else is refused before any worker
starts (test_preload.py runs the refusal)."""

import os
import sys

import pytest

from tfscale.launch import preload


def script(tmp_path, first_line):
    path = tmp_path / "worker"
    path.write_text(f"{first_line}\nprint('hello')\n")
    path.chmod(0o755)
    return str(path)


def test_python_module_and_script_are_forked_with_their_arguments(tmp_path):
    assert preload.python_target([sys.executable, "-m", "pkg.mod", "--flag=1"]) == (
        "module", "pkg.mod", ["--flag=1"])
    assert preload.python_target([sys.executable, "train.py", "a"]) == (
        "script", os.path.abspath("train.py"), ["a"])


def test_a_console_script_of_this_python_is_forked_from_beside_it():
    kind, path, args = preload.python_target(["tfscale-train", "--epochs=1"])
    assert (kind, args) == ("script", ["--epochs=1"])
    assert path == os.path.join(os.path.dirname(sys.executable), "tfscale-train")


def test_a_script_whose_line_names_this_python_is_forked(tmp_path):
    path = script(tmp_path, f"#!{sys.executable}")
    assert preload.python_target([path, "x"]) == ("script", path, ["x"])


@pytest.mark.parametrize("command", [
    pytest.param(lambda tmp: [sys.executable, "-u", "train.py"], id="interpreter-options"),
    pytest.param(lambda tmp: [sys.executable], id="no-script"),
    pytest.param(lambda tmp: [script(tmp, "#!/bin/sh")], id="shell-script"),
    pytest.param(lambda tmp: ["true"], id="binary"),
    pytest.param(lambda tmp: ["tfscale-no-such-command"], id="missing"),
])
def test_anything_else_is_not_forked(tmp_path, command):
    assert preload.python_target(command(tmp_path)) is None
