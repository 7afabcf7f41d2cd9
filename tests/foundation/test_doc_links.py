"""The repository explains itself: every relative link in its Markdown leads to a file of the repository (and to a
heading there, when it names one), and no file cites a document that is not in the repository.

Files: what git tracks plus what it would track (untracked, not ignored), so a new page is checked before its
first commit; without git (an unpacked sdist), every file under the root except virtual environments and caches.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[2]

# Documents that live outside the repository and must never be cited by it (spelled in pieces, so that this
# file does not cite them either).
OUTSIDE_DOCS = ("ARCHITECTURE" + ".md", "notes/" + "vllm-cpu.md", "notes/" + "anchors.md", "../" + "shared/",
    "shared/" + "notes/")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", ".cfg", ".ini"}
TEXT_NAMES = {"Makefile"}
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", "runs", ".work"}

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target), target optionally in <...> and followed by a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)", re.M)  # [label]: target
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def repo_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True).stdout
        names = [n for n in out.decode().split("\0") if n]
        return sorted({REPO / n for n in names if (REPO / n).is_file()})
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in REPO.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.relative_to(REPO).parts))


def is_text_file(path: Path) -> bool:
    return path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES or path.name.startswith("Dockerfile")


def without_code(markdown: str) -> str:
    """Markdown with fenced blocks and code spans blanked: a `[x](y)` inside code is not a link."""
    markdown = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)
    return CODE_SPAN.sub("", markdown)


def links(markdown: str) -> list[str]:
    text = without_code(markdown)
    targets = [m.group(1) for m in LINK.finditer(text)] + REFERENCE.findall(text)
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in targets]


def is_relative(target: str) -> bool:
    """Not a URL (http:, mailto:, ...), not an anchor of the same page, not rooted."""
    return not (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")) or not target)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[`*_~]|<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(md_files: list[Path], root: Path = REPO) -> list[str]:
    problems = []
    for md in md_files:
        for target in links(md.read_text(encoding="utf-8")):
            if not is_relative(target):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / unquote(path)).resolve() if path else md
            where = f"{md.relative_to(root)}: [...]({target})"
            if not dest.exists():
                problems.append(f"{where}: no such file or folder")
            elif root.resolve() not in dest.parents and dest != root.resolve():
                problems.append(f"{where}: outside the repository")
            elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest.read_text(
                encoding="utf-8")):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def test_every_relative_link_in_the_markdown_leads_somewhere():
    md_files = [p for p in repo_files() if p.suffix == ".md"]
    assert any(p.name == "README.md" and p.parent == REPO for p in md_files)
    assert sum(len(links(p.read_text(encoding="utf-8")))
        for p in md_files) > 50, "the link finder found (almost) no links"
    assert broken_links(md_files) == []


def outside_citations(files: list[Path], root: Path = REPO) -> list[str]:
    found = []
    for path in files:
        if not is_text_file(path):
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(root)}:{lineno}: {needle}" for needle in OUTSIDE_DOCS if needle in line]
    return found


def test_no_file_cites_a_document_outside_the_repository():
    assert outside_citations(repo_files()) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A broken link, a link to a missing heading and a citation of an outside document are each found;
    links in code, URLs and a good relative link are not flagged."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## The life of a lease\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[good](docs/page.md) [anchor](docs/page.md#the-life-of-a-lease) [self](#top) [web](https://example.org/x.md)\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#no-such-heading) ![img](<docs/none.png>)\n"
        "`[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n"
    )
    problems = broken_links([readme, tmp_path / "docs" / "page.md"], root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "[...](docs/missing.md): no such file or folder",
        "[...](docs/page.md#no-such-heading): no heading with anchor #no-such-heading",
        "[...](docs/none.png): no such file or folder",
    ]
    assert slug(
        "What the verifier establishes, and what it does not") == "what-the-verifier-establishes-and-what-it-does-not"
    assert slug("The worker's vLLM engine") == "the-workers-vllm-engine"
    assert slug("Installing before `swarmrl` is on PyPI") == "installing-before-swarmrl-is-on-pypi"

    cites = tmp_path / "trainer.py"
    cites.write_text('"""The objective (see ' + OUTSIDE_DOCS[0] + ')."""\nx = 1  # ' + OUTSIDE_DOCS[1] + "\n")
    (tmp_path / "data.json").write_text('"' + OUTSIDE_DOCS[0] + '"')  # not a text file we check
    assert outside_citations([cites, tmp_path / "data.json", readme], root=tmp_path) == [
        f"trainer.py:1: {OUTSIDE_DOCS[0]}", f"trainer.py:2: {OUTSIDE_DOCS[1]}"]
