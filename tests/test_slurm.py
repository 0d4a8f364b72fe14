"""The slurm launch path (launch/slurm/).

- The rank script's mapping of slurm's environment onto moespec's rendezvous, checked with fake
  SLURM_* variables (no cluster needed; in the default suite).
- A real one-node slurm cluster (munge + slurmctld + slurmd, all under a temp dir) that runs
  `sbatch launch/slurm/cpu-test.sbatch` with 2 tasks (and llama-draft.sbatch on the tiny Llama pair,
  and deepseek-v3-ep.sbatch cut down to one node of 2 CPU ranks), then asks the leader for a greedy
  completion and checks that its text and token count equal a single-process run of the same
  config (same overrides, parallel.ep_size=1) in this process. The cases share one cluster and
  run in the default suite (about 15 s a case).

The test installs nothing: CI's `.ci/run` installs Debian's slurm-wlm and munge (as root) and sets
CI=true. Where slurm/munge are missing, will not start, or we are not root, the cluster cases
skip with the reason, except under CI=true (or 1), where they fail instead, so CI cannot pass
without having run the launch scripts for real.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple, NoReturn

import pytest

from moespec.config import load_config, parse_override
from moespec.llm import LLM
from moespec.parallel.groups import read_launch_env
from moespec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SLURM_DIR = ROOT / "launch" / "slurm"
RANK_SCRIPT = SLURM_DIR / "moespec-rank.sh"


# --- the environment-variable contract -----------------------------------------------------------

def run_rank_script(env_extra: dict[str, str], *args: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"MOESPEC_DRY_RUN": "1", "MOESPEC_HOME": str(ROOT)}, **env_extra)
    out = subprocess.run(["bash", str(RANK_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    resolved = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line and ":" not in line.split("=")[0])
    resolved["_stdout"] = out.stdout
    return resolved


@pytest.mark.parametrize("procid,localid", [(0, 0), (11, 3)])
def test_rank_script_maps_slurm_env_to_rendezvous(procid, localid):
    slurm = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "16", "SLURM_LOCALID": str(localid),
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242",
             "RANK": "5", "WORLD_SIZE": "99"}  # stale torchrun values from the submitting shell must not win
    resolved = run_rank_script(slurm, "serve", "--config", "configs/deepseek-v3.yaml", "--port", "8123")
    assert resolved["MASTER_ADDR"] == "gpu07"                  # head node = first host of the allocation
    assert resolved["MASTER_PORT"] == str(20000 + 4242 % 10000)  # derived from the job id
    assert resolved["COMMAND"].endswith("serve --config configs/deepseek-v3.yaml --port 8123")
    # what moespec itself will read in that environment
    child_env = {k: resolved[k] for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")}
    child_env["SLURM_JOB_NODELIST"] = resolved["SLURM_JOB_NODELIST"]
    launch = read_launch_env(child_env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (procid, 16, localid)
    assert (launch.master_addr, launch.master_port) == ("gpu07", 24242)
    if procid == 0:
        assert "serving the OpenAI API on http://" in resolved["_stdout"] and ":8123/v1" in resolved["_stdout"]
    else:
        assert "serving" not in resolved["_stdout"]


def test_rank_script_keeps_given_master_and_refuses_without_slurm():
    resolved = run_rank_script({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node1",
                                "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29600"}, "serve")
    assert (resolved["MASTER_ADDR"], resolved["MASTER_PORT"], resolved["SLURM_LOCALID"]) == ("10.0.0.5", "29600", "0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(RANK_SCRIPT), "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "srun" in out.stderr


def test_rank_script_expands_nodelist_without_scontrol(tmp_path):
    # a PATH without scontrol: the script falls back on moespec's own nodelist parser
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "head", "hostname"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    resolved = run_rank_script({"PATH": str(bindir), "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                                "SLURM_JOB_NODELIST": "a100-[003-004],cpu9",
                                "MOESPEC_BIN": str(Path(sys.executable).parent / "moespec")}, "serve")
    assert resolved["MASTER_ADDR"] == "a100-003"


def test_sbatch_templates_are_valid_bash():
    for script in sorted(SLURM_DIR.glob("*.sbatch")) + [RANK_SCRIPT]:
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script.name}: {out.stderr}"
        text = script.read_text()
        assert "set -euo pipefail" in text, script.name
    names = {p.name for p in SLURM_DIR.glob("*.sbatch")}
    assert {"deepseek-v3-ep.sbatch", "llama-draft.sbatch", "cpu-test.sbatch"} <= names


# --- a real one-node slurm cluster ---------------------------------------------------------------

NEEDED = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_tool(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)


def missing_tools() -> list[str]:
    return [t for t in NEEDED if not find_tool(t)]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def cannot_run(reason: str) -> NoReturn:
    """No cluster here: a skip with the reason, or a failure under CI=true, where it must run."""
    if in_ci():
        pytest.fail(f"{reason} (CI={os.environ['CI']}: the slurm cluster test must run in CI)", pytrace=False)
    pytest.skip(reason)


def require_slurm() -> None:
    missing = missing_tools()
    if missing:
        cannot_run(f"slurm/munge are not installed (missing {', '.join(missing)}); "
                   "`apt-get install slurm-wlm munge` as root, as CI's .ci/run does")
    if os.geteuid() != 0:
        cannot_run("this one-node cluster runs slurmctld/slurmd/munged as root (SlurmUser=root); not root here")


def write_cluster(tmp: Path, ctld_port: int, slurmd_port: int) -> tuple[Path, Path]:
    """slurm.conf for one node 'localhost' with everything (state, spool, pids, logs) under tmp."""
    for sub in ("state", "spool", "log", "munge"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    munge_socket = tmp / "munge" / "munge.socket"
    mem_mb = max(1024, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2)
    cpus = max(2, os.cpu_count() or 2)
    conf = tmp / "slurm.conf"
    conf.write_text(f"""\
