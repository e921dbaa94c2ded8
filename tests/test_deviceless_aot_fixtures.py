"""The H100 HLO fixtures of the deviceless AOT compile (docs/deviceless-aot.md) and the text reader
behind their JSON and placement.json (jax_impl/hlo_transfers.py, in the fixtures' flat form by benchmarks/hlo_moves.py).
Reads files only: no jax, no CUDA plugin. The JSON was written at compile time from the untrimmed text, so equality
here also says the trimmed text lost no move."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.hlo_moves import summary, transfers, trim
from jax_impl import hlo_transfers as ht

nbytes = ht.shape_bytes

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hlo"
NAMES = ("host-move", "remat-offload", "zero2-offload", "scan-offload", "act-offload")


@pytest.fixture(scope="module")
def fixtures() -> dict[str, tuple[str, dict]]:
  """name -> (optimised HLO text, its JSON), each read once."""
  return {n: ((FIXTURES / f"{n}-h100.hlo.txt").read_text(), json.loads((FIXTURES / f"{n}-h100.json").read_text()))
          for n in NAMES}


@pytest.fixture(scope="module")
def moves(fixtures) -> dict[str, list[dict]]:
  return {n: transfers(text) for n, (text, _) in fixtures.items()}


def _entry_params(text: str) -> dict[str, str]:
  """ENTRY parameter name -> shape text."""
  mod = ht.parse_module(text)
  return {i.name: i.shape for i in mod.computations[mod.entry].instrs if i.opcode == "parameter"}


@pytest.mark.parametrize("name", NAMES)
def test_fixture_text_gives_the_moves_its_json_records(fixtures, moves, name):
  """The trimmed text keeps every move the untrimmed one had (the JSON was computed before trimming)."""
  _, meta = fixtures[name]
  assert meta["device_kind"] == "NVIDIA H100 80GB HBM3" and meta["versions"]["jax-cuda13-plugin"] == "0.10.2"
  assert summary(moves[name]) == meta["summary"]
  assert moves[name] == meta["transfers"]


def test_host_move_copies_in_and_out_around_the_compute(fixtures, moves):
  text, meta = fixtures["host-move"]
  assert "entry_computation_layout={(f32[1024,1024]{1,0:S(5)})->f32[1024,1024]{1,0:S(5)}}" in text
  got = [(m["direction"], m["opcode"], m["bytes"]) for m in moves["host-move"]]
  assert got == [("host_to_device", "copy-start", 4 << 20), ("device_to_host", "copy-start", 4 << 20)]
  mem = meta["memory_analysis"]  # the GPU target splits host and device bytes (CPU counts host as device)
  assert (mem["host_argument_size_in_bytes"], mem["argument_size_in_bytes"]) == (4 << 20, 0)


def test_remat_offload_sends_the_residual_out_then_back(moves, fixtures):
  got = [(m["direction"], m["bytes"]) for m in moves["remat-offload"]]
  assert got == [("device_to_host", 1 << 20), ("host_to_device", 1 << 20)]
  assert fixtures["remat-offload"][1]["memory_analysis"]["host_temp_size_in_bytes"] == 1 << 20


@pytest.mark.parametrize("name", ["zero2-offload", "act-offload"])
def test_moments_live_on_the_host_and_cross_once_each_way(fixtures, moves, name):
  """Adam's moments are S(5) entry parameters, each copied in once; the params stay in device memory."""
  params = _entry_params(fixtures[name][0])
  moments = {k: s for k, s in params.items() if "__mu__" in k or "__nu__" in k}
  weights = {k: s for k, s in params.items() if k.startswith("state_params_")}
  assert moments and weights and all("S(5)" in s for s in moments.values())
  assert not any("S(5)" in s for s in weights.values())
  copied_in = {m["operand"]: m["bytes"] for m in moves[name] if m["direction"] == "host_to_device"}
  assert {k: copied_in.get(k) for k in moments} == {k: nbytes(s) for k, s in moments.items()}
  moment_bytes = sum(map(nbytes, moments.values()))
  assert moment_bytes == 2 * sum(map(nbytes, weights.values()))  # mu and nu, one of each per param
  out = sum(m["bytes"] for m in moves[name] if m["direction"] == "device_to_host" and m["per_step"] == 1)
  assert 0 <= out - moment_bytes <= 16  # the new moments go back, with the optimizer's scalars (counts: 4 bytes each)


