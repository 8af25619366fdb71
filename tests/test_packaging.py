"""setup.py as pip's resolver reads it: tfscale chooses no TensorFlow build,
and installed beside keras-hub leaves exactly one TensorFlow distribution.

pip resolves without installing (`--dry-run --report`, PEP 658 metadata: no
TensorFlow wheel is downloaded); it is not a worker process. Skipped, with the
reason, when the package index cannot be reached.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from multiworker import REPO_ROOT

# The distributions that install the `tensorflow` package.
TENSORFLOWS = {"tensorflow", "tensorflow-cpu", "tensorflow-intel"}
# What pip prints when the index cannot be reached.
_OFFLINE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name",
            "Max retries exceeded", "No matching distribution found")


def _pip():
    beside = os.path.join(os.path.dirname(sys.executable), "pip")
    return beside if os.path.exists(beside) else shutil.which("pip")


def resolve(tmp_path, *requirements):
    """{distribution name: report item} of what `pip install requirements`
    would install into an empty environment, from the repository's root."""
    report = tmp_path / "report.json"
    done = subprocess.run([_pip(), "install", "--dry-run", "--ignore-installed",
                           "--quiet", "--report", str(report), *requirements],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    if done.returncode != 0:
        offline = [line for line in done.stderr.splitlines()
                   if any(sign in line for sign in _OFFLINE)]
        if offline:
            reason = f"the package index is unreachable: {offline[-1].strip()}"
            print(reason)
            pytest.skip(reason)
        raise AssertionError(done.stderr[-3000:])
    with open(report) as f:
        items = json.load(f)["install"]
    return {canonicalize_name(i["metadata"]["name"]): i for i in items}


def tensorflow_requirements(item):
    """The requirements on a TensorFlow distribution that `item` (a report
    item) brings with the extras it was asked for."""
    extras = item.get("requested_extras") or [""]
    found = []
    for text in item["metadata"].get("requires_dist", []):
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) in TENSORFLOWS and (
                requirement.marker is None
                or any(requirement.marker.evaluate({"extra": e}) for e in extras)):
            found.append(requirement)
    return found


@pytest.mark.package_index
def test_beside_keras_hub_one_tensorflow_is_installed_and_every_requirement_on_it_holds(
        tmp_path):
    """keras-hub needs tensorflow-text, which requires the `tensorflow` build
    (not tensorflow-cpu): beside it, tfscale's [tensorflow] extra."""
    installed = resolve(tmp_path, ".[tensorflow]", "keras-hub")
    tensorflows = sorted(TENSORFLOWS & set(installed))
    assert tensorflows == ["tensorflow"], tensorflows
    tensorflow_version = installed["tensorflow"]["metadata"]["version"]
    required = {name: tensorflow_requirements(item) for name, item in installed.items()}
    assert required["tfscale"] and required["tensorflow-text"], required
    for name, requirements in required.items():
        for requirement in requirements:
            assert canonicalize_name(requirement.name) == "tensorflow" and (
                requirement.specifier.contains(tensorflow_version, prereleases=True)), (
                f"{name} requires {requirement}; pip chose tensorflow {tensorflow_version}")
    # tfscale itself names no TensorFlow build: only its extras do.
    core = [str(r) for r in map(Requirement, installed["tfscale"]["metadata"]["requires_dist"])
            if canonicalize_name(r.name) in TENSORFLOWS and r.marker is None]
    assert core == []
