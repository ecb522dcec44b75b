"""Every code block of the README and of the docs site (docs/**/*.md but the run folders under docs/extrapolate/)
runs, or is checked, as written: one test per page, so a failure names the page (and the block's line).

By the fence's language:

* ``python``: the page's blocks run in order in one namespace, the current directory a temporary one (nothing is
  written into the checkout), with ``HF_HUB_OFFLINE=1`` (nothing is downloaded: transformers models are built from
  configs). A block that imports what an extra installs (transformers: ``hf``, matplotlib: ``plot``, jax, triton:
  ``gpu``) names the extra in a comment (``# needs the hf extra: pip install "relpos[hf]"``); the page skips where
  that extra is missing (never under CI, which installs them all). A block whose first line is
  ``# needs a CUDA GPU`` runs as written where CUDA exists and elsewhere with ``"cuda"`` swapped for ``"cpu"``.
  A page whose first block opens with ``# torchrun --nproc_per_node N ...`` runs its blocks as one script under
  torchrun on N gloo processes (docs/distributed.md).
* ``pycon``: a transcript, run as a doctest in the same namespace; its outputs must match (``...`` elides).
* ``bash``, ``sh``, ``shell`` and bare fences: every command is checked without running anything long (backslash
  continuations joined, ``VAR=value`` prefixes, redirections and comments dropped, split at ``&&``, ``||``, ``;``
  and ``|``), by program (:func:`check_command`). ``console``: the same for the lines after a ``$`` prompt; the
  output under a command that is run must match it (``...`` lines elide).
* ``text``: not code (output, a directory tree, a formula, an excerpt of source); nothing to run.

Any other language fails, as does an indented (unfenced) code block: fence it and say what it is.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import doctest
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "extrapolate"  # the experiment's result folders: generated tables, no code
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if not p.is_relative_to(RUNS))
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
# what a block may import only with an extra installed: module (or package prefix) -> extra
EXTRA_MODULES = {"transformers": "hf", "accelerate": "hf", "relpos.hf": "hf", "matplotlib": "plot",
                 "relpos.tools.plots": "plot", "jax": "jax", "triton": "gpu"}
EXTRA_PROBES = {"hf": "transformers", "plot": "matplotlib", "jax": "jax", "gpu": "triton"}
SHELL = {"bash", "sh", "shell", ""}
CUDA_MARK = "# needs a CUDA GPU"
TORCHRUN_MARK = re.compile(r"# torchrun --nproc_per_node (\d+) ")
RUN_RELPOS = {"buckets", "plot"}  # relpos subcommands cheap enough to run to completion; the others are parsed
ACCEPTED = {"git", "mkdocs", "cd", "export",  # the brief's list: version control, the site, the shell's own
            "tar", "mkdir", "cp", "ln"}  # file operations of docs/integrations/model-tests.md's setup


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str  # the block's lines, the fence's indentation removed

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced blocks of a page (``` or ~~~ fences, indented ones inside lists included)."""
    lines = (ROOT / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^( *)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = next(j for j in range(i + 1, len(lines)) if re.match(rf"^ *{fence[0]}{{{len(fence)},}}\s*$", lines[j]))
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end])
        found.append(Block(page, i + 1, lang.lower(), body + "\n"))
        i = end + 1
    return found


def indented_code(page: str) -> list[str]:
    """The first line of each indented (unfenced) code block: after a blank line, indented 4 spaces more than the
    text it would otherwise continue (a list item's text inside a list)."""
    lines = (ROOT / page).read_text().splitlines()
    for b in blocks(page):  # a fenced block counts as one line of text at its fence's indentation
        end = b.line + b.text.count("\n")
        indent = len(lines[b.line - 1]) - len(lines[b.line - 1].lstrip())
        lines[b.line - 1 : end + 1] = [" " * indent + "FENCED"] * (end + 2 - b.line)
    found, container, blank = [], 0, True
    for line in lines:
        if not line.strip():
            blank = True
            continue
        indent = len(line) - len(line.lstrip())
        item = re.match(r"( *)(?:[*+-]|\d+[.)]) +", line)
        if blank and indent >= container + 4:
            found.append(line.strip())
        elif item:
            container = len(item.group(0))  # a list item's text starts here
        elif blank:
            container = min(container, indent)  # a paragraph: back out of the lists it is not inside
        blank = False
    return found


