"""tools/bench_tables.py: every table under docs/benchmarks/ is what its committed JSON gives, and a number changed
in a JSON (or in a page) is caught."""

import importlib.util
import json
import pathlib
import shutil
import sys

import pytest

from relpos._io import GENERATED_END, generated_begin, generated_region, write_generated

ROOT = pathlib.Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "tools" / "bench_tables.py")
bench_tables = importlib.util.module_from_spec(_spec)
sys.modules["bench_tables"] = bench_tables  # its dataclasses look their module up by name
_spec.loader.exec_module(bench_tables)


@pytest.fixture
def docs(tmp_path):
    """A copy of docs/benchmarks/ (and of the pages outside it that hold a region, such as docs/distributed.md)."""
    copy = tmp_path / "docs" / "benchmarks"
    shutil.copytree(ROOT / "docs" / "benchmarks", copy)
    for table in bench_tables.all_tables():
        if table.page.startswith("../"):
            shutil.copy(ROOT / "docs" / "benchmarks" / table.page, copy / table.page)
    return copy


def test_committed_tables_match_their_json(capsys):
    assert bench_tables.main(["--check"]) == 0, capsys.readouterr().out
    assert len(bench_tables.all_tables()) > 60


def test_a_changed_number_in_a_json_is_found_and_fixed(docs):
    report = json.loads((docs / "t5-family/t5-target.json").read_text())
    row = next(r for r in report["results"] if r["mode"] == "forward" and r["variant"] == "relpos")
    row["ms"] *= 2  # relpos's forward twice as slow: its table and every headline quoting it change
    (docs / "t5-family/t5-target.json").write_text(json.dumps(report))
    found = bench_tables.problems(docs)
    assert {line.split(":")[0] for line in found} == {"t5-family/t5-target.md", "t5-family/index.md", "index.md", "../../README.md"}, found
    assert bench_tables.main(["--check", "--docs", str(docs)]) == 1
    assert bench_tables.main(["--docs", str(docs)]) == 0  # rewrites the three regions
    assert bench_tables.problems(docs) == []
    assert f"{row['ms']:.0f} ms" in (docs / "t5-family/t5-target.md").read_text()


def test_a_number_edited_by_hand_in_a_page_is_found(docs):
    page = docs / "distributed/ring.md"
    text = page.read_text()
    ratio = f"{json.loads((docs / 'distributed/ring.json').read_text())['summary'][0]['time_ratio']:.2f}"
    page.write_text(text.replace(f"| {ratio} |", "| 0.01 |", 1))
    assert [line.split(":")[0] for line in bench_tables.problems(docs)] == ["distributed/ring.md"]
    page = docs / "../distributed.md"  # the same table quoted in docs/distributed.md is checked too
    page.write_text(page.read_text().replace(f"| {ratio} |", "| 0.01 |", 1))
    assert [line.split(":")[0] for line in bench_tables.problems(docs)] == ["distributed/ring.md", "../distributed.md"]


def test_a_table_without_its_json_or_a_json_without_a_table_is_found(docs):
    (docs / "vision/sam.json").unlink()
    (docs / "vision/extra.json").write_text("{}")
    found = "\n".join(bench_tables.problems(docs))
    assert "vision/sam.md (vision/sam.json): cannot render" in found
    assert "vision/extra.json: no table is rendered from it" in found


def test_a_region_no_spec_renders_is_found(docs):
    with open(docs / "vision/index.md", "a") as page:
        page.write(f"\n{generated_begin('nothing.json')}\n| 1 |\n{GENERATED_END}\n")
    assert any("a region no spec renders" in line for line in bench_tables.problems(docs))


def test_write_generated_replaces_only_its_region(tmp_path):
    """A benchmark's --markdown into an existing page keeps the prose around its region; a new page is the region."""
    page = tmp_path / "t.md"
    write_generated(page, "| a |\n", "t.json")
    assert page.read_text() == f"{generated_begin('t.json')}\n| a |\n{GENERATED_END}\n"
    page.write_text("# Title\n\nprose\n\n" + page.read_text() + "\nmore prose\n")
    write_generated(page, "| b |", tmp_path / "t.json")
    text = page.read_text()
    assert text.startswith("# Title\n\nprose\n\n") and text.endswith("\nmore prose\n")
    assert generated_region(text, generated_begin("t.json")) == "| b |\n"
    write_generated(page, "plain", None)  # no JSON written: the page is the text alone
    assert page.read_text() == "plain"
