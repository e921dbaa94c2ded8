"""The workers' thread settings (harness.env.choose_threads / thread_environ): the count from the CPUs, the cgroup
quota and the ranks, never from the load; the wait policy from what else runs; a user's variables kept and said to
be the user's; PARITY_THREADS=off."""
from __future__ import annotations

import json

import pytest

from harness import doctor
from harness.env import PARITY_SET, THREADS_CHOICE, THREADS_SWITCH, choose_threads, thread_environ, worker_env
from parity import environment
from parity.cli.doctor import rows


def _choose(environ=None, **kw):
  args = {"cpus": 2, "quota": None, "load": 3.9, "runnable": 3.0, **kw}
  return choose_threads(environ or {}, **args)


@pytest.mark.parametrize("cpus, quota, ranks, threads", [
    (2, None, 1, 2),     # this machine: every CPU of the affinity mask
    (64, 2.0, 1, 2),     # a container with --cpus 2 on a 64-core host: OpenMP alone would start 64
    (8, 1.5, 1, 1),      # a fractional quota rounds down (the second thread would be throttled)
    (8, 0.5, 1, 1),      # never below one
    (8, 32.0, 1, 8),     # a quota above the mask: the mask
    (2, None, 2, 1),     # two ranks share two CPUs
    (16, None, 4, 4),
    (2, None, 3, 1),     # more ranks than CPUs: one each
])
def test_count_from_cpus_quota_and_ranks(cpus, quota, ranks, threads):
  c = _choose(cpus=cpus, quota=quota, ranks=ranks)
  assert c["env"] == {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"} == c["values"]
  assert c["set_by"] == {"OMP_NUM_THREADS": "parity", "OMP_WAIT_POLICY": "parity"}
  assert c["inputs"] == {"cpus_affinity": cpus, "cpu_quota": quota, "load_1min": 3.9, "runnable_now": 3.0,
                         "ranks": ranks}
  assert f"{threads} thread(s): {cpus} CPU(s) in the affinity mask" in c["reason"]


def test_the_load_never_changes_the_count():
  """The count sets torch's summation order (1 and 2 threads give different gpt2-tiny weights), so a side and its
  rerun must get the same one whatever else runs meanwhile; only the wait policy (which changes no bit) follows it."""
  chosen = [_choose(cpus=4, load=load, runnable=run) for load in (None, 0.0, 1.5, 8.0, 400.0)
            for run in (None, 0.0, 2.0, 50.0)]
  assert {c["env"]["OMP_NUM_THREADS"] for c in chosen} == {"4"}


@pytest.mark.parametrize("cpus, load, runnable, ranks, passive", [
    (2, 0.1, 0.0, 1, False),    # a quiet machine: OpenMP's default, as before
    (2, 1.8, 0.0, 1, False),    # the side that just ended (2 threads) is still in the load average: quiet
    (2, 0.1, 5.0, 1, True),     # a burst now that the last minute did not see: PASSIVE, the cheaper mistake
    (2, 3.5, 0.0, 1, True),     # a busy minute beyond the side's own 2 threads, nobody runnable this instant
    (2, 3.9, 3.0, 1, True),     # another job's worth beside the side's 2 threads on 2 CPUs: busy
    (2, 1.0, 1.2, 1, True),
    (2, None, 3.0, 1, True),    # one input unknown: the other decides
    (2, None, None, 1, False),  # nothing known (no /proc): OpenMP's default
    (8, 0.9, 0.5, 2, False),    # 2 ranks x 4 threads on 8 CPUs, nothing else
    (8, 7.0, 7.0, 8, True),
    (2, 0.0, 0.0, 3, True),     # 3 ranks of 1 thread on 2 CPUs: the side alone oversubscribes
    (16, 1.0, 1.0, 3, False),   # 3 ranks x 5 threads leave one CPU free: one other job fits there
    (16, 3.0, 3.0, 3, True),    # three do not
])
def test_wait_policy_passive_only_when_other_jobs_share_the_cpus(cpus, load, runnable, ranks, passive):
  c = _choose(cpus=cpus, load=load, runnable=runnable, ranks=ranks)
  assert ("OMP_WAIT_POLICY" in c["env"]) is passive and c["env"].get("OMP_WAIT_POLICY", "PASSIVE") == "PASSIVE"
  assert ("OMP_WAIT_POLICY=PASSIVE" if passive else "OMP_WAIT_POLICY unset") in c["reason"]


def test_a_users_variables_are_kept_and_named_as_the_users():
  env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "KMP_BLOCKTIME": "0", "PATH": "/bin"}
  c = _choose(env, cpus=8, load=9.0, runnable=9.0)
  assert c["env"] == {"OMP_WAIT_POLICY": "PASSIVE"}  # only what the user left unset
  assert c["values"] == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
  assert c["set_by"] == {"OMP_WAIT_POLICY": "parity", "OMP_NUM_THREADS": "user"}
  assert c["user"] == {"MKL_NUM_THREADS": "1", "KMP_BLOCKTIME": "0"}
  assert _choose({"OMP_WAIT_POLICY": "ACTIVE"}, load=9.0)["values"]["OMP_WAIT_POLICY"] == "ACTIVE"
  assert c["reason"].startswith("kept as the user set them: OMP_NUM_THREADS=1")
  applied = dict(env)
  thread_environ(applied)
  assert applied["OMP_NUM_THREADS"] == "1" and applied["MKL_NUM_THREADS"] == "1"