# ---------------------------------------------------------------------------------------------------- python


def imported_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def extras_needed(block: Block) -> set[str]:
    code = block.text if block.lang == "python" else "".join(
        example.source for example in doctest.DocTestParser().get_examples(block.text))
    return {extra for name in imported_modules(code) for module, extra in EXTRA_MODULES.items()
            if name == module or name.startswith(module + ".")}


def extras_named(text: str) -> set[str]:
    """Extras a comment names in a pip install: ``relpos[hf]``, ``".[dev,jax]"``."""
    named = set()
    for comment in re.findall(r"#[^\n]*", text):
        for spec in re.findall(r"pip install\b[^#]*?(?:relpos|\.)\[([\w,-]+)\]", comment):
            named.update(spec.split(","))
    return named


def check_extras(block: Block) -> None:
    named = extras_named(block.text)
    assert named <= EXTRAS, f"{block.where}: no such extra {sorted(named - EXTRAS)} in pyproject.toml"
    needed = extras_needed(block)
    missing = needed - named
    assert not missing, (f"{block.where}: the block imports what the {sorted(missing)} extra installs; say so in a "
                         f'comment: # needs the {sorted(missing)[0]} extra: pip install "relpos[{sorted(missing)[0]}]"')
    for extra in needed:
        pytest.importorskip(EXTRA_PROBES[extra], reason=f"{block.where} needs the {extra} extra")


def source(block: Block, text: str | None = None) -> str:
    """The block's code with as many blank lines before it as the page has above it: tracebacks give page lines."""
    return "\n" * block.line + (block.text if text is None else text)


def run_python(block: Block, namespace: dict) -> None:
    text = block.text
    if text.startswith(CUDA_MARK) and not torch.cuda.is_available():
        text = text.replace('"cuda"', '"cpu"').replace("'cuda'", "'cpu'").replace(".cuda()", ".cpu()")
    exec(compile(source(block, text), block.page, "exec"), namespace)  # noqa: S102 - our own docs


def run_pycon(block: Block, namespace: dict) -> None:
    test = doctest.DocTestParser().get_doctest(block.text, namespace, block.where, block.page, block.line)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=out.write, clear_globs=False)
    assert runner.failures == 0, f"{block.where}: the transcript's output differs\n{out.getvalue()}"


def run_under_torchrun(page: str, code: list[Block], processes: int, tmp_path: Path) -> None:
    """The page's python blocks as one script under torchrun (gloo processes on this machine)."""
    lines = [""] * max(b.line + b.text.count("\n") for b in code)
    for b in code:  # each block at its own lines of the page: tracebacks give page lines
        lines[b.line : b.line + b.text.count("\n")] = b.text.splitlines()
    script = tmp_path / "snippet.py"
    script.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, f"{page} under torchrun:\n{done.stderr[-3000:]}"


# ----------------------------------------------------------------------------------------------------- shell


class _Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args``: the script's arguments parsed; stop before it runs."""


@contextlib.contextmanager
def _restored():
    """Undo what importing a script may change in this process (its sys.path additions, environment, threads)."""
    path, environ, threads = list(sys.path), dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)


