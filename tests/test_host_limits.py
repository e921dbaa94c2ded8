"""Host limits: XLA's pinned-host pool, the cgroup limit and MemAvailable, torch's pinned rounding
(parity.sizing.host_limits), and where they act: the planner, the resource check, the JAX worker's environment, the
numerics flags. Pure Python on fake files and environments; no framework is imported or started."""
from __future__ import annotations

import dataclasses
import json

import pytest

from harness import env as henv
from harness import runner
from parity import numerics_flags as nf
from parity.errors import SpecError
from parity.hf import MODEL_PRESETS
from parity.inputs import InputError
from parity.presets import preset
from parity.sizing import host_limits as hl
from parity.sizing import memory, plans, resources
from parity.spec import RunSpec, TrainSpec, to_dict

GiB = 2**30
VAR = hl.XLA_POOL_ENV
TRAIN = TrainSpec(micro_batch_size=1, seq_len=2048, precision="bf16")


def _llama(plan: str = "scan-offload") -> RunSpec:
  """llama-7b under a plan pair, the run `parity plan --model llama-7b` costs (memory model only: nothing built)."""
  run = RunSpec(model=MODEL_PRESETS["llama-7b"], train=TRAIN, sides=("jax", "deepspeed"))
  return dataclasses.replace(run, deepspeed=plans.PLANS[plan].deepspeed, jax=plans.PLANS[plan].jax)


# ----------------------------------------------------------------------------- the pool

@pytest.mark.parametrize("raw,gib", [(None, None), ("", None), ("  ", None), ("160", 160), (" 96 ", 96), ("1", 1)])
def test_the_pool_variable_is_read_as_whole_gib(raw, gib):
  assert hl.xla_pool_setting({} if raw is None else {VAR: raw}) == gib


@pytest.mark.parametrize("raw", ["1e3", "64GB", "0", "-5", "abc", "1.5", "²", "１６０", "٣", "8589934592"])
def test_a_bad_pool_value_is_refused_naming_the_variable(raw):
  with pytest.raises(SpecError, match=f"{VAR}=.*whole number of GiB"):
    hl.xla_pool_setting({VAR: raw})


def test_the_rule_rounds_need_plus_headroom_up_to_16_gib():
  assert hl.pool_gib_for(0) == 0
  assert hl.pool_gib_for(int(147.7 * GiB)) == 160  # the scan-offload figure
  assert hl.pool_gib_for(int(60 * GiB)) == 64  # 63 GiB with the headroom: still within the default
  assert hl.pool_gib_for(int(61 * GiB)) == 80  # 64.05 GiB: one step over
  assert hl.pool_gib_for(16 * GiB) == 32  # exactly 16 GiB needs the headroom on top


def test_a_decision_sets_the_pool_only_past_the_default_and_never_over_the_user():
  small = hl.pool_decision(40 * GiB, None)
  assert (small.set_by, small.gib, small.env(), small.fits) == ("default", 64, {}, True)
  assert "<= XLA's 64 GiB default pool" in small.statement() and "is not set" in small.statement()
  big = hl.pool_decision(int(147.7 * GiB), None)
  assert (big.set_by, big.gib, big.env()) == ("parity", 160, {VAR: "160"})
  assert big.statement() == (f"jax needs 147.7 GiB pinned host per device > XLA's 64 GiB default pool: the JAX "
                             f"worker gets {VAR}=160")
  user = hl.pool_decision(int(147.7 * GiB), 200)
  assert (user.set_by, user.gib, user.env(), user.rule_gib, user.fits) == ("user", 200, {}, 160, True)
  short = hl.pool_decision(int(147.7 * GiB), 100)
  assert not short.fits and "raise it or unset it" in short.statement()
  assert "raise it to 160" in hl.pool_problem(short, 512 * GiB)
  assert "> 150.0 GiB host memory per device" in hl.pool_problem(big, 150 * GiB)  # need 147.7 fits, the pool not
  assert hl.pool_problem(big, 512 * GiB) is None and hl.pool_problem(small, 1 * GiB) is not None


def test_the_jax_need_is_the_memory_models_pinned_host_bytes():
  run = _llama()
  need = hl.jax_pinned_need_bytes(run)
  assert need == memory.peak_host_bytes(memory.estimate(run, sides=("jax",)), "jax")
  # what `parity plan --model llama-7b` shows in the jax host column: fp32 params and both moments, once (the
  # streamed update writes each layer back in place when the params are offloaded)
  assert f"{need / GiB:.1f}" == "75.3" and need == 12 * memory.param_count(run.model)
  unpinned = dataclasses.replace(run, jax=dataclasses.replace(run.jax, host_memory_kind="unpinned_host"))
  assert hl.jax_pinned_need_bytes(unpinned) == 0
  assert hl.jax_pinned_need_bytes(_llama("zero0")) == 0  # nothing offloaded: nothing pinned
  assert hl.jax_pool(run, {}).gib == 80 and hl.jax_pool(run, {VAR: "500"}).set_by == "user"


