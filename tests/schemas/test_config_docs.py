"""docs/configuration.md documents every `args:` field of serve_config.yaml with the description the code has."""

import re

import pytest

from schemas import config_docs
from schemas.config import AppArgs

PAGE = config_docs.PAGE.read_text()


def _rows() -> dict[str, list[str]]:
    """The committed page's table rows, by field path: {path: [type, default, range, description]}."""
    rows = {}
    for line in PAGE.splitlines():
        if m := re.match(r"\| `([a-z_.]+)` \| (.*) \|$", line):
            rows[m[1]] = [c.strip() for c in re.split(r"(?<!\\)\|", m[2])]
    return rows


FIELDS = [(path, field) for _, _, fields in config_docs.sections() for path, field in fields]


@pytest.mark.parametrize("path,field", FIELDS, ids=[p for p, _ in FIELDS])
def test_every_field_is_documented_with_its_description(path, field):
    rows = _rows()
    assert path in rows, f"args field {path} is missing from {config_docs.PAGE.name}: run `make docs`"
    assert rows[path][3] == config_docs._cell(field.description), (
        f"{path}: the page says {rows[path][3]!r}, schemas/config.py says {field.description!r}: run `make docs`"
    )


def test_no_documented_field_is_gone():
    gone = set(_rows()) - {p for p, _ in FIELDS}
    assert not gone, f"documented but not in schemas/config.py: {sorted(gone)}: run `make docs`"


def test_every_field_has_a_description():
    assert all(field.description for _, field in FIELDS), [p for p, f in FIELDS if not f.description]


def test_sections_cover_every_field_of_every_model():
    expected = set()
    for name, field in AppArgs.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        expected |= {f"{name}.{n}" for n in sub} if sub else {name}
    assert {p for p, _ in FIELDS} == expected


def test_committed_tables_equal_the_generated_ones():
    """Types, defaults and ranges too: the page is what `make docs` writes."""
    assert config_docs.splice(PAGE, config_docs.render()) == PAGE, "docs/configuration.md is stale: run `make docs`"


def test_splice_keeps_the_prose_around_the_tables():
    page = f"intro\n{config_docs.BEGIN}\nold\n{config_docs.END}\noutro\n"
    assert config_docs.splice(page, "NEW") == "intro\nNEW\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        config_docs.splice("no markers", "NEW")