def parse_with(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{what}: its parser refuses {shlex.join(argv)!r} (exit {exc.code}):\n{err.getvalue()}")


def check_script(path: str, argv: list[str], what: str) -> None:
    """``python SCRIPT ...``: the script exists, and its own argparse parser accepts the arguments; the script runs
    up to its ``parse_args`` call and no further."""
    script = ROOT / path
    assert script.is_file(), f"{what}: no file {path} in the checkout"
    text = script.read_text()
    if "parse_args" not in text and not re.search(r"\bimport main\b", text):  # no parser: it would just run
        assert not [a for a in argv if a.startswith("-")], f"{what}: {path} takes no options, got {argv}"
        return
    original = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    err = io.StringIO()
    with (_restored(), mock.patch.object(argparse.ArgumentParser, "parse_args", parse),
          mock.patch.object(sys, "argv", [str(script), *argv]),
          contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO())):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except _Parsed:
            return
        except SystemExit as exc:
            pytest.fail(f"{what}: {path}'s parser refuses {shlex.join(argv)!r} (exit {exc.code}):\n{err.getvalue()}")
    pytest.fail(f"{what}: {path} ran without parsing its arguments")


def check_experiment(argv: list[str], what: str) -> None:
    """``python -m relpos.experiment [tasks] ...`` (also under torchrun): the experiment's own parser."""
    from relpos.experiment.cli import build_parser

    tasks = bool(argv) and argv[0] == "tasks"
    parse_with(build_parser(tasks), argv[1:] if tasks else argv, what)


def run_relpos(argv: list[str], what: str) -> str | None:
    """``relpos ...``: parsed by the CLI's parser; ``relpos buckets`` and ``relpos plot`` also run (in the temporary
    current directory), and what they print is returned."""
    from relpos.tools.cli import build_parser, main

    args = parse_with(build_parser(), argv, what)
    if args.command not in RUN_RELPOS or (args.command == "plot" and not _importable(EXTRA_PROBES["plot"])):
        return None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code in (0, None), f"{what}: {shlex.join(['relpos', *argv])} exited {code}"
    if args.command == "plot":
        assert Path(args.output).is_file(), f"{what}: relpos plot wrote no {args.output}"
    return out.getvalue()


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def check_pip(argv: list[str], what: str) -> None:
    """``pip install ...``: every extra named (``relpos[hf]``, ``-e ".[dev,jax]"``) exists in pyproject.toml."""
    for word in argv:
        m = re.fullmatch(r"(?:relpos|\.)\[([\w,-]+)\]", word)
        if m:
            unknown = set(m.group(1).split(",")) - EXTRAS
            assert not unknown, f"{what}: no extra {sorted(unknown)} in pyproject.toml ({word})"


def check_pytest(argv: list[str], what: str) -> None:
    """``python -m pytest ...``: accepted; the test files it names exist."""
    for word in argv:
        path = word.split("::")[0]
        if path.startswith("tests/") or path.startswith("src/"):
            assert (ROOT / path).exists(), f"{what}: pytest is given {path}, which does not exist"


def check_python(argv: list[str], what: str) -> None:
    if argv[:2] == ["-m", "pip"]:
        check_pip(argv[2:], what)
    elif argv[:2] == ["-m", "pytest"]:
        check_pytest(argv[2:], what)
    elif argv[:2] == ["-m", "relpos.experiment"]:
        check_experiment(argv[2:], what)
    elif argv[:2] == ["-m", "relpos"] or argv[:2] == ["-m", "relpos.tools.cli"]:
        run_relpos(argv[2:], what)
    elif argv[:1] == ["-c"]:
        ast.parse(argv[1], f"{what} (python -c)")
    elif argv and argv[0].endswith(".py"):
        check_script(argv[0], argv[1:], what)
    else:
        pytest.fail(f"{what}: python {shlex.join(argv)}: not a kind of command this test knows (tests/test_docs_code.py)")


def check_torchrun(argv: list[str], what: str) -> None:
    """``torchrun [options] (-m relpos.experiment | SCRIPT) ...``: torchrun's own parser, then the program's."""
    from torch.distributed.run import get_args_parser

    args = parse_with(get_args_parser(), argv, f"{what} (torchrun)")
    if args.module:
        assert args.training_script == "relpos.experiment", f"{what}: torchrun -m {args.training_script}: not the experiment"
        check_experiment(args.training_script_args, what)
    else:
        check_script(args.training_script, args.training_script_args, what)


