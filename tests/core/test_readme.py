"""The README is for users: at most 200 lines (the rest lives in docs/), every file it links to
is in the repo, and every code block works as written."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 200, "README.md over 200 lines: move details to docs/"


def test_every_local_link_of_the_readme_exists():
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", README) if "://" not in t]
    assert targets, "the README links to docs/"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def code_blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_has_no_indented_code_blocks():
    """Every code block is fenced with its language, so the tests below find and run it."""
    prose = re.sub(r"^```.*?^```", "", README, flags=re.S | re.M)
    assert not [line for line in prose.splitlines() if line.startswith("    ") and line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
def test_every_python_block_runs_as_written(index, tmp_path):
    """A fresh interpreter in an empty folder runs the block as it stands (its own imports and setup),
    as a reader pasting it would."""
    out = subprocess.run([sys.executable, "-c", code_blocks("python")[index]], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_shell_blocks_name_what_exists():
    """Each command of the README's shell blocks names a make target of the Makefile, a program the
    venv installs (``.venv/bin/X``: X comes with torch or this package's extras), or pip; and every
    file it names exists in the repository."""
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    commands = [line.split("#")[0].split() for block in code_blocks("bash") for line in block.splitlines()]
    for words in filter(None, commands):
        if words[0] == "make":
            assert words[1] in targets, words
        else:
            assert words[0] in ("pip", ".venv/bin/python", ".venv/bin/torchrun"), words
        for word in words:
            if word.startswith("configs/"):
                assert (ROOT / word).is_file(), word


def test_the_registry_names_are_generated_from_the_registry():
    """tools/readme_names.py writes the paragraph from the registry; the README holds what it writes
    (run ``python tools/readme_names.py`` after adding a name)."""
    spec = importlib.util.spec_from_file_location("readme_names", ROOT / "tools" / "readme_names.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.rewritten(README) == README, "README.md: run python tools/readme_names.py"
    assert tool.rewritten(README.replace("`lars`, ", "")) == README  # it restores a name left out


def test_the_registry_names_are_the_registrys():
    """The README's list of registry names is the registry's own (both tables), in its order."""
    from fused_optim.registry import list_distributed_optimizers, list_optimizers

    paragraph = README[README.index("Registry names"):].split("\n\n")[0]
    single, _, distributed = paragraph.split("):", 1)[1].partition("distributed:")
    names = lambda text: re.findall(r"`([a-z_0-9]+)`", text)  # noqa: E731
    assert names(single) == list_optimizers()
    assert names(distributed.split("The exact")[0]) == list_distributed_optimizers()
