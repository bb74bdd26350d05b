"""The README and the pages of docs/ link to files that exist, and to headings those files have."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def local_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readme_links_the_manual():
    targets = {t.split("#")[0] for t in local_links(ROOT / "README.md")}
    assert {
        "docs/api.md",
        "docs/configuration.md",
        "docs/cluster.md",
        "docs/operations.md",
        "docs/design.md",
        "docs/engine.md",
        "docs/clients.md",
        "BENCHMARKS.md",
    } <= targets


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: {broken}"


def test_slug_follows_github():
    assert (
        slug("Front door: Serve's proxy, direct ingress or HAProxy")
        == "front-door-serves-proxy-direct-ingress-or-haproxy"
    )
    assert slug("The `deployments:` section") == "the-deployments-section"