# ----------------------------------------------------------------------------- cgroup and MemAvailable

def _write(path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


def test_cgroup_v2_takes_the_tightest_limit_up_the_tree_and_its_working_set(tmp_path):
  root = tmp_path / "cg"
  _write(tmp_path / "self", "0::/job/step\n")
  _write(root / "job" / "memory.max", f"{8 * GiB}\n")
  _write(root / "job" / "step" / "memory.max", "max\n")
  _write(root / "job" / "step" / "memory.current", f"{3 * GiB}\n")
  _write(root / "job" / "step" / "memory.stat", f"anon 1\ninactive_file {GiB}\nactive_file 5\n")
  cg = hl.cgroup_memory(str(root), str(tmp_path / "self"))
  assert cg == {"version": 2, "path": str(root / "job"), "limit_bytes": 8 * GiB, "usage_bytes": 3 * GiB,
                "inactive_file_bytes": GiB}
  _write(tmp_path / "meminfo", "MemTotal: 99999999 kB\nMemAvailable:    20971520 kB\n")  # 20 GiB
  host = hl.host_memory(str(root), str(tmp_path / "self"), str(tmp_path / "meminfo"))
  assert host.mem_available_bytes == 20 * GiB and host.cgroup_headroom_bytes == 6 * GiB  # 8 - (3 - 1)
  assert host.available_bytes == 6 * GiB and host.to_json()["available_bytes"] == 6 * GiB


def test_cgroup_v1_reads_the_mount_root_and_knows_its_unlimited_value(tmp_path):
  root = tmp_path / "cg"
  _write(tmp_path / "self", "4:memory:/process_api/abc\n3:cpuset:/\n")
  _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's 'no limit'
  _write(root / "memory" / "memory.usage_in_bytes", "1000\n")
  cg = hl.cgroup_memory(str(root), str(tmp_path / "self"))
  assert cg["version"] == 1 and cg["limit_bytes"] is None and cg["path"] == str(root / "memory")
  _write(root / "memory" / "process_api" / "abc" / "memory.limit_in_bytes", f"{4 * GiB}\n")
  _write(root / "memory" / "process_api" / "abc" / "memory.stat", f"total_inactive_file {GiB // 2}\n")
  cg = hl.cgroup_memory(str(root), str(tmp_path / "self"))
  assert cg["limit_bytes"] == 4 * GiB and cg["inactive_file_bytes"] == GiB // 2
  host = hl.HostMemory(None, cg)
  assert host.available_bytes == host.cgroup_headroom_bytes == 4 * GiB  # no usage file here: nothing used
  assert hl.cgroup_memory(str(tmp_path / "none"), str(tmp_path / "missing")) is None
  assert hl.mem_available(str(tmp_path / "missing")) is None and hl.HostMemory(None, None).available_bytes is None


def test_the_resource_check_uses_the_smaller_of_memavailable_and_the_cgroup(monkeypatch):
  monkeypatch.setattr(hl, "host_memory", lambda *a, **k: hl.HostMemory(64 * GiB, {"limit_bytes": 2 * GiB,
                                                                                   "usage_bytes": GiB}))
  assert resources.available_memory_bytes() == GiB


def test_the_resource_check_refuses_a_pool_that_cannot_work_on_a_gpu_machine(monkeypatch):
  run = _llama()
  assert resources.check_host_pool(run, available=10**15, gpu=False, environ={VAR: "1"}) is None  # CPU: no pool
  assert resources.check_host_pool(preset("gpt2-tiny"), available=10**15, gpu=True, environ={}).set_by == "default"
  assert resources.check_host_pool(run, available=1024 * GiB, gpu=True, environ={}).gib == 80
  with pytest.raises(InputError, match=f"{VAR}=70 sets .*raise it to 80"):
    resources.check_host_pool(run, available=1024 * GiB, gpu=True, environ={VAR: "70"})
  with pytest.raises(InputError, match="pool of 80 GiB per device .* > 78.0 GiB host memory"):
    resources.check_host_pool(run, available=78 * GiB, gpu=True, environ={})
  with pytest.raises(SpecError, match=VAR):
    resources.check_host_pool(run, available=1024 * GiB, gpu=True, environ={VAR: "lots"})


# ----------------------------------------------------------------------------- torch's pinned rounding

def test_torch_pins_each_block_as_a_power_of_two():
  assert [hl.next_pow2(n) for n in (0, 1, 3, 4, 5, 2**30 + 1)] == [0, 1, 4, 4, 8, 2**31]
  block = int(1.20 * GiB)  # sglang PR #39021: 5 x 1.20 GiB requested, 10.01 GiB pinned (1.67x)
  assert hl.torch_pinned_bytes([block] * 5) == 10 * GiB
  assert hl.torch_pinned_bytes([block] * 5) / (5 * block) == pytest.approx(1.67, abs=0.005)
  assert hl.torch_pinned_bytes([block, 3], round_threshold=GiB) == block + 4  # above the threshold: as asked


@pytest.mark.parametrize("plan,accum", [("zero2-offload", 1), ("zero2-offload", 4), ("zero3-offload-all", 1)])
def test_deepspeeds_pinned_buffers_are_the_memory_models_pinned_rows(plan, accum):
  """The buffers DeepSpeed pins hold exactly the memory model's host rows that are pinned (stage 1/2: master, fp32
  gradient partition, the two staging buffers, the accumulation buffers; stage 3: the fp32 gradient partition and
  the param partition), split as DeepSpeed allocates them; Adam's moments and stage 3's master are not pinned."""
  run = plans.apply_plan(preset("gpt2-tiny"), plan)
  run = dataclasses.replace(run, train=dataclasses.replace(run.train, grad_accum_steps=accum))
  rows = [r for r in memory.estimate(run, sides=("deepspeed",)) if r.kind == "host"]
  unpinned = {"optimizer_moments"} | ({"master_params"} if run.deepspeed.zero_stage == 3 else set())
  blocks = hl.deepspeed_pinned_blocks(run)
  assert sum(b for _, b in blocks) == sum(r.bytes for r in rows if r.category not in unpinned)
  cost = hl.deepspeed_pinned_cost(run)
  assert cost.pinned_bytes == hl.torch_pinned_bytes(b for _, b in blocks) and cost.ratio >= 1
  assert hl.deepspeed_pinned_blocks(plans.apply_plan(preset("gpt2-tiny"), "zero2")) == []


# ----------------------------------------------------------------------------- the planner and `parity plan`

def test_the_planner_states_the_pool_and_refuses_one_that_does_not_work():
  """The pairs as named, all of the optimizer state offloaded (opt_ratios (1,)): scan-offload pins 75.3 GiB. With the
  planner's partial offload (the default) the choice pins less (test_jax_offload_ratio)."""
  model = MODEL_PRESETS["llama-7b"]
  full = (1.0,)
  best, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["H100"], host_bytes=512 * GiB, opt_ratios=full)
  assert best.name == "scan-offload" and best.jax_pool["gib"] == 80 and best.jax_pool["set_by"] == "parity"
  assert json.loads(json.dumps(plans.ranking_json(best, ranked)))["ranked"][0]["jax_pool"] is None  # zero0: none
  _, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["H100"], host_bytes=512 * GiB, xla_pool_gib=70,
                                opt_ratios=full)
  scan = {c.name: c for c in ranked}["scan-offload"]
  assert not scan.fits and any(f"{VAR}=70" in p and "user's value is kept" in p for p in scan.problems)
  _, ranked = plans.choose_plan(model, TRAIN, plans.HARDWARE["H100"], host_bytes=78 * GiB, opt_ratios=full)
  scan = {c.name: c for c in ranked}["scan-offload"]
  assert scan.host_bytes["jax"] <= 78 * GiB and not scan.fits  # the need fits the host, its 80 GiB pool does not
  assert any("pool of 80 GiB per device" in p for p in scan.problems)