def commands(text: str, where: str) -> list[list[str]]:
    """The simple commands of a shell text: continuations joined, comments and redirections dropped, split at
    ``&&``, ``||``, ``;``, ``|`` and newlines, ``VAR=value`` prefixes removed."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s\d*>&\d+|\s\d*>>?\s*[^\s&|;]+", " ", line)  # > file, 2>&1
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError as exc:  # an unclosed quote: not a shell line
            pytest.fail(f"{where}: {line.strip()!r} is not a shell command ({exc}); output or a formula: fence it ```text")
        words: list[str] = []
        for token in [*tokens, ";"]:
            if token in ("&&", "||", ";", "|", "&"):
                while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                    words.pop(0)
                if words:
                    found.append(words)
                words = []
            else:
                words.append(token)
    return found


def check_command(words: list[str], what: str) -> str | None:
    """One command, by program; returns what it printed when it ran."""
    program, argv = words[0], words[1:]
    if program == "relpos":
        return run_relpos(argv, what)
    if program in ("python", "python3"):
        check_python(argv, what)
    elif program == "torchrun":
        check_torchrun(argv, what)
    elif program == "pip":
        check_pip(argv, what)
    elif program not in ACCEPTED:
        pytest.fail(f"{what}: {program!r} is not a command this test knows: check it in tests/test_docs_code.py, "
                    "or, if the block is not commands, fence it ```text (output, a tree) or ```console (a transcript "
                    "with $ prompts)")
    return None


def check_shell(block: Block) -> None:
    for words in commands(block.text, block.where):
        check_command(words, f"{block.where}: {shlex.join(words)}")


def check_console(block: Block) -> None:
    """``$ command`` lines, each followed by its output; the output of a command that runs must match."""
    chunks = re.split(r"^\$ ", block.text, flags=re.M)
    assert not chunks[0].strip(), f"{block.where}: a console block starts with a '$ ' prompt"
    for chunk in chunks[1:]:
        command, _, expected = chunk.partition("\n")
        while command.endswith("\\"):
            more, _, expected = expected.partition("\n")
            command = command[:-1] + " " + more
        printed = None
        for words in commands(command, block.where):
            printed = check_command(words, f"{block.where}: {shlex.join(words)}")
        if printed is not None and expected.strip():
            pattern = "".join(r"(?:.*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"[ \t]*\n"
                              for line in expected.strip("\n").splitlines())
            assert re.fullmatch(pattern, printed.rstrip("\n") + "\n"), \
                f"{block.where}: $ {command} printed\n{printed}\nnot\n{expected}"


# ------------------------------------------------------------------------------------------------------ test


@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes stays out of the checkout
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    unfenced = indented_code(page)
    assert not unfenced, f"{page}: indented code blocks (fence them, ```bash or ```text): {unfenced}"
    found = blocks(page)
    languages = {b.lang for b in found} - SHELL - {"python", "pycon", "console", "text"}
    assert not languages, f"{page}: fences in {sorted(languages)}: use python, pycon, bash, console or text"
    code = [b for b in found if b.lang in ("python", "pycon")]
    for block in code:
        if block.lang == "python":
            ast.parse(source(block), block.page)  # a syntax error names its page line before anything runs
        check_extras(block)
    for block in found:
        if block.lang in SHELL:
            check_shell(block)
        elif block.lang == "console":
            check_console(block)
    torchrun = TORCHRUN_MARK.match(code[0].text) if code else None
    if torchrun:
        run_under_torchrun(page, code, int(torchrun.group(1)), tmp_path)
        return
    namespace: dict = {"__name__": "__docs__"}
    torch.manual_seed(0)
    for block in code:
        (run_python if block.lang == "python" else run_pycon)(block, namespace)
