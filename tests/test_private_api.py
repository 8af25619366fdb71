"""No reach-ins: only tfscale/_private/ touches private TensorFlow/Keras
attributes or their path conventions (README, "Layout"); and it imports
nothing of tfscale.

Reads every .py file of tfscale/, launch/, models/ and tests/ (code, and the
scripts tests hold in strings) and names each `obj._name` with file:line, except:
- `self._name` and `cls._name`: an object's own state;
- `obj._name` where this file itself defines `_name` (a module-level
  `_name = ...`, `def _name`, `class _Name`, or `self._name = ...`): its own
  module-private names, which the module may use on its own objects;
- inside tfscale/ and tests/, `tfscale._module`: the package's own private
  modules and packages (tfscale imports `_private` that way, and its tests
  test it).
`super()._name` is a hit: overriding a TensorFlow/Keras private method belongs
in tfscale/_private/. Also named: `getattr`/`setattr`/`hasattr` with a private
name, and Keras's private variable-path conventions.
"""

import io
import os
import re
import tokenize

from multiworker import REPO_ROOT

FOLDERS = ("tfscale", "launch", "models", "tests")
ALLOWED_FOLDER = os.path.join("tfscale", "_private") + os.sep
SELF = os.path.join("tests", "test_private_api.py")
PRIVATE = re.compile(r"_[a-z]\w*")
# In string literals (child scripts): `name._attr` or `name()._attr`.
IN_STRING = re.compile(r"\b([A-Za-z_]\w*(?:\(\))?)\.(_[a-z]\w*)")
REFLECTION = re.compile(r"\b(?:get|set|has)attr\(\s*[^,]+,\s*[\"'](_[a-z]\w*)")
# Keras's own names inside variable paths (written split, so that this file
# does not name them itself).
PATH_CONVENTIONS = ("seed_generator" + "_state",)
OWN_NAMES = re.compile(
    r"^(_[a-z]\w*)\s*=|^\s*(?:def|class)\s+(_\w+)|\b(?:self|cls)\.(_[a-z]\w*)\s*[:=]",
    re.M)


def python_files():
    for folder in FOLDERS:
        for root, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    yield os.path.relpath(path, REPO_ROOT), path


def own_names(source):
    return {name for groups in OWN_NAMES.findall(source) for name in groups if name}


def private_package_modules():
    """`_name` of each private module (`_name.py`) or package (`_name/`)."""
    names = set()
    for name in os.listdir(os.path.join(REPO_ROOT, "tfscale")):
        stem = name[:-3] if name.endswith(".py") else name
        if PRIVATE.fullmatch(stem) and (name.endswith(".py") or os.path.isdir(
                os.path.join(REPO_ROOT, "tfscale", name))):
            names.add(stem)
    return names


def hits_in(relative, source):
    """(line number, what) of each reach-in in one file's source."""
    own = own_names(source)
    package_private = (private_package_modules()
                       if relative.startswith(("tfscale", "tests")) else set())
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
                                tokenize.INDENT, tokenize.DEDENT)]

    def allowed(owner, name):
        if owner in ("self", "cls") or name in own:
            return True
        return owner == "tfscale" and name in package_private

    hits = []
    for i, token in enumerate(tokens):
        if token.type == tokenize.STRING:
            for owner, name in IN_STRING.findall(token.string):
                if not allowed(owner, name):
                    hits.append((token.start[0], f"{owner}.{name} (in a string)"))
            for convention in PATH_CONVENTIONS:
                if convention in token.string:
                    hits.append((token.start[0], f"Keras path convention {convention!r}"))
        elif (token.string == "." and 0 < i < len(tokens) - 1
              and tokens[i + 1].type == tokenize.NAME
              and PRIVATE.fullmatch(tokens[i + 1].string)):
            before = tokens[i - 1].string
            owner = "super()" if before == ")" and tokens[i - 3].string == "super" else before
            name = tokens[i + 1].string
            if not allowed(owner, name):
                hits.append((token.start[0], f"{owner}.{name}"))
    for number, line in enumerate(source.splitlines(), 1):
        for name in REFLECTION.findall(line):
            if name not in own:
                hits.append((number, f"reflection on {name}"))
    return hits


def test_the_checker_finds_reach_ins_and_spares_own_names():
    source = '''
import keras
_CACHE = {}
def _helper(): return _CACHE
class Ops(keras.layers.Layer):
    def __init__(self):
        self._groups = []
    def call(self, model):
        super()._track(model)           # 9: super() reach-in
        other = Ops()
        other._groups.append(_helper())  # own attribute: fine
        return model._flatten_layers()  # 12
CHILD = "strategy._tfscale_all_reduce"  # 13
getattr(model, "_layers")               # 14
path = "dense/seed_generator_state"     # 15
'''.replace("seed_generator_state", PATH_CONVENTIONS[0])
    hits = hits_in("launch/example.py", source)
    assert [line for line, _ in hits] == [9, 12, 13, 15, 14], hits
    assert hits[0][1] == "super()._track" and hits[1][1] == "model._flatten_layers"


def test_no_private_tensorflow_or_keras_access_outside_the_private_layer():
    hits = []
    for relative, path in python_files():
        if relative.startswith(ALLOWED_FOLDER) or relative == SELF:  # SELF: examples
            continue
        with open(path) as f:
            source = f.read()
        hits += [f"{relative}:{line}: {what}" for line, what in hits_in(relative, source)]
    assert not hits, ("private attributes outside tfscale/_private/ (move the "
                      "access there behind a public accessor):\n" + "\n".join(hits))