def test_pin_memory_costs_deepspeeds_host_bytes_as_torch_pins_them():
  model = MODEL_PRESETS["llama-7b"]
  hw = plans.HARDWARE["H100"]
  plain = {c.name: c for c in plans.choose_plan(model, TRAIN, hw, sides=("deepspeed",))[1]}
  pinned = {c.name: c for c in plans.choose_plan(model, TRAIN, hw, sides=("deepspeed",), pin_memory=True)[1]}
  c = pinned["zero2-offload"]
  assert c.deepspeed_pinned["pinned_bytes"] > c.deepspeed_pinned["requested_bytes"] > 0
  extra = c.deepspeed_pinned["pinned_bytes"] - c.deepspeed_pinned["requested_bytes"]
  assert c.host_bytes["deepspeed"] == plain["zero2-offload"].host_bytes["deepspeed"] + extra
  assert plain["zero2-offload"].deepspeed_pinned is None and pinned["zero0"].deepspeed_pinned["pinned_bytes"] == 0


def test_parity_plan_states_the_requirement_and_the_pool_setting(capsys, monkeypatch):
  """The target: `parity plan --model llama-7b --device-memory 80GB` states the pinned-host requirement
  and the pool setting it will use; a user's value is kept and said so; a bad one exits 2 naming the variable. (The
  pairs as named: --opt-ratios 1 offloads all of the optimizer state, as before the planner chose a share.)"""
  from parity.cli import main
  monkeypatch.delenv(VAR, raising=False)
  assert main(["plan", "--model", "llama-7b", "--device-memory", "80GB", "--opt-ratios", "1"]) == 0
  out = " ".join(capsys.readouterr().out.split())  # the console wraps at its width
  assert "74.5 GiB device memory" in out  # 80 GB is decimal
  assert (f"pinned host of scan-offload: jax needs 75.3 GiB pinned host per device > XLA's 64 GiB default pool: the "
          f"JAX worker gets {VAR}=80; the 80 GiB pool, one per GPU, fits the 512 GiB host memory per device") in out
  monkeypatch.setenv(VAR, "200")
  assert main(["plan", "--model", "llama-7b", "--device-memory", "80GiB"]) == 0
  assert f"<= the 200 GiB pool {VAR}=200 sets (the user's value, kept)" in " ".join(capsys.readouterr().out.split())
  monkeypatch.setenv(VAR, "2e2")
  assert main(["plan", "--model", "llama-7b"]) == 2
  assert f"parity plan: error: {VAR}='2e2'" in capsys.readouterr().err
  monkeypatch.delenv(VAR)
  with pytest.raises(SystemExit):  # a size argparse cannot read
    main(["plan", "--device-memory", "lots"])


