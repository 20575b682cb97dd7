"""`python -m bench all`'s report: reading the benchmarks' tables back, the SVG charts, the generated section."""

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from charts import bar_chart  # noqa: E402
from report import BEGIN, END, Result, markdown_tables, number, replace_section, write_report  # noqa: E402
from suite import SUITE  # noqa: E402

CEILING = """# The machine's ceiling: AMD EPYC, 2 threads

## SmolLM2-135M-Instruct.Q4_1.gguf (prompt 128 tokens per sequence, 16 steps)

| rows a step (B) | ms a step | step / 1 row | ms a row | aggregate tok/s |
|-----------------|-----------|--------------|----------|-----------------|
| 1               | 5.7       | 1.00         | 5.7      | 176.8           |
| 4               | 17.6      | 3.11         | 4.4      | 227.4           |
| broken row |
"""
CONCURRENCY = """machine: x · smollm2-135m

| clients | serialized tok/s | llama-server -np N tok/s | reame tok/s | reame / serialized |
|---|---|---|---|---|
| 1 | 150.0 | 160.0 | 158.0 | 1.05 |
| 4 | 150.0 | 210.0 | 220.5 | 1.47 |
"""


def bench(name):
    return next(b for b in SUITE if b.name == name)


def test_tables_are_read_back_with_their_heading_and_malformed_rows_dropped():
    tables = markdown_tables(CEILING + "\n| a | b |\n| not a separator |\n")
    assert len(tables) == 1
    table = tables[0]
    assert table.heading.startswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert table.rows == [["1", "5.7", "1.00", "5.7", "176.8"], ["4", "17.6", "3.11", "4.4", "227.4"]]
    assert table.column("aggregate tok/s") == 4 and table.column("nothing") is None


@pytest.mark.parametrize("cell, value", [("1.23 (1.1–1.3)", 1.23), ("60x", 60.0), ("1,234.5", 1234.5),
                                         ("-0.5", -0.5), ("n/a", None), ("", None)])
def test_number_takes_the_first_number_of_a_cell(cell, value):
    assert number(cell) == value


