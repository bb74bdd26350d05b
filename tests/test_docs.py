"""The README and the pages of docs/ link to files that exist, and to headings those files have; the paths, modules
and config fields they name exist."""

import ast
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


# Paths of ours, anywhere in a page (in backticks or not), and `module.name` / `section.field` in backticks.
PACKAGES = ("deployments", "encoders", "llm", "schemas", "tests", "bench", "demo", "docs")
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(PACKAGES)})/[\w./-]*\w)")
DOTTED = re.compile(r"`((?:deployments|encoders|llm|schemas|encoder|limits|image_urls|auth|video)(?:\.\w+)+)[`(:]")
GENERATED = ("demo/qwen2-vl-tiny",)  # `make checkpoint` builds it
REF_PAGES = [*PAGES, ROOT / "bench" / "README.md", ROOT / "demo" / "README.md"]


def _module_file(dotted: str) -> tuple[Path, list[str]] | None:
    """The longest prefix of `dotted` that is a module of ours, and the names after it."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                return source, parts[k:]
    return None


def _config_field(dotted: str) -> bool:
    """`llm.cpu_threads`, `encoder.cache_gib`, ...: a section of `args:` and one of its fields."""
    from schemas import AppArgs

    section, _, field = dotted.partition(".")
    model = AppArgs.model_fields.get(section)
    return model is not None and field.split(".")[0] in getattr(model.annotation, "model_fields", {})


def _top_level_names(source: Path) -> set[str]:
    """What a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def broken_references(page: Path) -> list[str]:
    text = page.read_text()
    bad = [p for p in PATH.findall(text) if not (ROOT / p).exists() and not p.startswith(GENERATED)]
    for dotted in DOTTED.findall(text):
        if dotted.endswith((".py", ".md", ".yaml")):  # a file's name, beside its folder's path
            continue
        found = _module_file(dotted)
        if found is not None and (not found[1] or found[1][0] in _top_level_names(found[0])):
            continue
        if not _config_field(dotted):
            bad.append(f"`{dotted}`")
    return bad


@pytest.mark.parametrize("page", REF_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_modules_and_config_fields_named_exist(page):
    """A path of ours (deployments/ingress/generate.py), a module or a name in one
    (`deployments.ray_private.object_ref`) or a config field (`llm.cpu_threads`) that a page names exists: a move or
    a rename that leaves a page behind fails here."""
    assert broken_references(page) == []


def test_a_stale_reference_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See llm/server.py, `encoders.server`, `llm.cpu_threadz` and `deployments.ray_private.nothing`.")
    assert len(broken_references(page)) == 4
