"""Machines that refuse sockets (parity.sockets): the loopback probe, which sides need sockets, what `parity
compare` does about it (a DeepSpeed side left out or recorded as not run, several ranks refused) and the doctor's
line. The refusal is faked by replacing the probe in this process: the harness asks it once, before any side starts.
"""
from __future__ import annotations

import errno
import json
import os
import socket

import pytest

from conftest import requires_jax, requires_torch
from parity import sockets
from parity.errors import SpecError

REFUSED = f"[Errno {errno.EAFNOSUPPORT}] {os.strerror(errno.EAFNOSUPPORT)}"
"""The words the TPU VM gave (errno 97 on Linux: 'Address family not supported by protocol')."""


class _NoFamily:
  """socket.socket where the address family is refused, as on the TPU VM (no TCP/UDP socket, loopback included)."""

  def __init__(self, *a, **k):
    raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))


class _NoBind:
  """A socket that is created but may not bind (a sandbox that denies bind)."""

  def __init__(self, *a, **k):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def bind(self, addr):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def test_the_probe_names_the_os_refusal(monkeypatch):
  monkeypatch.setattr(sockets.socket, "socket", _NoFamily)
  assert sockets.loopback_refusal() == REFUSED
  rec = sockets.sockets_record()
  assert rec["allowed"] is False and rec["error"] == REFUSED and rec["means"].startswith(f"REFUSED (loopback TCP "
                                                                                        f"bind: {REFUSED})")
  monkeypatch.setattr(sockets.socket, "socket", _NoBind)
  assert sockets.loopback_refusal() == f"[Errno {errno.EACCES}] {os.strerror(errno.EACCES)}"


def test_the_probe_agrees_with_a_bind_made_here():
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind(("127.0.0.1", 0))
    here = None
  except OSError as exc:
    here = f"[Errno {exc.errno}] {exc.strerror}"
  assert sockets.loopback_refusal() == here
  assert sockets.sockets_record()["allowed"] is (here is None)


def test_which_sides_need_sockets():
  """DeepSpeed and FSDP2 build a process group even on one rank; torch and jax only with several ranks."""
  assert [s for s in ("jax", "deepspeed", "torch", "fsdp") if sockets.needs_sockets(s, 1)] == ["deepspeed", "fsdp"]
  assert all(sockets.needs_sockets(s, 2) for s in ("jax", "deepspeed", "torch", "fsdp"))
  assert "jax.distributed" in sockets.needs_sockets("jax", 2) and "torchrun" in sockets.needs_sockets("torch", 2)


def test_the_plan_drops_unnamed_sides_keeps_named_ones_and_refuses_ranks():
  sides = ("jax", "deepspeed", "torch")
  assert sockets.plan_sides(sides, world=4, named=False, error=None) == sockets.SidePlan(sides, {}, False)
  line = sockets.not_run_line("deepspeed", REFUSED)
  assert line == (f"deepspeed: not run: this machine refuses sockets (loopback TCP bind: {REFUSED}), which "
                  "DeepSpeed's init needs; the other sides run. Run it on a machine that allows them and join the "
                  "folders with `parity join`")
  dropped = sockets.plan_sides(sides, world=1, named=False, error=REFUSED)
  assert dropped.sides == ("jax", "torch") and dropped.not_run == {"deepspeed": line}
  kept = sockets.plan_sides((*sides, "fsdp"), world=1, named=True, error=REFUSED)
  assert kept.sides == (*sides, "fsdp") and list(kept.not_run) == ["deepspeed", "fsdp"]
  with pytest.raises(SpecError, match=r"--nproc with 2 ranks per side: .*jax.distributed.*refuses them"):
    sockets.plan_sides(("jax", "torch"), world=2, named=True, error=REFUSED)
  with pytest.raises(SpecError, match=r"sides deepspeed,fsdp: none can run here.*--sides jax,torch"):
    sockets.plan_sides(("deepspeed", "fsdp"), world=1, named=True, error=REFUSED)


