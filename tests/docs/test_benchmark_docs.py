"""docs/benchmarks.md is what benchmarks/report.py writes from benchmarks/results/*.json."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_report():
    spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load_report()


def test_benchmarks_page_is_what_the_report_writes():
    page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == report.render(), "docs/benchmarks.md is out of date: python benchmarks/report.py"


@pytest.fixture
def results(tmp_path):
    """A copy of the published result files."""
    for name in report.ORDER:
        shutil.copy(report.RESULTS / f"{name}.json", tmp_path)
    return tmp_path


def test_a_script_s_raw_output_is_not_published(results):
    page = report.render(results)
    (results / "bench_decode.json").write_text(json.dumps({"args": {}, "results": []}))
    assert report.render(results) == page


def test_a_section_missing_from_order_is_an_error(results):
    section = json.loads((results / "cpu_linear.json").read_text(encoding="utf-8"))
    (results / "new_section.json").write_text(json.dumps(section))
    with pytest.raises(ValueError, match="add new_section to ORDER"):
        report.render(results)


def test_a_row_that_does_not_fit_its_columns_is_an_error(results):
    path = results / "cpu_linear.json"
    section = json.loads(path.read_text(encoding="utf-8"))
    section["tables"][0]["rows"][0].append("extra")
    path.write_text(json.dumps(section))
    with pytest.raises(ValueError, match="cells under"):
        report.render(results)


def test_a_missing_section_is_an_error(results):
    (results / "cpu_sampling.json").unlink()
    with pytest.raises(ValueError, match="cpu_sampling.json: missing"):
        report.render(results)
