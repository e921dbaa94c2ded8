"""Peak device memory (allocator peak vs the compiled step's memory analysis) and host RSS less the accelerator
runtime's mapping: parity.protocol.memory_figures and the side table's cells and notes, on the TPU v5e run folders of
tests/data/tpu_v5e (SOURCE.md) and on fake readings. CPU only: nothing here opens a device."""

from __future__ import annotations

import copy
import json
from pathlib import Path


from parity.report.run_record import RunRecord, SideRecord
from parity.protocol.memory_figures import (ALLOCATOR_PEAK, COMPILED_ANALYSIS, RUNTIME_HOLD,
                                            RUNTIME_MAPPING_MIN_BYTES, XLA_PEAK_FIELD, XLA_PEAK_LESS_HOST,
                                            XLA_SUM_FIELDS, choose_peak, compiled_peak_bytes, device_memory_fields,
                                            host_rss_fields, own_host_rss, peak_device, runtime_mapping_bytes,
                                            vm_rss_bytes)
from parity.report import side_table
from parity.report.markdown import report_markdown
from parity.report.page import report_html

TPU = Path(__file__).parent / "data" / "tpu_v5e"
GiB, MiB = 2**30, 2**20


def _json(path: Path) -> dict:
  return json.loads(path.read_text())


def _gpt2_report_with(summary: dict) -> dict:
  """The recorded gpt2-tiny fp32 report.json (jax on the chip, torch on the host CPU) with `summary` as the JAX
  side's."""
  d = _json(TPU / "gpt2-fp32" / "report.json")
  d["sides"]["jax"]["summary"] = summary
  return d


def _row(d: dict, side: str) -> dict:
  return next(r for r in side_table.side_rows(RunRecord.of(d)) if r["side"] == side)


def test_tpu_gpt2_fixture_built_with_the_new_fields():
  """The recorded TPU run's summary plus the fields the worker now writes, made by the real functions from the
  fixture's figures: the allocator peak (5,645,824) beats the compiled device peak (XLA's 4,832,768 less the step's
  1,138,176 B of pinned_host buffers: 3,694,592), and the RSS jump across the chip's start (VmRSS 14,252,664 kB
  after the probe opened it, numerics.json, over the 411,992,064 B the later run read before its backend opened)
  comes off the 13.8 GiB peak."""
  summ = _json(TPU / "gpt2-fp32" / "jax" / "summary.json")
  platform = _json(TPU / "gpt2-fp32" / "jax" / "placement.json")["backend"]
  opened = int(_json(TPU / "numerics.json")["proc_status"]["VmRSS"].split()[0]) * 1024
  summ.update(device_memory_fields(summ["peak_device_bytes"], summ["memory_analysis"], platform))
  summ.update(host_rss_fields({"before_backend": 411_992_064, "backend_opened": opened, "end": opened}, platform))
  assert (summ["peak_device_bytes"], summ["peak_device_source"]) == (5_645_824, ALLOCATOR_PEAK)
  assert (summ["peak_device_bytes_compiled"], summ["peak_device_compiled_from"]) == (3_694_592, XLA_PEAK_LESS_HOST)
  assert summ["host_bytes_compiled"] == 1_138_176 and summ["peak_device_bytes_runtime"] is None
  assert summ["host_rss_runtime_mapping_bytes"] == 14_182_735_872
  assert summ["peak_host_rss_bytes"] == 14_868_463_616  # the raw peak is kept
  d = _gpt2_report_with(summ)
  jax, torch = _row(d, "jax"), _row(d, "torch")
  assert jax["peak_rss"] == "654.0 MiB (peak 13.8 GiB less 13.2 GiB TPU runtime mapping)"
  assert jax["peak_device"] == "5.4 MiB (allocator peak)"
  assert (torch["peak_rss"], torch["peak_device"]) == ("684.1 MiB", "n/a")  # the CPU side: as before
  assert side_table.memory_notes(RunRecord.of(d)) == [
      "jax: peak RSS 13.8 GiB, of which 13.2 GiB is the TPU runtime's mapping made when it opened the chip; the "
      "side's own host RSS is 654.0 MiB",
      "jax: peak device memory 5.4 MiB, the allocator peak (the larger of the allocator peak 5.4 MiB and the "
      "compiled memory analysis of the train step 3.5 MiB, from peak_memory_in_bytes less host buffers); the step's "
      "host buffers, 1.1 MiB, are host memory and not in it"]
  md = report_markdown(RunRecord.of(d), {}, None)
  assert "of which 13.2 GiB is the TPU runtime's mapping made when it opened the chip" in md
  assert "| 654.0 MiB (peak 13.8 GiB less 13.2 GiB TPU runtime mapping) | 5.4 MiB (allocator peak) |" in md


