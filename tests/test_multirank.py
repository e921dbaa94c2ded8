"""Multi-rank sides (`parity compare --nproc N`, docs/multirank.md): launch commands, the global-batch rule, and
end to end on CPU: 2-rank runs of every side reach parity with the 1-rank run of the same command (fp32, the
offload plan pair ZeRO-2 + offload_optimizer <-> JAX opt state in pinned_host sharded over the 2 processes), and a
killed rank ends its side with a report naming it (exit 1)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import requires_all
from harness.ranks import jax_rank_envs, torch_command, world_size
from parity.errors import SpecError
from parity.protocol.control import derive_request
from parity.protocol.ranks import LAUNCH_FILE, check_nproc, read_launch, rank_rows, write_launch
from parity.spec import TrainSpec

LAUNCH1 = {"nproc": 2, "nnodes": 1, "node_rank": 0, "coordinator": None, "hostfile": None}


def test_torchrun_command_single_host_is_standalone():
  cmd = torch_command("py", "torch", "torch_impl.worker", "/r/request.json", LAUNCH1)
  assert cmd[:4] == ["py", "-m", "harness.boot", "torch.distributed.run"]
  assert cmd[4:8] == ["--nproc-per-node", "2", "--max-restarts", "0"] and "--standalone" in cmd
  assert cmd[-6:] == ["-m", "harness.boot", "torch_impl.worker", "/r/request.json", "--side", "torch"]


def test_multi_host_commands_pass_the_coordinator_and_hostfile_through():
  two = {**LAUNCH1, "nnodes": 2, "node_rank": 1, "coordinator": "node0:29400"}
  cmd = torch_command("py", "deepspeed", "torch_impl.worker", "req", two)
  assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == "1"
  assert cmd[cmd.index("--master-addr") + 1] == "node0" and cmd[cmd.index("--master-port") + 1] == "29400"
  ds = torch_command("py", "deepspeed", "torch_impl.worker", "req", {**two, "hostfile": "/h/hostfile"})
  assert ds[3] == "deepspeed.launcher.runner" and ds[ds.index("--hostfile") + 1] == "/h/hostfile"
  assert ds[ds.index("--module") + 1:ds.index("--module") + 3] == ["harness.boot", "torch_impl.worker"]
  envs = jax_rank_envs({**two, "nproc": 2})  # this host's ranks are 2 and 3 of 4
  assert [e["RANK"] for e in envs] == ["2", "3"] and {e["WORLD_SIZE"] for e in envs} == {"4"}
  assert {e["PARITY_COORDINATOR"] for e in envs} == {"node0:29400"} and world_size(two) == 4


def test_global_batch_rule_and_its_refusal():
  rows = [rank_rows(4, k, 2) for k in range(2)]
  assert [(r.start, r.stop) for r in rows] == [(0, 2), (2, 4)]  # the 1-rank micro batch, split in rank order
  check_nproc(TrainSpec(micro_batch_size=4), 2)
  with pytest.raises(SpecError, match=r"micro_batch_size=6.*multiple of 4"):
    check_nproc(TrainSpec(micro_batch_size=6), 4)
  with pytest.raises(SpecError, match="jax.data_parallel=2"):
    check_nproc(TrainSpec(micro_batch_size=4), 2, jax_data_parallel=2)


def test_deepspeed_config_per_rank_keeps_the_global_batch():
  from conftest import HAS_TORCH
  if not HAS_TORCH:
    pytest.skip("torch not installed")
  from torch_impl.ds_config import per_rank_config
  cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "train_batch_size": 12}
  two = per_rank_config(cfg, 2)
  assert two["train_micro_batch_size_per_gpu"] * 2 * two["gradient_accumulation_steps"] == two["train_batch_size"]
  assert per_rank_config(cfg, 1) is cfg
  with pytest.raises(ValueError, match="does not split over 3 ranks"):
    per_rank_config(cfg, 3)


def test_launch_file_round_trip_and_reruns_inherit_it(tiny_run_dir):
  rd, _ = tiny_run_dir(steps=2)
  assert write_launch(rd) is None and read_launch(rd)["nproc"] == 1  # one rank: no file, today's path
  write_launch(rd, nproc=2)
  sub = derive_request(rd, "repeat", stop_after_step=0).parent
  assert read_launch(sub)["nproc"] == 2 and (sub / LAUNCH_FILE).exists()


# ----------------------------------------------------------------------------- end to end (CPU, gpt2-tiny)

SIDES = ("jax", "deepspeed", "torch")
STEPS = 3
SETTINGS = {"jax.zero_stage": 2}
"""The offload plan pair: the DeepSpeed side's default plan is ZeRO-2 + offload_optimizer cpu, the JAX side's keeps
the optimizer state in pinned_host; jax.zero_stage=2 shards it (and the gradients) over the mesh's `data` axis,
i.e. over the 2 processes at --nproc 2 (a 1-process mesh shards nothing, so the 1-rank run is the same plan)."""


def _side(run_dir: Path, side: str) -> dict:
  from parity import weights
  from parity.protocol import read_moments, read_steps
  out = run_dir / side
  return {"status": json.loads((out / "summary.json").read_text())["status"], "steps": read_steps(out / "steps.jsonl"),
          "final": weights.load(out / "final.safetensors"), "moments": read_moments(out)}


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory):
  import parity
  base = tmp_path_factory.mktemp("multirank")
  reports = {n: parity.compare("gpt2-tiny", steps=STEPS, sides=list(SIDES), overrides=SETTINGS, out=base / f"n{n}",
                               determinism_steps=0, nproc=n) for n in (1, 2)}
  return base, reports


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_two_ranks_reach_parity_with_one_rank(one_and_two_ranks):
  from parity.pipeline.resolve import resolve
  from parity.verdict.sides import compare_sides
  base, reports = one_and_two_ranks
  assert reports[1].passed and reports[2].passed, (reports[1].checks, reports[2].checks)
  spec = resolve("gpt2-tiny", steps=STEPS, overrides=SETTINGS, sides=list(SIDES))
  from parity import weights
  init = weights.load(base / "n1" / "init.safetensors")
  for side in SIDES:
    pair = {f"{side}@1": _side(base / "n1", side), f"{side}@2": _side(base / "n2", side)}
    checks, _ = compare_sides(pair, spec=spec, init=init)  # the project's own tolerances, 1 rank vs 2
    bad = [c for c in checks if not c.passed]
    assert not bad and len(pair[f"{side}@2"]["steps"]) == STEPS, (side, bad)
    d = max(abs(a["loss"] - b["loss"]) for a, b in zip(*(p["steps"] for p in pair.values())))
    print(f"{side}: max |dloss| 1 vs 2 ranks = {d:.3g}")


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_two_rank_offload_pair_is_sharded_and_reports_every_rank(one_and_two_ranks):
  base, _ = one_and_two_ranks
  summaries = {s: json.loads((base / "n2" / s / "summary.json").read_text()) for s in SIDES}
  for side, s in summaries.items():
    assert s["nproc"] == 2 and [r["rank"] for r in s["ranks"]] == [0, 1], side
    assert all(r["status"] == "ok" and r["peak_rss_bytes"] > 0 for r in s["ranks"]), s["ranks"]
    assert not (base / "n2" / side / "rank1.stderr").read_text().count("Traceback")
  jax = summaries["jax"]
  assert jax["state_memory_kinds"]["opt_state"] == "pinned_host" and jax["mesh_devices"] == 2
  assert jax["state_shardings"]["opt_state"]["sharded"] > 0  # the moments live split over the 2 processes
  opt = summaries["deepspeed"]["optimizer"]
  assert opt["zero_stage"] == 2 and opt["cpu_offload"] and opt["optimizer"] == "DeepSpeedCPUAdam"
  assert summaries["deepspeed"]["ds_config"]["train_micro_batch_size_per_gpu"] == 2  # 4 rows / 2 ranks
  assert not (base / "n1" / "jax" / "rank0.json").exists()  # one rank: today's files only


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_killed_rank_is_named_and_fails_the_run(tmp_path):
  import parity
  pert = [f"{s}:{k}" for s in ("jax", "torch") for k in ("kill_at_step=1", "fault_rank=1")]
  report = parity.compare("gpt2-tiny", steps=2, sides=["jax", "torch"], out=tmp_path / "run", perturb=pert,
                          determinism_steps=0, nproc=2)
  assert report.exit_code == 1 and not report.passed
  md = (tmp_path / "run" / "report.md").read_text()
  for side in ("jax", "torch"):
    s = json.loads((tmp_path / "run" / side / "summary.json").read_text())
    assert s["status"] == "killed" and s["failed_rank"]["rank"] == 1 and s["failed_rank"]["exit_code"] == -9
    assert s["error"].startswith("rank 1 of 2 was killed by signal SIGKILL (the planted")
    assert {r["rank"]: r["status"] for r in s["ranks"]}[1] == "killed"
    assert f"{side}/rank1.stderr" in md  # the report names the rank and where its stderr is


def _rank_files(out: Path, stderr1: str) -> None:
  out.mkdir(parents=True)
  (out / "rank0.json").write_text(json.dumps({"rank": 0, "pid": 10, "status": "running"}))
  (out / "rank1.json").write_text(json.dumps({"rank": 1, "pid": 11, "status": "running"}))
  (out / "rank1.stderr").write_text(stderr1)


def test_fold_ranks_names_a_planted_hang_and_lists_ranks_of_a_real_one(tmp_path):
  from harness.ranks import Launched, fold_ranks
  from parity.protocol.layout import PLANTED_HANG
  _rank_files(tmp_path / "a", f"{PLANTED_HANG} at step 2 (perturb hang_at_step) of rank 1\n")
  hung = Launched(None, None, True, rank_codes={0: -9, 1: -9})
  status, error, summary = fold_ranks({}, "timeout", "side exceeded its timeout", hung, tmp_path / "a", 2)
  assert status == "timeout" and error.startswith("rank 1 of 2 hung (the planted --perturb hang_at_step)")
  assert summary["failed_rank"]["rank"] == 1 and [r["status"] for r in summary["ranks"]] == ["killed", "killed"]
  _rank_files(tmp_path / "b", "")
  status, error, summary = fold_ranks({}, "timeout", "side exceeded its timeout", Launched(None, None, True),
                                      tmp_path / "b", 2)
  assert status == "timeout" and "ranks still running at the timeout: [0, 1]" in error and "failed_rank" not in summary


@pytest.mark.process
def test_fold_ranks_names_a_rank_that_was_stopped_at_the_timeout(tmp_path):
  """A rank stopped by SIGSTOP stalls the others at the next collective; the timeout listed every rank as 'still
  running' and blamed none. The process states taken just before the kill name it; a real
  deadlock (every rank sleeping) still blames none."""
  import os
  import signal
  import subprocess
  import sys
  import time
  from harness.ranks import Launched, fold_ranks, record_rank_states
  _rank_files(tmp_path / "a", "")
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    os.kill(sleeper.pid, signal.SIGSTOP)
    time.sleep(0.2)
    assert record_rank_states(tmp_path / "a", {0: os.getpid(), 1: sleeper.pid}) == {0: "R", 1: "T"}
  finally:
    sleeper.kill()
    sleeper.wait()
  status, error, summary = fold_ranks({}, "timeout", "side exceeded its timeout", Launched(None, None, True),
                                      tmp_path / "a", 2)
  assert status == "timeout" and error.startswith("rank 1 of 2 hung: it was stopped (process state T")
  assert summary["failed_rank"]["rank"] == 1
  _rank_files(tmp_path / "b", "")
  (tmp_path / "b" / "rank_states.json").write_text('{"0": "S", "1": "S"}')
  _, error, summary = fold_ranks({}, "timeout", "side exceeded its timeout", Launched(None, None, True),
                                 tmp_path / "b", 2)
  assert "failed_rank" not in summary and "ranks still running at the timeout: [0, 1]" in error


def test_fold_ranks_names_a_crashed_rank_from_torchruns_report(tmp_path):
  from harness.ranks import Launched, fold_ranks
  _rank_files(tmp_path / "run", "Traceback ...\nRuntimeError: boom\n")
  crashed = Launched(1, None, False, rank_codes={1: 1}, failed_rank=1)
  status, error, summary = fold_ranks({"status": "crashed"}, "crashed", "worker exited with code 1", crashed,
                                      tmp_path / "run", 2)
  assert status == "crashed" and error.startswith("rank 1 of 2 exited with code 1; the whole side was stopped")
  assert "RuntimeError: boom" in error and summary["nproc"] == 2
  assert {r["rank"]: r["status"] for r in summary["ranks"]} == {0: "stopped", 1: "crashed"}
  on_disk = json.loads((tmp_path / "run" / "rank0.json").read_text())  # its own file no longer says 'running'
  assert on_disk["status"] == "stopped" and on_disk["ended_by"].startswith("the harness")


def test_fold_ranks_puts_the_failed_ranks_own_reason_in_the_first_line(tmp_path):
  """A rank that wrote its own error (a card diff refused before step 1) has that reason in the first line of the
  side's error, which the one-line verdict shows (newcomer, 2026-12-04: a 2-rank FSDP2 card diff read 'exited with
  code 1 ... Its stderr ends:' and nothing after, while one rank says 'CardDiffers: ...')."""
  from harness.ranks import Launched, fold_ranks
  _rank_files(tmp_path / "run", "some warning\n")
  (tmp_path / "run" / "rank1.json").write_text(json.dumps({"rank": 1, "pid": 11, "status": "crashed",
                                                           "error": "CardDiffers: semantics: dtypes.grads\nmore"}))
  crashed = Launched(1, None, False, rank_codes={1: 1}, failed_rank=1)
  _, error, _ = fold_ranks({"status": "crashed"}, "crashed", "worker exited with code 1", crashed, tmp_path / "run", 2)
  assert error.splitlines()[0].startswith("rank 1 of 2 exited with code 1: CardDiffers: semantics: dtypes.grads; "
                                          "the whole side was stopped")