def test_thread_environ_is_idempotent_and_tells_its_own_values_from_a_users():
  """A second pass (a test's process started with the conftest's environment, a worker started by the harness)
  re-chooses parity's values; a value the user changed after the first pass is the user's."""
  env: dict[str, str] = {}
  first = thread_environ(env)
  assert {k: env[k] for k in PARITY_SET if k in env} == first["env"] == json.loads(env[THREADS_CHOICE])["env"]
  again = dict(env)
  second = thread_environ(again)  # the wait policy may differ (the machine's load moved): the count may not
  assert set(second["set_by"].values()) == {"parity"} and again["OMP_NUM_THREADS"] == env["OMP_NUM_THREADS"]
  changed = dict(env, OMP_WAIT_POLICY="ACTIVE")
  third = thread_environ(changed)
  assert changed["OMP_WAIT_POLICY"] == "ACTIVE" and third["set_by"]["OMP_WAIT_POLICY"] == "user"
  assert third["set_by"]["OMP_NUM_THREADS"] == "parity"


def test_off_leaves_openmps_defaults_and_removes_parity_s_earlier_values():
  env: dict[str, str] = {}
  thread_environ(env)
  env.update({THREADS_SWITCH: "off", "MKL_NUM_THREADS": "3"})
  c = thread_environ(env)
  assert not any(k in env for k in PARITY_SET) and c["env"] == {} and c["values"] == {}
  assert c["reason"].startswith("PARITY_THREADS=off") and json.loads(env[THREADS_CHOICE])["env"] == {}
  user = {THREADS_SWITCH: "off", "OMP_NUM_THREADS": "3"}
  c = thread_environ(user)
  assert user["OMP_NUM_THREADS"] == "3" and c["set_by"] == {"OMP_NUM_THREADS": "user"}


def test_worker_env_divides_the_cpus_between_ranks(monkeypatch):
  for k in PARITY_SET:
    monkeypatch.delenv(k, raising=False)
  monkeypatch.delenv(THREADS_CHOICE, raising=False)
  n = max(1, min(environment.usable_cpus(), int(environment.cpu_quota() or 10**6)))
  assert worker_env()["OMP_NUM_THREADS"] == str(n)
  assert worker_env(ranks=2)["OMP_NUM_THREADS"] == str(max(1, n // 2))
  monkeypatch.setenv("OMP_NUM_THREADS", "7")
  env = worker_env(ranks=2)
  assert env["OMP_NUM_THREADS"] == "7" and json.loads(env[THREADS_CHOICE])["set_by"]["OMP_NUM_THREADS"] == "user"


def _cgroup(tmp_path, lines: str):
  (tmp_path / "self").write_text(lines)
  return dict(root=str(tmp_path / "fs"), self_cgroup=str(tmp_path / "self"))


def test_cpu_quota_v2_takes_the_tightest_limit_up_the_tree(tmp_path):
  leaf = tmp_path / "fs" / "a" / "b"
  leaf.mkdir(parents=True)
  (leaf / "cpu.max").write_text("max 100000\n")          # the leaf: no limit of its own
  (leaf.parent / "cpu.max").write_text("150000 100000\n")  # its parent: 1.5 CPUs
  (tmp_path / "fs" / "cpu.max").write_text("400000 100000\n")
  assert environment.cpu_quota(**_cgroup(tmp_path, "0::/a/b\n")) == 1.5
  (leaf.parent / "cpu.max").write_text("max 100000\n")
  assert environment.cpu_quota(**_cgroup(tmp_path, "0::/a/b\n")) == 4.0
  (tmp_path / "fs" / "cpu.max").write_text("max 100000\n")
  assert environment.cpu_quota(**_cgroup(tmp_path, "0::/a/b\n")) is None


def test_cpu_quota_v1_and_unreadable(tmp_path):
  cpu = tmp_path / "fs" / "cpu"
  cpu.mkdir(parents=True)
  (cpu / "cpu.cfs_period_us").write_text("100000\n")
  (cpu / "cpu.cfs_quota_us").write_text("-1\n")  # no limit (this 2-core machine)
  assert environment.cpu_quota(**_cgroup(tmp_path, "1:cpu:/\n0::/\n")) is None
  (cpu / "cpu.cfs_quota_us").write_text("250000\n")
  assert environment.cpu_quota(**_cgroup(tmp_path, "1:cpu:/\n0::/\n")) == 2.5
  assert environment.cpu_quota(root=str(tmp_path / "none"), self_cgroup=str(tmp_path / "none")) is None


def test_environment_card_and_doctor_show_the_workers_thread_settings(monkeypatch):
  monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
  monkeypatch.setattr(environment, "cuda_evidence", lambda files=(): None)
  block = doctor.environment_block(quick=True)
  threads = block["worker_threads"]
  assert threads["values"]["OMP_WAIT_POLICY"] == "ACTIVE" and threads["set_by"]["OMP_WAIT_POLICY"] == "user"
  assert block["host"]["cpu_quota"] == environment.cpu_quota()
  row = dict(rows(block))["worker threads"]
  assert "OMP_WAIT_POLICY=ACTIVE (user)" in row and threads["reason"] in row


def test_a_worker_never_inherits_a_rendezvous_port(monkeypatch):
  """A MASTER_PORT left in the harness's environment (a torchrun shell, a DeepSpeed engine built in this process)
  is not handed to the workers: each single-process side picks a free port, a launcher sets its ranks' own."""
  for key in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
    monkeypatch.setenv(key, "46697" if key == "MASTER_PORT" else "0")
  env = worker_env()
  assert not any(k in env for k in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"))
  assert worker_env({"MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"  # what the harness sets itself is kept