def _refuse(monkeypatch):
  monkeypatch.setattr(sockets, "loopback_refusal", lambda: REFUSED)


@pytest.mark.parametrize("args,words", [
    (["--nproc", "2", "--sides", "jax,torch"], "--nproc with 2 ranks per side"),
    (["--nproc", "2"], "jax.distributed's coordinator"),
    (["--equivalence", "ranks", "--sides", "jax,torch"], "--equivalence ranks reruns each side on 2 ranks"),
    (["--sides", "deepspeed"], "sides deepspeed: none can run here")])
def test_compare_refuses_what_cannot_start_with_exit_2(monkeypatch, tmp_path, capsys, args, words):
  from parity.cli import main
  _refuse(monkeypatch)
  out = tmp_path / "run"
  assert main(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(out), *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("parity compare: error: ") and words in err and REFUSED in err
  assert not out.exists()


def _compare(tmp_path, capsys, *args) -> tuple[int, dict, str, list[str]]:
  from parity.cli import main
  out = tmp_path / "run"
  # 4 steps: gpt2-tiny's lr warms up from 0, and over 2 steps nothing would move (the 'updates' check fails)
  code = main(["compare", "--preset", "gpt2-tiny", "--steps", "4", "--determinism-steps", "0", "--out", str(out),
               "--no-progress", *args])
  cap = capsys.readouterr()
  said = [ln for ln in cap.err.splitlines() if "not run: this machine refuses sockets" in ln]
  return code, json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), said + [cap.out]


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_default_sides_leave_deepspeed_out_and_compare_the_others(monkeypatch, tmp_path, capsys):
  """No --sides: DeepSpeed is left out before anything starts, with one line; jax and torch compare as usual, and
  report.json/report.md record deepspeed as not run with the reason; 2 of the 3 sides asked ran: exit 3. (Without
  the marker requires_deepspeed, tests/process_guard.py fails this test if a deepspeed worker is started after
  all.)"""
  _refuse(monkeypatch)
  code, rep, md, (*said, out) = _compare(tmp_path, capsys)
  line = sockets.not_run_line("deepspeed", REFUSED)
  assert said == [f"parity compare: {line}"]
  assert code == 3, rep["verdict"]
  assert rep["run"]["sides"] == ["jax", "torch"] and set(rep["sides"]) == {"jax", "torch"}
  assert all(s["status"] == "ok" for s in rep["sides"].values())
  assert rep["sides_not_run"] == {"deepspeed": {"reason": line, "named": False}}
  assert rep["verdict"]["passed"] is True and not (tmp_path / "run" / "deepspeed").exists()
  assert "**deepspeed not run**: deepspeed: not run: this machine refuses sockets" in md
  assert line in out  # the summary repeats it beside the verdict
  assert "incomplete: 2 of 3 asked sides ran (jax, torch); left out: deepspeed (this machine refuses sockets" in out


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_a_named_deepspeed_side_is_recorded_not_run_and_fails_the_run(monkeypatch, tmp_path, capsys):
  """--sides names deepspeed: the others still run, deepspeed is a side not run with the reason, exit 1."""
  _refuse(monkeypatch)
  code, rep, md, (*said, out) = _compare(tmp_path, capsys, "--sides", "jax,deepspeed,torch")
  line = sockets.not_run_line("deepspeed", REFUSED)
  assert said == [f"parity compare: {line}"] and code == 1
  assert rep["run"]["sides"] == ["jax", "deepspeed", "torch"]
  assert {n: s["status"] for n, s in rep["sides"].items()} == {"jax": "ok", "deepspeed": "not_run", "torch": "ok"}
  assert rep["sides"]["deepspeed"]["error"] == line
  assert rep["sides_not_run"] == {"deepspeed": {"reason": line, "named": True}}
  assert rep["verdict"]["passed"] is False and "deepspeed (not_run)" in rep["verdict"]["message"]
  loss = next(c for c in rep["checks"] if c["name"] == "loss jax~torch")
  assert loss["passed"] is True  # the two that ran were compared
  assert "this machine refuses sockets" in md and line in out