def test_compare_refuses_rank_options_before_anything_runs():
  from parity.pipeline.compare import RunOptions, check_run_options
  from parity.pipeline.resolve import resolve
  spec = resolve("gpt2-tiny", steps=4)
  check_run_options(spec, {}, RunOptions(nproc=2))
  for options, pert, match in [(RunOptions(nproc=3), {}, "must split evenly"),
                               (RunOptions(nproc=2), {"torch": {"fault_rank": 2}}, r"ranks 0\.\.1"),
                               (RunOptions(nproc=2, resume_at=1), {}, "--resume-at with --nproc 2"),
                               (RunOptions(nnodes=2, node_rank=2), {}, "--node-rank"),
                               (RunOptions(hostfile="/nonexistent/hostfile"), {}, "no such file")]:
    with pytest.raises(SpecError, match=match):
      check_run_options(spec, pert, options)


@pytest.mark.process
@pytest.mark.slow
@requires_all
def test_kill_9_of_parity_ends_every_rank(tmp_path):
  """torchrun's ranks are not bound to parity themselves: kill -9 of parity reaches them through the launcher
  (its parent-death signal kills its descendants first, harness.lifetime)."""
  import signal
  import subprocess
  import sys
  import time
  from conftest import ROOT, process_alive
  out = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "parity.cli", "compare", "--preset", "gpt2-tiny", "--steps", "2",
                           "--sides", "torch", "--nproc", "2", "--out", str(out), "--timeout", "600", "--no-progress",
                           "--perturb", "torch:hang_at_step=0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    files, t_end = [out / "torch" / f"rank{k}.json" for k in range(2)], time.time() + 120
    while not all(f.exists() for f in files) and time.time() < t_end and proc.poll() is None:
      time.sleep(0.2)
    pids = [json.loads(f.read_text())["pid"] for f in files]
    assert all(process_alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t_end = time.time() + 5
    while any(process_alive(p) for p in pids) and time.time() < t_end:
      time.sleep(0.1)
    assert not [p for p in pids if process_alive(p)], "a rank outlived its parity process"
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_coordinator_and_multi_host_flags_are_checked():
  from parity.protocol.ranks import check_coordinator
  for ok in (None, "127.0.0.1:29500", "node0.cluster:1", "[::1]:65535"):
    check_coordinator(ok)
  check_coordinator("10.0.0.1:29500", nnodes=2)
  for bad in ("garbage", "127.0.0.1:99999", ":", "127.0.0.1:0", ":29500", "host:", "host:12x"):
    with pytest.raises(SpecError, match="--coordinator .*HOST:PORT.*e.g. --coordinator"):
      check_coordinator(bad)
  with pytest.raises(SpecError, match="--nnodes 2 needs --coordinator HOST:PORT.*e.g. --coordinator 10.0.0.1:29500"):
    check_coordinator(None, nnodes=2)


def test_rank_count_is_bounded_by_cores_or_gpus_and_counted_in_memory(monkeypatch, tmp_path):
  from parity.pipeline.resolve import resolve
  from parity.sizing.resources import (ALLOW_LARGE_ENV, FRAMEWORK_FLOOR_BYTES, check_rank_count, check_resources,
                                       estimate_resources, visible_gpus)
  monkeypatch.delenv(ALLOW_LARGE_ENV, raising=False)
  check_rank_count(2, gpus=0, cpus=2)
  with pytest.raises(SpecError, match=r"--nproc 4096: more ranks than this host's 2 CPU cores.*--nproc 2 or fewer"):
    check_rank_count(4096, gpus=0, cpus=2)
  with pytest.raises(SpecError, match=r"--nproc 9: more ranks than this host's 8 visible GPUs.*--allow-large"):
    check_rank_count(9, gpus=8, cpus=64)
  check_rank_count(4096, gpus=0, cpus=2, allow_large=True)
  monkeypatch.setenv(ALLOW_LARGE_ENV, "1")
  check_rank_count(4096, gpus=0, cpus=2)
  assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3 and visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
  spec = resolve("gpt2-tiny", steps=4)
  one, four = estimate_resources(spec), estimate_resources(spec, nproc=4)
  extra = four.memory_bytes - one.memory_bytes  # 4 x (state + floor) - state: 3 more copies of the state, 4 floors
  assert extra > 4 * FRAMEWORK_FLOOR_BYTES and (extra - 4 * FRAMEWORK_FLOOR_BYTES) % 3 == 0
  monkeypatch.delenv(ALLOW_LARGE_ENV)
  with pytest.raises(SpecError, match=r"memory.*--nproc 1000000 ranks x \(model state"):
    check_resources(spec, tmp_path, nproc=10**6)


def test_compare_refuses_bad_coordinator_and_too_many_ranks(monkeypatch):
  from parity.pipeline.compare import RunOptions, check_run_options
  from parity.pipeline.resolve import resolve
  from parity.sizing.resources import ALLOW_LARGE_ENV
  monkeypatch.delenv(ALLOW_LARGE_ENV, raising=False)
  spec = resolve("gpt2-tiny", steps=4, overrides={"train.micro_batch_size": 4096})
  with pytest.raises(SpecError, match="--nproc 4096: more ranks than this host's"):
    check_run_options(spec, {}, RunOptions(nproc=4096))
  for options, match in [(RunOptions(nnodes=2), "needs --coordinator"),
                         (RunOptions(coordinator="127.0.0.1:99999"), "--coordinator '127.0.0.1:99999'")]:
    with pytest.raises(SpecError, match=match):
      check_run_options(spec, {}, options)


@pytest.mark.process
def test_a_jax_side_past_its_timeout_blames_no_rank_it_killed(tmp_path):
  import sys
  from harness import lifetime
  from harness.ranks import _wait_ranks
  procs = {k: lifetime.spawn([sys.executable, "-c", "import time; time.sleep(30)"], env={}, timeout_s=30)
           for k in range(2)}
  launched = _wait_ranks(procs, "jax", tmp_path, __import__("time").time(), 0.3, None)
  assert launched.timed_out and launched.failed_rank is None and launched.rank_codes == {0: -9, 1: -9}


def test_terminal_summary_says_how_many_ranks_each_side_ran():
  import io
  import types
  from rich.console import Console
  from parity.cli.compare import print_summary
  side = lambda n: {"status": "ok", "series": {"loss": [5.46, 5.15]},
                    "summary": {"steps_completed": 2, **({"nproc": n} if n > 1 else {})}}
  from parity.report.run_record import RunRecord

  class Report(types.SimpleNamespace):  # a Report's typed view of its data, as parity.report.Report gives it
    @property
    def record(self):
      return RunRecord.of(self.data)

    def incomplete_line(self):  # every side asked for ran
      return None

  report = Report(run_dir=Path("runs/x"), checks=[], passed=True, post=None,
                  data={"sides": {"jax": side(2), "torch": side(2)}, "checks": [], "verdict": {"message": "PASS"}})
  out = io.StringIO()
  print_summary(report, Console(file=out, width=160))
  text = out.getvalue()
  assert "2 ranks per side" in text and "jax × 2 ranks" in text and "torch × 2 ranks" in text
  report.data["sides"] = {"jax": side(1)}
  out = io.StringIO()
  print_summary(report, Console(file=out, width=160))
  assert "ranks" not in out.getvalue()