def test_a_bar_chart_is_svg_with_one_bar_per_known_value():
    svg = bar_chart("T <&>", ["a", "b"], {"one": [1.0, None], "two": [2.0, 3.5]}, "tok/s", reference=1.0)
    root = ElementTree.fromstring(svg)
    bars = [rect for rect in root.iter("{http://www.w3.org/2000/svg}rect") if rect.get("height") == "12"
            and rect.get("y") != "32"]  # not the legend's swatches
    assert len(bars) == 3
    texts = [text.text for text in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "T <&>" in texts and "n/a" in texts and "3.5" in texts


@pytest.mark.parametrize("categories, series", [([], {"a": []}), (["a"], {}), (["a"], {"s": [1.0, 2.0]}),
                                                (["a"], {"s": [-1.0]})])
def test_a_chart_refuses_what_it_cannot_draw(categories, series):
    with pytest.raises(ValueError):
        bar_chart("t", categories, series, "u")


def test_the_generated_section_is_inserted_once_then_replaced_and_the_analyses_stay():
    document = "# Benchmarks\n\nIntro paragraph.\n\n## Hand-written analysis\n\nKept.\n"
    first = replace_section(document, f"{BEGIN}\nrun one\n{END}\n")
    assert first.index("Intro paragraph.") < first.index("run one") < first.index("## Hand-written analysis")
    second = replace_section(first, f"{BEGIN}\nrun two\n{END}\n")
    assert "run one" not in second and second.count(BEGIN) == 1 and second.endswith("Kept.\n")
    assert second.replace("run two", "run one") == first


def test_a_report_writes_its_charts_and_the_ceiling_beside_the_concurrency(tmp_path):
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\nIntro.\n\n## Old analysis\n")
    results = [Result(bench("ceiling"), ["bench/ceiling.py", "--model", "smollm2-135m"], CEILING, 0, 60.0),
               Result(bench("concurrency"), ["bench/concurrency.py"], CONCURRENCY, 0, 90.0),
               Result(bench("arca"), ["bench/arca.py"], "Traceback: boom", 1, 3.0)]
    facts = {"date": "2026-12-01", "cpu": "AMD EPYC", "cores": "2", "arch": "x86_64", "kernel flags": "avx2",
             "python": "3.11.7", "llama.cpp": "0c1e57098"}
    text = write_report(results, facts, True, 153.0, tmp_path)
    written = (tmp_path / "BENCHMARKS.md").read_text()
    assert text in written and written.endswith("## Old analysis\n")
    assert "python -m bench all --quick" in text and "**Failed (exit 1) after 3 s.**" in text
    assert "#### SmolLM2-135M-Instruct.Q4_1.gguf" in text  # the benchmark's own headings sit under its own
    assert sorted(path.name for path in (tmp_path / "bench").iterdir()) == ["ceiling.svg", "concurrency.svg"]
    concurrency = (tmp_path / "bench" / "concurrency.svg").read_text()
    assert "ceiling: N rows a step, no drafts" in concurrency and "227.4" in concurrency and "220.5" in concurrency
    # each chart under the benchmark it draws
    assert text.index("python bench/ceiling.py") < text.index("![ceiling.svg]") < text.index("bench/concurrency.py") \
        < text.index("![concurrency.svg]") < text.index("bench/arca.py")


def test_the_run_a_report_replaces_moves_to_the_history_of_its_date(tmp_path):
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\nIntro.\n\n## How each benchmark works\n")
    facts = {"date": "2026-12-01", "cpu": "AMD EPYC", "cores": "2", "arch": "x86_64", "kernel flags": "avx2",
             "python": "3.11.7", "llama.cpp": "0c1e57098"}
    first = [Result(bench("concurrency"), ["bench/concurrency.py"], CONCURRENCY, 0, 90.0)]
    write_report(first, facts, True, 90.0, tmp_path)
    assert not (tmp_path / "bench" / "history").exists(), "nothing to move the first time"
    second = [Result(bench("concurrency"), ["bench/concurrency.py"], CONCURRENCY.replace("220.5", "230.5"), 0, 90.0)]
    write_report(second, {**facts, "date": "2026-12-02"}, False, 90.0, tmp_path)
    history = (tmp_path / "bench" / "history" / "2026-12-01.md").read_text()
    assert history.startswith("# Benchmarks, 2026-12-01\n\n## A run of `python -m bench all --quick`")
    assert "220.5" in history and "230.5" not in history and "![" not in history
    written = (tmp_path / "BENCHMARKS.md").read_text()
    assert "230.5" in written and "220.5" not in written and written.endswith("## How each benchmark works\n")


PREFIX = """| prefix tokens | server | case | TTFT s | vs its cold |
|---|---|---|---|---|
| 1000 | reame | cold | 3.088 | 1x |
| 1000 | reame | same process (slot) | 0.108 | 29x |
| 1000 | reame | new process, disk (page cache) | 0.107 | 29x |
| 1000 | llama-server | cold | 3.049 | 1x |
| 1000 | llama-server | warm beside: new process, disk (page cache) | 0.103 | 30x |
| 1000 | llama-server | same process (slot) | 0.102 | 30x |
"""


def test_the_ttft_chart_sets_each_warm_case_beside_llama_servers_warm_slot_of_the_same_minute():
    from report import ttft_chart
    svg = ttft_chart([Result(bench("prefix_cache"), ["bench/prefix_cache.py"], PREFIX, 0, 30.0)])
    texts = [text.text for text in ElementTree.fromstring(svg).iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("108") == 1 and texts.count("102") == 1 and texts.count("107") == 1 and "103" in texts
    assert any("reame 3.1 s, llama-server 3.0 s" in (text or "") for text in texts)
