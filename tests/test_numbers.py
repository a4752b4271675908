"""One source for the numbers the guides share (docs/numbers.toml, titan_tpu/tools/numbers.py).

A page states a shared number as a link to its row of docs/numbers.md; these tests fail when a link
shows another value than the source, when a page types a number that should come from the source
(each entry's `typed` patterns: an explicit list of claims, not a scan of every digit), when an
entry drawn from a generated table no longer equals that table, and when docs/numbers.md is not
what the source renders."""

from __future__ import annotations

import pytest

from titan_tpu.tools import numbers as shared

ROOT = shared.ROOT
# Pages that keep history or are generated: old values there are records, not claims.
RECORDS = {"docs/numbers.md", "docs/decisions.md", "docs/log.md", "docs/planner_log.md", "docs/hf_models.md",
           "docs/model_compatibility.md", "docs/playbook_tables.md"}
ALL_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "skills").rglob("*.md"))]
PAGES = [p for p in ALL_PAGES if str(p.relative_to(ROOT)) not in RECORDS]


@pytest.fixture(scope="module")
def source():
    return shared.load()


def test_numbers_page_is_rendered_from_the_source(source):
    assert shared.PAGE.read_text() == shared.render(source), "run: python -m titan_tpu.tools.numbers"


def test_links_show_the_source_value(source):
    errors = [e for page in ALL_PAGES
              for e in shared.link_errors(page.read_text(), source, str(page.relative_to(ROOT)))]
    assert not errors, "\n".join(errors)


def test_no_page_types_a_shared_number(source):
    errors = [e for page in PAGES for e in shared.typed_errors(page.read_text(), source, str(page.relative_to(ROOT)))]
    assert not errors, "\n".join(errors)


def test_entries_drawn_from_generated_tables_match_them(source):
    drawn = [n for n in source.values() if n.table]
    assert drawn, "no entry is drawn from a generated table"
    wrong = [f"{n.key}: docs/numbers.toml says {n.value}, {n.table['file']} says {shared.table_value(n.table)}"
             for n in drawn if shared.table_value(n.table) != n.value]
    assert not wrong, "\n".join(wrong)


def test_every_entry_is_used(source):
    text = "\n".join(page.read_text() for page in PAGES)
    unused = [key for key in source if f"numbers.md#{key})" not in text]
    assert not unused, f"no page links {unused}; link them or remove them from docs/numbers.toml"


# The checker itself, on small pages.
FAKE = {"graph-over-eager": shared.Number(
    key="graph-over-eager", claim="graph over eager", value="1.10x", command="c", date="d", cpu="x",
    typed=(r"graph mode runs (\d\.\d+x) eager",))}


def test_a_typed_number_is_caught():
    errors = shared.typed_errors("Here graph mode runs 0.92x eager.", FAKE, "p.md")
    assert len(errors) == 1 and "[1.10x](numbers.md#graph-over-eager)" in errors[0]


def test_a_linked_number_passes_and_a_stale_link_is_caught():
    good = "graph mode runs [1.10x](numbers.md#graph-over-eager) eager"
    assert not shared.typed_errors(good, FAKE, "p.md") and not shared.link_errors(good, FAKE, "p.md")
    stale = "graph mode runs [1.04x](numbers.md#graph-over-eager) eager"
    assert shared.link_errors(stale, FAKE, "p.md") == [
        "p.md:1: shows 1.04x for graph-over-eager; the source says 1.10x"]
    assert shared.link_errors("[3](docs/numbers.md#no-such)", FAKE, "p.md")


def test_a_generated_table_value_is_read(tmp_path):
    (tmp_path / "t.md").write_text("| | a | b |\n| --- | --- | --- |\n| passed, of 9 types | 7 | 5 |\n")
    spec = {"file": "t.md", "pattern": r"^\| passed, of \d+ types \| \d+ \| (\d+) \|"}
    assert shared.table_value(spec, tmp_path) == "5"
    with pytest.raises(ValueError, match="matches 0 times"):
        shared.table_value({"file": "t.md", "pattern": r"^\| failed (\d+)"}, tmp_path)


def test_playbook_quotes_its_generated_table():
    """playbook.md's "Measured here" lines quote docs/playbook_tables.md: every two-decimal ratio there
    (other than a shared number's link or a range) is in the table, so regenerating the table without
    updating the page fails."""
    import re

    table = (ROOT / "docs" / "playbook_tables.md").read_text()
    page = (ROOT / "docs" / "playbook.md").read_text()
    bullets = re.findall(r"\n- \*\*Measured here:\*\*(.*?)(?=\n- \*\*)", page, re.S)
    assert len(bullets) >= 10
    missing = [(ratio, bullet.split(".")[0].strip()) for bullet in bullets
               for ratio in re.findall(r"(?<![-\d.\[])(\d\.\d\dx)\b", shared.LINK.sub("", bullet))
               if ratio not in table]
    assert not missing, f"playbook.md quotes ratios its table does not have: {missing}"