def test_scan_offload_moves_params_per_layer_inside_the_loops(fixtures, moves):
  params = _entry_params(fixtures["scan-offload"][0])
  assert all("S(5)" in s for k, s in params.items() if k.startswith("state_params_"))
  in_loops = [m for m in moves["scan-offload"] if m["per_step"] > 1]
  assert {m["opcode"] for m in in_loops} == {"fusion-start", "copy-start"}
  slices = [m for m in in_loops if m["opcode"] == "fusion-start" and m["direction"] == "host_to_device"]
  assert {m["per_step"] for m in slices} == {4, 2}  # 2 layers x 2 micro batches (forward), 2 layers (update)


def test_act_offload_moves_activations_in_the_micro_batch_loop(moves):
  loop = [m for m in moves["act-offload"] if m["per_step"] == 2]
  assert [m["direction"] for m in loop].count("device_to_host") == 6
  assert sum(m["bytes"] for m in loop if m["direction"] == "device_to_host") == sum(
      m["bytes"] for m in loop if m["direction"] == "host_to_device") > 0


SYNTHETIC = """HloModule m, entry_computation_layout={(f32[8]{0:S(5)}, s32[]{:S(5)})->f32[8]{0:S(5)}}

%body (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %ds = ((f32[2,8]{1,0:S(5)}, s32[], s32[]), f32[1,8]{1,0}, u32[]) fusion-start(%a, %i, %j), kind=kCustom, calls=%wrapped_dynamic-slice_computation.1
  %x = f32[1,8]{1,0} fusion(%ds), kind=kLoop
  %dd = f32[1,8]{1,0} fusion-done(%ds)
  %us = ((f32[2,8]{1,0:S(5)}, f32[1,8]{1,0}, s32[], s32[]), f32[2,8]{1,0:S(5)}, u32[]) fusion-start(%a, %dd, %i, %j), calls=%wrapped_dynamic-update-slice_computation
  %ud = f32[2,8]{1,0:S(5)} fusion-done(%us)
}

ENTRY %main (a: f32[8], n: s32[]) -> f32[8] {
  %a = f32[8]{0:S(5)} parameter(0)
  %n = s32[]{:S(5)} parameter(1)
  %cs = (f32[8]{0}, f32[8]{0:S(5)}, u32[]) copy-start(%a)
  %ns = (s32[], s32[]{:S(5)}, u32[]) copy-start(%n)
  %cd = f32[8]{0} copy-done(%cs)
  %nd = s32[] copy-done(%ns)
  %w = (s32[], f32[2,8]) while(%t), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %h = f32[8]{0:S(5)} copy(%a)
  ROOT %r = f32[8]{0:S(5)} copy(%cd)
}
"""  # noqa: E501 - verbatim HLO text, as XLA prints it


def test_each_form_is_read_with_its_direction_bytes_and_trip_count():
  got = [(m["name"], m["direction"], m["bytes"], m["per_step"], m["window"],
          m["operand"]) for m in transfers(SYNTHETIC)]
  assert got == [("ds", "host_to_device", 32, 3, 1, "a"), ("us", "device_to_host", 32, 3, 0, "dd"),
                 ("cs", "host_to_device", 32, 1, 1, "a"), ("ns", "host_to_device", 4, 1, 1, "n"),
                 ("h", "host_to_host", 32, 1, None, "a"), ("r", "device_to_host", 32, 1, None, "cd")]
  assert transfers(SYNTHETIC.replace("S(5)", "S(0)")) == []  # no host memory space: no move


def test_trim_keeps_host_computations_and_says_how():
  text = SYNTHETIC + "\n%unrelated (x: f32[]) -> f32[] {\n" + "  %y = f32[] add(%x, %x)\n" * 50 + "}\n"
  out, note = trim(text, 1000)
  assert "%unrelated" not in out and "%body" in out and "ENTRY %main" in out and note.startswith("trimmed from")
  assert transfers(out) == transfers(text)
  assert trim(SYNTHETIC, 1 << 20) == (SYNTHETIC, f"untrimmed ({len(SYNTHETIC.encode())} bytes)")
