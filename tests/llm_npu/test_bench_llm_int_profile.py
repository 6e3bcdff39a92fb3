"""bench/llm_int_profile.py's results-file handling: its section of bench/results/llm_npu.md is
replaced in place (or appended), and bench/llm_npu.py, which rewrites the file, gets it back
unchanged (kept_section). Hand-written documents are the oracle."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import llm_int_profile as bench  # noqa: E402

H = bench.HEADING


def test_section_replaced_between_headings_and_appended_when_missing():
    doc = f"# Title\n\ntext\n\n{H}\n\nold table\n\n## Next\n\nkept\n"
    new = f"{H}\n\nnew table\n"
    assert bench.replace_section(doc, new) == f"# Title\n\ntext\n\n{H}\n\nnew table\n## Next\n\nkept\n"
    assert bench.replace_section(f"# T\n\n{H}\n\nold\n", new) == f"# T\n\n{new}"
    assert bench.replace_section("# T\n", new) == f"# T\n\n{new}"
    assert bench.replace_section("", new) == new


def test_kept_section_is_what_llm_npu_appends(tmp_path):
    p = tmp_path / "llm_npu.md"
    assert bench.kept_section(str(p)) == ""
    p.write_text(f"# T\n\n{H}\n\nrows\n\n## After\n\nx\n")
    assert bench.kept_section(str(p)) == f"{H}\n\nrows\n\n"
    p.write_text(f"# T\n\n{H}\n\nrows\n")
    assert bench.kept_section(str(p)) == f"{H}\n\nrows\n"
    p.write_text("# T\n\nno section\n")
    assert bench.kept_section(str(p)) == ""
