"""The README is for users: at most 200 lines (the rest lives in docs/), and every file it links
to is in the repo."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 200, "README.md over 200 lines: move details to docs/"


def test_every_local_link_of_the_readme_exists():
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", README) if "://" not in t]
    assert targets, "the README links to docs/"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
