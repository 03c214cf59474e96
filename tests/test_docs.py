"""The documentation stands on its own: every relative link in README.md and docs/*.md resolves
(files and #anchors), and no file of the repository names a document the repository lacks.

A reference to a missing page is a dead end for a reader, and a reference to a file outside the
repository (a sibling folder, a design note that was never committed) is one for everybody who
clones it; both are cheap to check, so they are checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".json"}
SKIP_DIRS = {".git", "__pycache__", "build", "dist", "wandb", "gpu_check_out"}


def _repo_files() -> list[Path]:
    """Tracked files when this is a git checkout (so build outputs never count), else a walk."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                             timeout=60).stdout.decode()
        files = [ROOT / f for f in out.split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            files += [Path(dirpath) / f for f in filenames]
    return [f for f in files if f.is_file()]


def _text_lines():
    """(file, line number, line) for every line of every tracked text file."""
    for f in _repo_files():
        if f.suffix in TEXT_SUFFIXES or (f.suffix == "" and f.parent.name == ".ci"):
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for no, line in enumerate(text.splitlines(), 1):
                yield f, no, line


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


# ------------------------------------------------------------------------------ markdown anchors
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = text.strip().lower()
    keep = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LN":
            keep.append(ch)
    return "".join(keep).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, seen, in_code = set(), {}, False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_code:
            base = _slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    anchors.update(re.findall(r'<a\s+(?:name|id)="([^"]+)"', page.read_text(encoding="utf-8")))
    return anchors


def _links(page: Path):
    """(line number, target) of every markdown link and image outside code blocks and code spans."""
    in_code = False
    for no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            yield no, target


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for page in _doc_pages():
        for no, target in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{no}: ({target})"
            if not dest.exists():
                broken.append(f"{where} -> no file {path}")
            elif anchor and dest.suffix == ".md" and anchor.lower() not in _anchors(dest):
                broken.append(f"{where} -> {dest.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


# ------------------------------------------------------------------------- documents named anywhere
_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
_MD_NAME = re.compile(r"(?<![\w/.-])((?:\.\.?/)*[\w.-]+(?:/[\w.-]+)*\.md)\b")
_OUTSIDE = re.compile(r"\.\./" + "shared")  # a folder beside the repository: never part of a clone


_REPO_PATH = re.compile(r"(?<![\w./-])((?:megalite|tools|benchmarks|tests|examples|docs)/[\w./-]*\w"
                        r"\.(?:py|sh|md|png|json))\b")


def test_no_file_names_a_document_the_repository_lacks():
    """Every page name ending in ``.md`` that a file mentions exists, relative to that file or to
    the repository root (a bare page name like ``zero3.md`` in docs/ counts as docs/zero3.md), and
    nothing points outside the repository."""
    missing = []
    for f, no, line in _text_lines():
        rel = f.relative_to(ROOT)
        line = _URL.sub("", line)
        if _OUTSIDE.search(line):
            missing.append(f"{rel}:{no}: points outside the repository: {line.strip()}")
        for name in _MD_NAME.findall(line):
            candidates = [f.parent / name, ROOT / name, ROOT / "docs" / name]
            if not any(c.resolve().is_file() and ROOT in c.resolve().parents
                       for c in candidates):
                missing.append(f"{rel}:{no}: names {name}, which the repository lacks")
    assert not missing, "references to missing documents:\n" + "\n".join(missing)


def test_every_repository_path_a_file_names_exists():
    """A path into the repository (``megalite/...py``, ``tools/...``, ``docs/...``) named in code,
    tests or docs exists: a renamed or deleted module must not leave its readers a dead end."""
    missing = []
    for f, no, line in _text_lines():
        for path in _REPO_PATH.findall(_URL.sub("", line)):
            if not (ROOT / path).exists():
                missing.append(f"{f.relative_to(ROOT)}:{no}: names {path}, which does not exist")
    assert not missing, "paths to missing files:\n" + "\n".join(missing)


@pytest.mark.parametrize("heading, slug", [
    ("Communication (3Ψ)", "communication-3ψ"),
    ("Stage 3: parameters sharded too", "stage-3-parameters-sharded-too"),
    ("`pretrain.py` flags", "pretrainpy-flags"),
])
def test_slug_follows_github(heading, slug):
    assert _slug(heading) == slug
