"""The published-run benchmark (benchmarks/cost_model_published.py): one row end to end, and its doc writer."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cost_model_published", ROOT / "benchmarks" / "cost_model_published.py")
published = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = published  # dataclasses look their module up
_spec.loader.exec_module(published)


def test_rows_are_consistent():
    rows = published.published_rows()
    assert len(rows) == 36
    for row in rows:
        assert row.dp * row.tp * row.pp == row.gpus, row.label
        assert row.global_batch % (row.dp * row.micro_batch) == 0, row.label
        assert sum(published.stage_layers(row)) == row.model["n_layers"] + 2, row.label


def test_megatron_39b_row_is_within_ten_percent():
    """Narayanan et al. 2021 Table 1, 39.1B on 512 A100s (t=8, p=2): 138 TFLOP/s per GPU measured."""
    row = next(r for r in published.published_rows() if r.label == "39.1B")
    e = published.run(row, published.TRAINING_KERNEL_EFFICIENCY)
    assert e.fits
    assert e.predicted.step_time_s == pytest.approx(row.measured_step_s, rel=0.10)


def test_write_section_keeps_the_other_sections(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## Graph capture\n\ntheirs\n")
    published.write_section(doc, f"{published.SECTION}\n\nmine v1\n")
    published.write_section(doc, f"{published.SECTION}\n\nmine v2\n")
    text = doc.read_text()
    assert "## Graph capture\n\ntheirs\n" in text and "mine v2" in text and "mine v1" not in text
    doc.write_text(text + "\n## Later section\n\nalso theirs\n")
    published.write_section(doc, f"{published.SECTION}\n\nmine v3\n")
    assert "also theirs" in doc.read_text() and "mine v3" in doc.read_text()