# ----------------------------------------------------------------------------- the JAX worker's environment

def test_the_jax_worker_gets_the_pool_before_jax_starts_and_a_users_value_is_kept():
  run = _llama()
  env = {"PATH": "/bin"}
  choice = henv.host_pool_environ(env, run)
  assert env[VAR] == "80" and choice["set_by"] == "parity" and choice["value"] == "80"
  assert json.loads(env[henv.HOST_POOL_CHOICE])["env"] == {VAR: "80"}
  again = henv.host_pool_environ(env, run)  # idempotent: parity's earlier value is parity's, chosen again
  assert again["set_by"] == "parity" and env[VAR] == "80"
  user = {VAR: "300"}
  choice = henv.host_pool_environ(user, run)
  assert user[VAR] == "300" and choice["set_by"] == "user" and choice["user_value"] == "300"
  assert choice["rule_gib"] == 80  # both recorded: the user's value and the rule's
  small = {}
  assert henv.host_pool_environ(small, preset("gpt2-tiny"))["set_by"] == "default" and VAR not in small
  bad = {VAR: "big"}
  choice = henv.host_pool_environ(bad, run)
  assert bad[VAR] == "big" and "error" in choice and choice["env"] == {}


def test_the_runner_sizes_the_pool_from_request_json_with_the_sides_perturbation(tmp_path):
  run = _llama()
  request = {"run": to_dict(run), "perturb": {"jax": {"kill_at_step": 3}}}
  (tmp_path / "request.json").write_text(json.dumps(request))
  env: dict[str, str] = {}
  runner._host_pool(env, tmp_path, "jax")
  assert env[VAR] == "80"
  other: dict[str, str] = {}
  runner._host_pool(other, tmp_path, "deepspeed")
  assert other == {}
  request["perturb"] = {"jax": {"jax.host_memory_kind": "unpinned_host"}}
  (tmp_path / "request.json").write_text(json.dumps(request))
  env = {}
  runner._host_pool(env, tmp_path, "jax")
  assert VAR not in env and json.loads(env[henv.HOST_POOL_CHOICE])["need_bytes"] == 0
  (tmp_path / "request.json").write_text("{}")  # no run: a test's fake worker
  env = {}
  runner._host_pool(env, tmp_path, "jax")
  assert env == {}


# ----------------------------------------------------------------------------- numerics flags

def test_numerics_flags_read_xla_flags_and_the_variables():
  assert nf.parse_xla_flags("--a=1 --xla_b  --a=2 junk '--c=x y'") == {"a": "2", "xla_b": "true", "c": "x y"}
  environ = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_pipelined_host_offloading "
                          "--xla_force_host_platform_device_count=2", "JAX_REMAT3": "1"}
  block = nf.numerics_flags(environ)
  v = block["values"]
  assert v["XLA_FLAGS --xla_gpu_enable_latency_hiding_scheduler"] == "true"
  assert v["XLA_FLAGS --xla_gpu_enable_pipelined_host_offloading"] == "true"
  assert v["JAX_REMAT3"] == "1" and v["JAX_DEFAULT_MATMUL_PRECISION"] is None and v[VAR] is None
  assert block["other_xla_flags"] == ["xla_force_host_platform_device_count"] and block["set_by"][VAR] == "default"
  with_pool = nf.numerics_flags(environ, pool={"value": "160", "set_by": "parity"})
  assert with_pool["values"][VAR] == "160" and with_pool["set_by"][VAR] == "parity"
  assert nf.flag_values(with_pool)[VAR] == "160" and nf.flag_values(None) is None and nf.flag_values({}) is None
