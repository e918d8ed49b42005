"""``python tools/readme_names.py``: writes the README's paragraph of registry names from the
registry (``list_optimizers()``, ``list_distributed_optimizers()``), the one source of the names;
``--check`` exits 1 when the README's paragraph is not what it would write.

The paragraph starts with "Registry names" and ends at the blank line after it; its last sentence
(a link to the update rules) is kept as it is.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
START = "Registry names"
TAIL = "The exact update rules are in\n[docs/algorithms.md](docs/algorithms.md) and in each class docstring."


def paragraph() -> str:
    """The paragraph the registry makes, wrapped at 100 columns like the rest of the README."""
    from fused_optim.registry import list_distributed_optimizers, list_optimizers

    quoted = lambda names: ", ".join(f"`{n}`" for n in names)  # noqa: E731
    text = (f"{START} (`create_optimizer`, `fused-optim list`, mmengine configs): {quoted(list_optimizers())}; "
            f"distributed: {quoted(list_distributed_optimizers())}.")
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False) + " " + TAIL


def rewritten(readme: str) -> str:
    """``readme`` with its registry-names paragraph replaced by :func:`paragraph`."""
    start = readme.index(START)
    end = readme.index("\n\n", start)
    return readme[:start] + paragraph() + readme[end:]


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = rewritten(text)
    if "--check" in argv:
        if new != text:
            print("README.md: the registry names are not the registry's; run python tools/readme_names.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
