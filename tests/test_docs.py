"""README.md and docs/*.md stay true: their links resolve and their commands
name modules, flags and subcommands that exist.

Fast: reads the pages and imports tfscale; starts no process. For each page:

- every relative link `[text](path)` / `[text](path#anchor)` names an existing
  file, and an anchor into a Markdown page names one of its headings
  (GitHub's slugs);
- every `python -m MODULE` of a shell block or of inline code is importable
  (`importlib.util.find_spec`; a package needs a `__main__`), and
  `python SCRIPT.py` and `pytest tests/...` name existing files;
- every `--flag` given to `tfscale-train` or `tfscale-launch` (before ` -- `
  for tfscale-launch, after it for the tfscale-train it starts) is one of
  their absl flags (`--noFLAG` for a boolean), and `tfscale-bench SUB`
  names a subcommand whose module defines the flags given; inline code that
  starts with `--flag` names flags of one of them;
- every ```python block compiles;
- no `python -m launch.X` or `import models` is left (they became
  tfscale.launch.X and `from tfscale import models`).

Besides: every docs/ page is reachable by links from README.md, and README
keeps what CI runs (its first two ```bash blocks, its first ```python block).

Shell blocks are ```bash (and ```sh, ```shell, ```console); in unlabelled
blocks, which also hold program output, only lines that start with
`python` or a tfscale-* command are read. Commands meant for a GPU machine or
a cluster (docker, kubectl, sbatch, srun) are not checked, except the
tfscale-* command they run. A word written in capitals (`NAME`,
`SUBCOMMAND`) is a placeholder and is not checked.
"""

import dataclasses
import importlib.util
import os
import re
import shlex

import pytest
from absl import flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO_ROOT, "docs")
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(DOCS) if name.endswith(".md"))

SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
PYTHON_LANGUAGES = ("python", "py", "python3")
COMMANDS = ("tfscale-train", "tfscale-launch", "tfscale-bench")
PYTHONS = ("python", "python3")
SEPARATORS = ("&&", "||", "|", ";", "&")
# absl's own flags, which every entry point takes.
ABSL_FLAGS = frozenset({"help", "helpshort", "helpfull", "helpxml", "flagfile",
                        "undefok", "only_check_args", "verbosity", "v",
                        "logtostderr", "alsologtostderr", "log_dir",
                        "stderrthreshold", "showprefixforinfo"})
# The pre-namespace names (before setup.py mapped launch/ and models/ into
# tfscale): importable from a checkout's root, so find_spec alone would pass.
OLD_TOP_LEVEL = {"launch": "tfscale.launch", "models": "tfscale.models"}


# --- Reading a page -----------------------------------------------------------

@dataclasses.dataclass
class Block:
    language: str
    line: int  # of the block's first line of code
    lines: list


