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

import pytest

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
# Public despite the underscore: os._exit, "normally used in the child
# process after a fork()" (Python's os module documentation).
DOCUMENTED_PUBLIC = {("os", "_exit")}
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
        if owner in ("self", "cls") or name in own or (owner, name) in DOCUMENTED_PUBLIC:
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


# At Strategy(): every private hook where tfscale expects it (tfscale._private.hooks).

def _hook_check():
    """(hooks, tensorflow, keras, the tested versions in words); imported
    here, so that the reach-in checks above run without TensorFlow."""
    import keras
    import tensorflow as tf

    from tfscale import _version
    from tfscale._private import hooks

    return hooks, tf, keras, _version.tested()


def _refusal(problem):
    _, tf, keras, tested = _hook_check()
    return re.escape(
        f"tfscale cannot run on TensorFlow {tf.__version__} and Keras "
        f"{keras.__version__}: it relies on private parts of them that moved: "
        f"{problem}. tfscale is tested with {tested}: install those.")


def test_every_hook_is_where_tfscale_expects_it_on_the_installed_versions():
    hooks, _, _, _ = _hook_check()
    assert [hooks.problem(hook) for hook in hooks.HOOKS] == [None] * len(hooks.HOOKS)


def test_the_hooks_are_the_private_names_the_private_layer_uses():
    """Each `obj._name` the private layer uses (methods, attributes, Keras's
    variable-path convention) is a hook or set by one: a new private use
    without its hook fails here."""
    hooks, _, _, _ = _hook_check()
    checked = set()
    for hook in hooks.HOOKS:
        checked |= {hook.name.split(".")[-1], *hook.uses}
    used = set()
    for name in os.listdir(os.path.join(REPO_ROOT, ALLOWED_FOLDER)):
        if name.endswith(".py") and name != "hooks.py":
            with open(os.path.join(REPO_ROOT, ALLOWED_FOLDER, name)) as f:
                for _, what in hits_in(ALLOWED_FOLDER + name, f.read()):
                    if what.startswith("Keras path convention"):
                        used.add(what.split("'")[1])
                    elif "(in a string)" not in what:  # docstrings name them too
                        used.add(what.split(".")[-1].split()[-1])
    assert used and used - checked == set(), sorted(used - checked)


def test_a_keras_function_gone_is_refused_naming_it(monkeypatch):
    hooks, _, _, tested = _hook_check()
    from keras.src.losses import loss

    monkeypatch.delattr(loss, "scale_loss_for_distribution")
    with pytest.raises(RuntimeError, match=_refusal(
            "keras.src.losses.loss.scale_loss_for_distribution is gone")):
        hooks.check(lambda *versions: True, tested)


def test_a_changed_signature_is_refused_naming_each_function(monkeypatch):
    hooks, _, _, tested = _hook_check()
    from keras.src.backend.tensorflow import optimizer
    from tensorflow.python.ops import collective_ops

    monkeypatch.setattr(optimizer.TFOptimizer, "_clip_gradients",
                        lambda self, grads, clipnorm: grads)

    def all_gather_v2(t, group_size, group_key, instance_key,
                      communication_hint="auto", timeout=0, name=None):
        return t

    monkeypatch.setattr(collective_ops, "all_gather_v2", all_gather_v2)
    with pytest.raises(RuntimeError, match=_refusal(
            "keras.src.backend.tensorflow.optimizer.TFOptimizer._clip_gradients "
            "takes (self, grads, clipnorm), not the tested (self, grads); "
            "tensorflow.python.ops.collective_ops.all_gather_v2 takes (t, "
            "group_size, group_key, instance_key, communication_hint, timeout, "
            "name), not the tested (t, group_size, group_key, instance_key, "
            "communication_hint, timeout, ordering_token, name)")):
        hooks.check(lambda *versions: True, tested)


def test_a_function_keras_no_longer_defines_or_an_attribute_no_longer_set_is_refused(
        monkeypatch):
    hooks, _, _, tested = _hook_check()
    from keras.src.backend.tensorflow import trainer
    from keras.src.optimizers import base_optimizer

    def _make_function(self, step_function):
        def step(iterator):  # Keras's `function`, renamed
            return step_function(iterator)
        return step

    def build(self, variables):  # keeps no `_accumulated_gradients`
        self.built = True

    monkeypatch.setattr(trainer.TensorFlowTrainer, "_make_function", _make_function)
    monkeypatch.setattr(base_optimizer.BaseOptimizer, "build", build)
    with pytest.raises(RuntimeError, match=_refusal(
            "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._make_function "
            "no longer defines function(); keras.src.optimizers.base_optimizer."
            "BaseOptimizer.build no longer uses _accumulated_gradients")):
        hooks.check(lambda *versions: True, tested)


def test_strategy_refuses_before_it_builds_anything(monkeypatch):
    _hook_check()
    import tfscale
    from keras.src.trainers import trainer

    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setattr(trainer, "LossScaleOptimizer", object)
    with pytest.raises(RuntimeError, match=_refusal(
            "keras.src.trainers.trainer.LossScaleOptimizer is no longer "
            "keras.optimizers.LossScaleOptimizer")):
        tfscale.Strategy()


def test_an_untested_version_whose_hooks_all_fit_warns_once_in_one_line(monkeypatch):
    hooks, tf, keras, tested = _hook_check()
    from tfscale import _version

    warnings = []
    monkeypatch.setattr(hooks.logging, "warning",
                        lambda message, *args: warnings.append(message % args))
    hooks.check(_version.is_tested, tested)
    assert warnings == []  # the installed versions are tested ones
    monkeypatch.setattr(tf, "__version__", "2.99.0")
    for _ in range(3):
        hooks.check(_version.is_tested, tested)
    assert warnings == [
        "tfscale is tested with TensorFlow 2.20 to 2.21 and Keras 3.13 to 3.15, "
        f"not TensorFlow 2.99.0 and Keras {keras.__version__}; every private "
        "TensorFlow/Keras hook it relies on is in place."]
