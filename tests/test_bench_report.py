"""The benchmark page cannot rot: docs/benchmarks.md's results section and its plots are what
bench/report.py generates from the committed docs/assets/bench/run_all.json, and the generator
states targets and verdicts as run_all computed them."""
import json

import bench_modules
import pytest

report = bench_modules.load("report")

RUN = {
    "time": "20261202-013000", "quick": False, "repeat": 3, "duration_s": 2.0,
    "utc": "2026-12-02T01:30:00+00:00",
    "machine": {"python": "3.11.2", "platform": "Linux-x86_64", "cpu_model": "Test CPU @ 3GHz",
                "cpus": 2, "load": [1.5, 2.25, 3.0], "load_start": [0.5, 0.75, 1.0]},
    "results": {
        "shm": [{"workload": "W1", "variant": "fastest", "api": "insert", "items_per_s": 4.0e6},
                {"workload": "scale_1000", "variant": "fastest", "api": "a",
                 "items_per_s": 1e6, "table_items": 1000, "us_per_item": 1.0},
                {"workload": "scale_10000", "variant": "fastest", "api": "a",
                 "items_per_s": 5e5, "table_items": 10000, "us_per_item": 2.0}],
        "reverb": [{"workload": "W1", "variant": "fastest", "api": "insert",
                    "items_per_s": 1.0e5, "mb_per_s": 4.4}]},
    "ratios": [
        {"ratio": "W1 vs dm-reverb, fastest", "value": 40.0, "target": 30.0, "met": True},
        {"ratio": "W3 vs dm-reverb, fastest", "value": 12.0, "target": 30.0, "met": False},
        {"ratio": "L1 with 1 ms step: iteration time / 1 ms (lower is better)", "value": 1.05,
         "target": 1.1, "met": True},
        {"ratio": "R1 cross-node sample cost / same-node (lower is better)", "value": 3.0,
         "target": None, "met": None},
        {"ratio": "W5 sample vs numpy copy bandwidth", "value": None, "target": 0.6,
         "met": None}],
    "notes": ["cpprb skipped: no | pipes here"],
}


def test_committed_page_and_plots_match_the_committed_json():
  # The fix when this fails: `python bench/report.py docs/assets/bench/run_all.json`.
  assert report.check() == []


def test_render_states_machine_date_load_and_every_ratio_with_its_verdict():
  section = report.render(RUN, "ab" * 32)
  assert section.startswith(report.BEGIN) and section.endswith(report.END)
  assert "| Date | 2026-12-02 01:30 UTC |" in section
  assert "Test CPU @ 3GHz, 2 logical CPUs" in section
  assert "1.50 / 2.25 / 3.00" in section and "0.50 / 0.75 / 1.00" in section
  assert "| W1 vs dm-reverb, fastest | 40 | ≥ 30 | met |" in section
  assert "| W3 vs dm-reverb, fastest | 12 | ≥ 30 | **missed** |" in section
  assert "| L1 with 1 ms step: iteration time / 1 ms (lower is better) | 1.05 | ≤ 1.1 | met |" \
      in section
  assert "| R1 cross-node sample cost / same-node (lower is better) | 3 | - | no target |" \
      in section
  assert "| W5 sample vs numpy copy bandwidth | n/a | ≥ 0.6 | not measured |" in section
  assert "2 of 3 targets met; 1 ratio(s) not measured" in section
  assert "| reverb | W1 | fastest | 100,000 | 4.4 | insert |  |" in section
  assert "| shm | scale_10000 | fastest | 500,000 |  | a | 10,000 items, 2 µs/item |" in section
  assert "no \\| pipes" in section            # a '|' in a note does not break the table
  assert "scaling.svg" in section and "smoke run" not in section
  quick = report.render({**RUN, "quick": True}, "ab" * 32)
  assert "A smoke run" in quick


def test_splice_replaces_only_the_generated_section():
  page = "# Benchmarks\n\nprose\n\n" + report.render(RUN, "0" * 64) + "\n\nafter\n"
  other = {**RUN, "ratios": RUN["ratios"][:1]}
  out = report.splice(page, report.render(other, "1" * 64))
  assert out.startswith("# Benchmarks\n\nprose\n\n") and out.endswith("\n\nafter\n")
  assert "W3 vs dm-reverb" not in out and report.committed_section(out) == report.render(
      other, "1" * 64)
  assert report.splice("# B\n", "S") == "# B\n\nS\n"


def test_check_finds_a_stale_page_and_a_plot_of_another_run(tmp_path):
  pytest.importorskip("matplotlib")
  src = tmp_path / "run_all-20261202-013000.json"
  src.write_text(json.dumps(RUN))
  page = tmp_path / "benchmarks.md"
  page.write_text("# Benchmarks\n\nprose\n")
  assets = tmp_path / "assets"
  written = report.publish(src, page=page, assets=assets)
  assert {p.name for p in written} == {"run_all.json", "benchmarks.md", "ratios.svg",
                                       "scaling.svg"}
  assert report.check(page=page, assets=assets) == []
  assert page.read_text().startswith("# Benchmarks\n\nprose\n")
  # the same JSON draws the same files (a republish changes nothing in git)
  before = (assets / "ratios.svg").read_bytes()
  report.publish(assets / "run_all.json", page=page, assets=assets)
  assert (assets / "ratios.svg").read_bytes() == before
  # someone edits the record without regenerating: both page and plots are stale
  (assets / "run_all.json").write_text(json.dumps({**RUN, "repeat": 5}))
  problems = report.check(page=page, assets=assets)
  assert any("does not match" in p for p in problems)
  assert any("ratios.svg was drawn from another JSON" in p for p in problems)


def test_publish_refuses_a_json_that_is_not_a_run(tmp_path):
  src = tmp_path / "x.json"
  src.write_text(json.dumps({"rows": []}))
  page = tmp_path / "benchmarks.md"
  page.write_text("# B\n")
  with pytest.raises(ValueError, match="not a bench/run_all.py result"):
    report.publish(src, page=page, assets=tmp_path / "assets")
  assert page.read_text() == "# B\n" and not (tmp_path / "assets").exists()


def test_newest_result_prefers_a_full_run(tmp_path):
  for name in ("run_all-20261201-100000.json", "run_all-20261202-100000-quick.json"):
    (tmp_path / name).write_text("{}")
  assert report.newest_result(tmp_path).name == "run_all-20261201-100000.json"
  with pytest.raises(FileNotFoundError, match="run bench/run_all.py first"):
    report.newest_result(tmp_path / "none")