@dataclasses.dataclass
class Page:
    path: str  # relative to the repository
    blocks: list
    prose: str  # the page with fenced blocks blanked (line numbers kept)

    @property
    def directory(self):
        return os.path.dirname(os.path.join(REPO_ROOT, self.path))

    def line_of(self, offset):
        return self.prose.count("\n", 0, offset) + 1


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def read_page(path):
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, prose, fence, block = [], [], None, None
    for number, line in enumerate(lines, start=1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            block = Block(match.group(2).lower(), number + 1, [])
            prose.append("")
        elif fence is not None:
            stripped = line.strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                blocks.append(block)
                fence = None
            else:
                block.lines.append(line)
            prose.append("")
        else:
            prose.append(line)
    return Page(path, blocks, "\n".join(prose))


_INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def inline_code(page):
    """(line, text) of each inline code span outside fenced blocks."""
    for match in _INLINE_CODE.finditer(page.prose):
        yield page.line_of(match.start()), " ".join(match.group(2).split())


def prose_without_code(page):
    """The prose with inline code blanked (offsets and newlines kept)."""
    return _INLINE_CODE.sub(
        lambda m: re.sub(r"[^\n]", " ", m.group(0)), page.prose)


def logical_lines(block):
    """(line, text) of each command of a block, continuation lines joined."""
    start, parts = None, []
    for index, line in enumerate(block.lines):
        if start is None:
            start = block.line + index
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(" ".join(parts).split())
        start, parts = None, []
    if parts:
        yield start, " ".join(" ".join(parts).split())


def commands(page):
    """(line, text, where) of everything that may hold a command: each line
    of a shell block, each command line of an unlabelled block, and each
    inline code span."""
    for block in page.blocks:
        if block.language in SHELL_LANGUAGES:
            for line, text in logical_lines(block):
                yield line, text, "```bash block", True
        elif block.language == "":
            for line, text in logical_lines(block):
                first = text.split(" ", 1)[0]
                if os.path.basename(first) in PYTHONS + COMMANDS:
                    yield line, text, "``` block", True
    for line, text in inline_code(page):
        yield line, text, "inline code", False


def tokens(text, comments):
    try:
        return shlex.split(text, comments=comments)
    except ValueError:  # an apostrophe in prose-like inline code
        return text.split()


def is_placeholder(word):
    """NAME, SUBCOMMAND, X: a word the reader replaces."""
    letters = re.sub(r"[^A-Za-z]", "", word)
    return bool(letters) and letters.isupper()


# --- The flags -----------------------------------------------------------------

@pytest.fixture(scope="module")
def defined_flags():
    """{command: flag names} of tfscale-train and tfscale-launch, from the
    absl flags their modules define (in `define_flags()`, called by their
    entry points); the flags this fixture defined are removed afterwards."""
    from tfscale.launch import local
    from tfscale.launch import train_flags

    before = set(flags.FLAGS)
    train_flags.define_flags()
    local.define_flags()
    names = {}
    for command, module in (("tfscale-train", train_flags), ("tfscale-launch", local)):
        defined = flags.FLAGS.get_flags_for_module(module.__name__)
        assert defined, f"{module.__name__}.define_flags() defined no flag"
        names[command] = {
            "all": {flag.name for flag in defined},
            "boolean": {flag.name for flag in defined if flag.boolean},
        }
    yield names
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)


def bench_subcommands():
    from tfscale.launch import bench

    return bench.SUBCOMMANDS


_DEFINE = re.compile(r"\bDEFINE_(\w+)\(\s*[\"'](\w+)[\"']")
_CALLS_DEFINE = re.compile(r"\b(\w+)\.define_flags\(\)")


def bench_flags(subcommand, launch_flags):
    """The flags `tfscale-bench SUBCOMMAND` defines: read from the source of
    its module (and of the modules whose `define_flags()` it calls), since
    each subcommand defines its flags only when chosen and their names clash
    with tfscale-train's in one absl FlagValues."""
    names, booleans, seen = set(), set(), set()

    def read(module):
        if module in seen:
            return
        seen.add(module)
        if module == "tfscale.launch.local":
            names.update(launch_flags["all"])
            booleans.update(launch_flags["boolean"])
            return
        spec = importlib.util.find_spec(module)
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
        for kind, name in _DEFINE.findall(source):
            names.add(name)
            if kind in ("bool", "boolean"):
                booleans.add(name)
        for other in _CALLS_DEFINE.findall(source):
            read("tfscale.launch.local" if other == "local"
                 else f"tfscale.launch.bench.{other}")

    read(f"tfscale.launch.bench.{subcommand}")
    return {"all": names, "boolean": booleans}


def invocations(words):
    """[command, subcommand or None, [flag names]] of each tfscale-* command
    in `words`: for tfscale-launch, the flags before ` -- `; the command after
    it is an invocation of its own (or not checked, when not tfscale-*)."""
    found, current = [], None
    for word in words:
        name = os.path.basename(word)
        if word in SEPARATORS:
            current = None
        elif name in COMMANDS:
            current = [name, None, []]
            found.append(current)
        elif current is None:
            continue
        elif word == "--":
            current = None  # tfscale-launch's worker command follows
        elif word.startswith("--"):
            current[2].append(word[2:].split("=", 1)[0])
        elif current[0] == "tfscale-bench" and current[1] is None and not word.startswith("-"):
            current[1] = word
    return found