ClusterName=moespectest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={tmp / 'state'}
SlurmdSpoolDir={tmp / 'spool'}
SlurmctldPidFile={tmp / 'slurmctld.pid'}
SlurmdPidFile={tmp / 'slurmd.pid'}
SlurmctldLogFile={tmp / 'log' / 'slurmctld.log'}
SlurmdLogFile={tmp / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    return conf, munge_socket


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"({path.name}: none)"


def stop_pidfile(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def kill_tree_processes(marker: str) -> None:
    """End leftover processes whose command line names this test's temp dir (ours only)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline or marker in environ:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_rank_script_puts_each_rank_on_its_own_gpu():
    resolved = run_rank_script({"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                                "SLURM_JOB_NODELIST": "gpu[07-08]", "MOESPEC_DEVICE_PER_RANK": "cuda"}, "serve")
    assert resolved["COMMAND"].endswith("serve --set model.device=cuda:5")


class Case(NamedTuple):
    sbatch_args: list[str]      # sbatch options
    submit_env: dict[str, str]  # environment at submit time
    config: str                 # the config the job serves
    script_sets: str            # the overrides the sbatch file itself passes with --set (before MOESPEC_SET)


CASES = {
    "cpu-test.sbatch": Case(["--ntasks=2"], {}, "configs/tiny-deepseek-mtp-ep2.yaml", ""),
    # the single-node draft-target template, on the tiny Llama pair and without the GPU/memory request
    "llama-draft.sbatch": Case(["--gpus-per-node=0", "--mem=1G", "--cpus-per-task=1"],
                               {"MOESPEC_CONFIG": "configs/tiny-llama-draft.yaml", "MOESPEC_HOST": "127.0.0.1",
                                "MOESPEC_SET": "model.device=cpu"},
                               "configs/tiny-llama-draft.yaml", "speculation.mode=draft"),
    # the N-node EP template cut down to one node x 2 CPU ranks: tiny MoE checkpoint, gloo, no GPUs
    "deepseek-v3-ep.sbatch": Case(["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"],
                                  {"MOESPEC_CONFIG": "configs/tiny-deepseek-mtp-ep2.yaml", "MOESPEC_HOST": "127.0.0.1",
                                   "MOESPEC_DEVICE_PER_RANK": "", "MOESPEC_SET": "parallel.dist_backend=gloo "
                                   "parallel.moe_backend=torch model.device=cpu model.attention_backend=torch"},
                                  "configs/tiny-deepseek-mtp-ep2.yaml",
                                  "parallel.ep_size=2 parallel.dist_backend=nccl speculation.mode=mtp"),
}

PROMPT, MAX_TOKENS = "def fibonacci(n):", 16
REFERENCES: dict[str, tuple[str, int]] = {}  # repr(config) -> (text, completion tokens) of one process


def reference_overrides(case: Case) -> dict:
    sets = case.script_sets.split() + case.submit_env.get("MOESPEC_SET", "").split()
    overrides = dict(parse_override(kv) for kv in sets)
    overrides["parallel.ep_size"] = 1  # one process holds every expert
    return overrides


def single_process_completion(case: Case) -> tuple[str, int]:
    """The greedy completion of the case's config run in this process, computed once per config."""
    config = load_config(ROOT / case.config, reference_overrides(case))
    key = repr(config)
    if key not in REFERENCES:
        llm = LLM(config=config)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.close()
        REFERENCES[key] = (out.text, len(out.token_ids))
    return REFERENCES[key]


def complete_concurrently(base: str, count: int) -> list[dict]:
    """`count` greedy completions of PROMPT sent at once (rank 0 places them on different ranks)."""
    import threading
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    answers: list = [None] * count

    def complete(i: int) -> None:
        request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answers[i] = json.loads(r.read())
    threads = [threading.Thread(target=complete, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    assert all(answers), "a completion did not arrive"
    return answers


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_missing_slurm_skips_outside_ci(monkeypatch, ci):
    monkeypatch.setitem(globals(), "missing_tools", lambda: ["slurmctld"])
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="missing slurmctld"):
        require_slurm()


@pytest.mark.parametrize("ci", ["true", "True", "TRUE", "1"])
def test_missing_slurm_fails_in_ci(monkeypatch, ci):
    monkeypatch.setitem(globals(), "missing_tools", lambda: ["slurmctld"])
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="missing slurmctld.*must run in CI"):
        require_slurm()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node slurm cluster (munged, slurmctld, slurmd) shared by the sbatch cases: its
    environment and directory."""
    require_slurm()
    tmp = tmp_path_factory.mktemp("cluster")
    conf, munge_socket = write_cluster(tmp, free_port(), free_port())
    key = tmp / "munge" / "munge.key"
    env = dict(os.environ, SLURM_CONF=str(conf))
    for k in list(env):
        if k.startswith("SLURM_") and k != "SLURM_CONF" or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            del env[k]
    env["MOESPEC_TEST_CLUSTER"] = str(tmp)  # marks every process of this cluster for cleanup

    def start(cmd: list[str], what: str) -> None:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            cannot_run(f"{what} would not start here: {(out.stderr or out.stdout).strip()[-800:]}")

    try:
        start([find_tool("mungekey"), "--create", "--force", f"--keyfile={key}"], "mungekey")
        os.chmod(key, 0o400)
        start([find_tool("munged"), "--force", f"--socket={munge_socket}", f"--key-file={key}",
               f"--pid-file={tmp / 'munge' / 'munged.pid'}", f"--log-file={tmp / 'munge' / 'munged.log'}",
               f"--seed-file={tmp / 'munge' / 'munged.seed'}"], "munged")
        start([find_tool("slurmctld"), "-f", str(conf)], "slurmctld")
        start([find_tool("slurmd"), "-f", str(conf), "-N", "localhost"], "slurmd")

        deadline = time.monotonic() + 60
        while True:  # the node registers with the controller
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
            state = out.stdout.strip()
            if out.returncode == 0 and state and state.rstrip("*") in ("idle", "mixed", "allocated"):
                break
            if time.monotonic() > deadline:
                cannot_run(f"slurm started but its node never came up (sinfo: {state!r} {out.stderr.strip()}); "
                            f"slurmctld log: {tail(tmp / 'log' / 'slurmctld.log', 800)} "
                            f"slurmd log: {tail(tmp / 'log' / 'slurmd.log', 800)}")
            time.sleep(1)
        yield env, tmp
    finally:
        stop_pidfile(tmp / "slurmd.pid")
        stop_pidfile(tmp / "slurmctld.pid")
        stop_pidfile(tmp / "munge" / "munged.pid")
        kill_tree_processes(str(tmp))


@pytest.mark.parametrize("sbatch_file", list(CASES))
def test_sbatch_serves_a_completion(cluster, sbatch_file):
    env, tmp = cluster
    case = CASES[sbatch_file]
    job_id, port = None, free_port()
    log_dir = tmp / f"moespec-logs-{sbatch_file}"  # also marks this job's processes for cleanup
    try:
        job_env = dict(env, MOESPEC_PORT=str(port), MOESPEC_LOG_DIR=str(log_dir), MASTER_PORT=str(free_port()),
                       MOESPEC_TEST_JOB=str(log_dir),
                       MOESPEC_HOME=str(ROOT), **case.submit_env)
        sub = subprocess.run(["sbatch", "--parsable", f"--output={tmp / 'job-%j.out'}", *case.sbatch_args,
                              str(SLURM_DIR / sbatch_file)],
                             env=job_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert sub.returncode == 0, f"sbatch failed: {sub.stderr}"
        job_id = sub.stdout.strip().split(";")[0]

        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 150
        while True:  # the leader loads the checkpoint, joins rank 1, then serves
            try:
                status, _ = http_get(f"{base}/health", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            logs = "\n".join(f"--- {p.name}\n{tail(p)}" for p in sorted(log_dir.glob("rank-*.log")))
            if state in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                pytest.fail(f"job {job_id} ended ({state or 'gone'}) before serving:\n"
                            f"{tail(tmp / f'job-{job_id}.out')}\n{logs}")
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} ({state}) did not serve /health within 150 s:\n"
                            f"{tail(tmp / f'job-{job_id}.out')}\n{logs}")
            time.sleep(1)

        # as many concurrent requests as ranks: with data-parallel attention each rank runs one
        ntasks = 1 if sbatch_file == "llama-draft.sbatch" else 2
        answers = complete_concurrently(base, ntasks)
        # the job's ranks (and speculation) produce exactly what one process does with the same config
        text, num_tokens = single_process_completion(case)
        for answer in answers:
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "length", answer
            assert "speculation" in answer["usage"], answer
            assert (choice["text"], answer["usage"]["completion_tokens"]) == (text, num_tokens), answer
        if ntasks > 1:  # rank 1 ran its own requests (data-parallel attention), not rank 0's batches
            assert "rank 1 serving (attention: dp)" in tail(log_dir / "rank-1.log", 100_000)
            metrics = http_get(f"{base}/metrics")[1]
            assert 'moespec_rank_kv_pages_free{rank="1"}' in metrics, metrics[-2000:]

        # the leader said where it serves, and each rank has its own log
        assert sorted(p.name for p in log_dir.glob("rank-*.log")) == [f"rank-{i}.log" for i in range(ntasks)]
        assert f"http://127.0.0.1:{port}/v1" in tail(log_dir / "rank-0.log", 100_000)
        assert f"http://127.0.0.1:{port}/v1" in tail(tmp / f"job-{job_id}.out", 100_000)
    finally:
        if job_id is not None:
            subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                left = subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True,
                                      timeout=30).stdout.strip()
                if not left:
                    break
                time.sleep(1)
        kill_tree_processes(str(log_dir))