def test_tpu_summary_written_by_the_worker_renders_labelled(tmp_path):
  """The JAX worker's own summary.json from the chip (gpt2-jax-memory-summary.json): its recorded fields render as
  the labelled figures, the raw peak kept beside them."""
  summ = _json(TPU / "gpt2-jax-memory-summary.json")
  assert summ["host_rss_backend"] == "tpu" and summ["peak_host_rss_bytes"] == 14_901_080_064
  readings = summ["host_rss_readings_bytes"]
  assert summ["host_rss_runtime_mapping_bytes"] == readings["backend_opened"] - readings["before_backend"]
  assert summ["peak_device_bytes"] == max(summ["peak_device_bytes_allocator"], summ["peak_device_bytes_compiled"])
  d = _gpt2_report_with(summ)
  assert _row(d, "jax")["peak_rss"] == "959.8 MiB (peak 13.9 GiB less 12.9 GiB TPU runtime mapping)"
  assert _row(d, "jax")["peak_device"] == "5.5 MiB (allocator peak)"
  notes = side_table.memory_notes(RunRecord.of(d))
  assert notes[0].startswith("jax: peak RSS 13.9 GiB, of which 12.9 GiB is the TPU runtime's "
                                                  "mapping made when it opened the chip")
  page = report_html(RunRecord.of(d), {}, tmp_path)
  assert "of which 12.9 GiB is the TPU runtime&#x27;s mapping made when it opened the chip" in page
  assert "<td class=\"num\">5.5 MiB (allocator peak)</td>" in page


def test_old_tpu_summary_recomputes_the_device_source_and_keeps_the_rss():
  """A report written before the new fields: the device figure is chosen from the summary's memory_analysis, the
  host RSS stays the raw peak (no readings were taken)."""
  d = _json(TPU / "gpt2-fp32" / "report.json")
  assert _row(d, "jax")["peak_device"] == "5.4 MiB (allocator peak)"
  assert _row(d, "jax")["peak_rss"] == "13.8 GiB"
  assert not any("peak RSS" in n for n in side_table.memory_notes(RunRecord.of(d)))


def test_compiled_analysis_wins_when_the_allocator_misses_the_temporaries():
  """The 220M-param case: the allocator read 2.8 GB, the compiled step needs 6.9 GB: the larger, named."""
  ma = dict(_json(TPU / "gpt2-fp32" / "jax" / "summary.json")["memory_analysis"], peak_memory_in_bytes=6_900_000_000)
  fields = device_memory_fields(2_800_000_000, ma, "tpu")
  assert fields == {"peak_device_bytes": 6_900_000_000 - 1_138_176, "peak_device_source": COMPILED_ANALYSIS,
                    "peak_device_bytes_allocator": 2_800_000_000, "peak_device_bytes_runtime": None,
                    "peak_device_bytes_compiled": 6_900_000_000 - 1_138_176,
                    "peak_device_compiled_from": XLA_PEAK_LESS_HOST, "host_bytes_compiled": 1_138_176}
  assert side_table.device_memory_cell(fields) == "6.4 GiB (compiled memory analysis)"


def test_choose_peak():
  assert choose_peak(5_645_824, 4_832_768) == (5_645_824, ALLOCATOR_PEAK)
  assert choose_peak(2_800_000_000, 6_900_000_000) == (6_900_000_000, COMPILED_ANALYSIS)
  assert choose_peak(100, 100) == (100, ALLOCATOR_PEAK)  # a tie: the measurement
  assert choose_peak(None, 7) == (7, COMPILED_ANALYSIS)
  assert choose_peak(7, None) == (7, ALLOCATOR_PEAK)
  assert choose_peak(None, None) == (None, None) == choose_peak(0, 0)
  assert choose_peak(2_800_000_000, 6_900_000_000, 7_000_000_000) == (7_000_000_000, RUNTIME_HOLD)  # a measurement
  assert choose_peak(None, None, 5) == (5, RUNTIME_HOLD)


def test_compiled_peak_bytes_falls_back_to_the_sum():
  """XLA's peak (less the step's host buffers) where it gives one; else argument + output + temp - alias + generated
  code of the device fields, said so."""
  ma = _json(TPU / "gpt2-fp32" / "jax" / "summary.json")["memory_analysis"]
  assert compiled_peak_bytes(ma) == (4_832_768 - 1_138_176, XLA_PEAK_LESS_HOST)
  no_host = {k: (0 if k.startswith("host_") else v) for k, v in ma.items()}
  assert compiled_peak_bytes(no_host) == (4_832_768, XLA_PEAK_FIELD)
  no_peak = {k: v for k, v in ma.items() if k != "peak_memory_in_bytes"}
  want = 569_344 + 570_368 + 11_753_472 - 568_320 + 2_818_048
  assert compiled_peak_bytes(no_peak) == (want, XLA_SUM_FIELDS) == compiled_peak_bytes({**ma, XLA_PEAK_FIELD: 0})
  assert compiled_peak_bytes({k: v for k, v in no_peak.items() if k != "temp_size_in_bytes"}) == (None, None)
  assert compiled_peak_bytes(None) == (None, None) == compiled_peak_bytes({})