def unknown_flag(name, known):
    if name in known["all"] or name in ABSL_FLAGS:
        return False
    return not (name.startswith("no") and name[2:] in known["boolean"])


# --- The checks -------------------------------------------------------------------

def _fail(problems):
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]|<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """The anchors of a Markdown file's headings."""
    page = read_page(os.path.relpath(path, REPO_ROOT))
    found, counts = set(), {}
    for line in page.prose.split("\n"):
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("path", PAGES)
def test_relative_links_resolve(path):
    page = read_page(path)
    text = prose_without_code(page)
    problems = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-zA-Z][\w+.-]*:|^//", target):
            continue  # https:, mailto:
        where = f"{path}:{page.line_of(match.start())}: link {match.group(0)!r}"
        file_part, _, anchor = target.partition("#")
        resolved = (os.path.join(REPO_ROOT, path) if not file_part
                    else os.path.normpath(os.path.join(page.directory, file_part)))
        if not os.path.exists(resolved):
            problems.append(f"{where}: {os.path.relpath(resolved, REPO_ROOT)} does not exist")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            problems.append(f"{where}: {os.path.relpath(resolved, REPO_ROOT)} has no "
                            f"heading whose anchor is #{anchor}")
    _fail(problems)


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), ["README.md"]
    while todo:
        path = todo.pop()
        if (path in seen or not path.endswith(".md")
                or not os.path.exists(os.path.join(REPO_ROOT, path))):
            continue  # a missing page: test_relative_links_resolve names it
        seen.add(path)
        page = read_page(path)
        for match in _LINK.finditer(prose_without_code(page)):
            file_part = match.group(1).partition("#")[0]
            if file_part and not re.match(r"^[a-zA-Z][\w+.-]*:", file_part):
                target = os.path.normpath(os.path.join(page.directory, file_part))
                todo.append(os.path.relpath(target, REPO_ROOT))
    missing = [p for p in PAGES if p not in seen]
    assert not missing, f"no chain of links from README.md reaches {missing}"


@pytest.mark.parametrize("path", PAGES)
def test_python_commands_resolve(path):
    page = read_page(path)
    problems = []
    for line, text, where, is_block in commands(page):
        words = tokens(text, comments=is_block)
        for index, word in enumerate(words[:-1]):
            if os.path.basename(word) not in PYTHONS:
                continue
            place = f"{path}:{line} ({where}): `{text}`"
            following = words[index + 1]
            if following == "-m" and index + 2 < len(words):
                module = words[index + 2]
                if is_placeholder(module.split(".")[-1]):
                    continue
                top = module.split(".")[0]
                if top in OLD_TOP_LEVEL:
                    problems.append(f"{place}: module {module} was renamed "
                                    f"{OLD_TOP_LEVEL[top]}{module[len(top):]}")
                    continue
                try:
                    spec = importlib.util.find_spec(module)
                except ImportError:
                    spec = None
                if spec is None:
                    problems.append(f"{place}: no module named {module}")
                elif (spec.submodule_search_locations is not None
                      and importlib.util.find_spec(f"{module}.__main__") is None):
                    problems.append(f"{place}: package {module} has no __main__ "
                                    "module, so python -m cannot run it")
                elif module == "pytest":
                    for arg in words[index + 3:]:
                        if arg in SEPARATORS:
                            break
                        if re.match(r"^tests(/|$)", arg):
                            test_path = arg.split("::")[0]
                            if not os.path.exists(os.path.join(REPO_ROOT, test_path)):
                                problems.append(f"{place}: {test_path} does not exist")
            elif following.endswith(".py"):
                if not os.path.exists(os.path.join(REPO_ROOT, following)):
                    problems.append(f"{place}: {following} does not exist")
    _fail(problems)


@pytest.mark.parametrize("path", PAGES)
def test_tfscale_command_flags_are_defined(path, defined_flags):
    page = read_page(path)
    subcommands = bench_subcommands()
    problems = []
    for line, text, where, is_block in commands(page):
        for command, subcommand, names in invocations(tokens(text, comments=is_block)):
            place = f"{path}:{line} ({where}): `{text}`"
            if command == "tfscale-bench":
                if subcommand is None or is_placeholder(subcommand):
                    known = {"all": set(), "boolean": set()}
                else:
                    wrong = [s for s in subcommand.split("|") if s not in subcommands]
                    if wrong:
                        problems.append(f"{place}: tfscale-bench has no subcommand "
                                        f"{', '.join(wrong)} (it has {', '.join(subcommands)})")
                        continue
                    known = {"all": set(), "boolean": set()}
                    for each in subcommand.split("|"):  # allreduce|train|project
                        flags_of = bench_flags(each, defined_flags["tfscale-launch"])
                        known["all"] |= flags_of["all"]
                        known["boolean"] |= flags_of["boolean"]
            else:
                known = defined_flags[command]
            for name in names:
                if unknown_flag(name, known):
                    owner = f"{command} {subcommand}" if subcommand else command
                    problems.append(f"{place}: {owner} defines no flag --{name}")
    _fail(problems)


@pytest.mark.parametrize("path", PAGES)
def test_flags_named_alone_are_defined(path, defined_flags):
    """Inline code that starts with a flag (`--scale_lr --lr_schedule=...`,
    `--isolate=yes`) names flags of tfscale-train, tfscale-launch or a
    tfscale-bench subcommand."""
    known = {"all": set(), "boolean": set()}
    for names in [*defined_flags.values(),
                  *(bench_flags(s, defined_flags["tfscale-launch"])
                    for s in bench_subcommands())]:
        known["all"] |= names["all"]
        known["boolean"] |= names["boolean"]
    page = read_page(path)
    problems = []
    for line, text in inline_code(page):
        words = tokens(text, comments=False)
        if not words[0].startswith("--") or any(
                os.path.basename(w) in COMMANDS + PYTHONS for w in words):
            continue  # another program's command, or one the tests above check
        for word in words:
            match = re.match(r"^--([a-z][a-z0-9_]*)(=|$)", word)
            if match and unknown_flag(match.group(1), known):
                problems.append(f"{path}:{line} (inline code): `{text}`: no tfscale "
                                f"command defines --{match.group(1)}")
    _fail(problems)


@pytest.mark.parametrize("path", PAGES)
def test_python_blocks_compile(path):
    page = read_page(path)
    problems = []
    for block in page.blocks:
        if block.language in PYTHON_LANGUAGES:
            try:
                compile("\n".join(block.lines), f"{path}:{block.line}", "exec")
            except SyntaxError as error:
                problems.append(f"{path}:{block.line - 1 + (error.lineno or 1)}: "
                                f"```python block does not compile: {error.msg}")
    _fail(problems)


@pytest.mark.parametrize("path", PAGES)
def test_no_pre_namespace_module_names(path):
    """`python -m launch.X` and `import models` became tfscale.launch.X and
    `from tfscale import models` (setup.py's package_dir)."""
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    old = re.compile(r"-m\s+(launch|models)\.|^\s*import (models|launch)\b"
                     r"|^\s*from (models|launch)\b")
    problems = [f"{path}:{number}: pre-namespace name in {line.strip()!r}"
                for number, line in enumerate(lines, start=1) if old.search(line)]
    _fail(problems)


def test_readme_keeps_what_ci_runs():
    """CI runs README's first two ```bash blocks and its first ```python block
    (the serving snippet)."""
    page = read_page("README.md")
    bash = ["\n".join(b.lines) for b in page.blocks if b.language == "bash"]
    python = ["\n".join(b.lines) for b in page.blocks if b.language == "python"]
    assert bash[:2] == [
        'pip install -e ".[cpu,test]" && tfscale-launch --num_workers=2 -- tfscale-train',
        "python -m pytest tests -q -rs -n 2 --dist loadfile",
    ], f"README.md's first two ```bash blocks changed: {bash[:2]}"
    assert python and 'tf.saved_model.load("tfscale_export")' in python[0], (
        "README.md's first ```python block is no longer the serving snippet")
    assert 'python -m pytest tests -q -m "not multiworker"' in page.prose, (
        "README.md no longer names the fast tier's command")