def test_cpu_keeps_no_device_figure():
  """On the CPU backend the compiled analysis is there but is host memory: no device figure, no source."""
  ma = {"argument_size_in_bytes": 12, "output_size_in_bytes": 12, "temp_size_in_bytes": 0,
        "alias_size_in_bytes": 0, "generated_code_size_in_bytes": 0}
  assert device_memory_fields(None, ma, "cpu") == {"peak_device_bytes": None}
  cpu = {"peak_device_bytes": None, "memory_analysis": ma}
  assert peak_device(cpu) == (None, None) and side_table.device_memory_cell(cpu) == "n/a"


def test_runtime_mapping_from_fake_readings():
  before, opened = 400 * MiB, 400 * MiB + 13 * GiB
  assert runtime_mapping_bytes(before, opened, "tpu") == 13 * GiB
  assert runtime_mapping_bytes(before, opened, "cpu") is None  # the CPU backend: nothing named
  assert runtime_mapping_bytes(before, before + RUNTIME_MAPPING_MIN_BYTES - 1, "tpu") is None  # under the threshold
  assert runtime_mapping_bytes(before, before + RUNTIME_MAPPING_MIN_BYTES, "gpu") == RUNTIME_MAPPING_MIN_BYTES
  assert runtime_mapping_bytes(None, opened, "tpu") is None
  fields = host_rss_fields({"before_backend": before, "backend_opened": opened, "end": opened + GiB}, "tpu")
  assert fields["host_rss_runtime_mapping_bytes"] == 13 * GiB and fields["host_rss_backend"] == "tpu"
  summ = {"peak_host_rss_bytes": 15 * GiB, **fields}
  assert own_host_rss(summ) == (2 * GiB, 13 * GiB)
  assert own_host_rss(summ, 14 * GiB) == (GiB, 13 * GiB)  # the peak a caller passes (the harness's)
  assert own_host_rss({"peak_host_rss_bytes": 5 * GiB, "host_rss_runtime_mapping_bytes": 6 * GiB}) == (0, 6 * GiB)
  assert own_host_rss({"peak_host_rss_bytes": 5 * GiB, "host_rss_runtime_mapping_bytes": None}) == (5 * GiB, None)
  cpu = {"peak_host_rss_bytes": 528 * MiB, **host_rss_fields({"before_backend": 180 * MiB,
                                                               "backend_opened": 184 * MiB}, "cpu")}
  d = {"sides": {"jax": {"summary": cpu}}}
  rec = RunRecord.of(d)
  assert side_table.host_rss_cell(rec.sides["jax"]) == "528.0 MiB" and side_table.memory_notes(rec) == []
  gpu = {"sides": {"jax": {"summary": {"peak_host_rss_bytes": 3 * GiB, "host_rss_backend": "gpu",
                                       "host_rss_runtime_mapping_bytes": GiB}}}}
  notes = side_table.memory_notes(RunRecord.of(gpu))
  assert notes == ["jax: peak RSS 3.0 GiB, of which 1.0 GiB is the GPU runtime's mapping made "
                                          "when it opened the device; the side's own host RSS is 2.0 GiB"]


def test_vm_rss_bytes_reads_the_status_file(tmp_path, monkeypatch):
  status = tmp_path / "status"
  status.write_text("Name:\tpython3\nVmHWM:\t14252664 kB\nVmRSS:\t 14252664 kB\nThreads:\t40\n")
  assert vm_rss_bytes(status) == 14_252_664 * 1024
  assert vm_rss_bytes(tmp_path / "missing") is None  # no /proc: not recorded
  status.write_text("Name:\tpython3\nVmRSS:\tgarbage kB\n")
  assert vm_rss_bytes(status) is None
  assert vm_rss_bytes() is None or vm_rss_bytes() > 0  # this process, where /proc is there


def test_a_summary_without_memory_fields_is_untouched():
  """A torch or DeepSpeed summary (allocator figure only, no analysis, no readings) renders as before but names its
  source."""
  s = {"summary": {"peak_host_rss_bytes": 3 * GiB, "peak_device_bytes": 2 * GiB}}
  assert side_table.host_rss_cell(SideRecord.of("side", s)) == "3.0 GiB"
  assert side_table.device_memory_cell(s["summary"]) == "2.0 GiB (allocator peak)"
  assert side_table.memory_notes(RunRecord.of({"sides": {"torch": copy.deepcopy(s)}})) == []
  assert side_table.host_rss_cell(SideRecord.of("side", {"summary": {}, "harness_peak_rss_bytes": GiB})) == "1.0 GiB"
