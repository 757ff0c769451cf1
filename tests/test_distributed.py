"""Multi-process training on one machine (jax.distributed over loopback, gloo): 2 processes x 4
simulated devices train like 1 process x 8 devices, checkpoints cross between 1 and 2 processes,
and `jzero launch` stops the run and names the rank when a process dies."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import jzero
from jzero.config import ConfigError
from jzero.runtime import distributed

from helpers import FAST, ROOT, TINY, cli_env, jzero_cli, read_csv, wait_for

ARGS = [*FAST, "--devices", "8", "--set", "jzero.checkpoint.interval=3"]


def launch(*args, nproc=2, timeout=300):
    return subprocess.run([sys.executable, "-m", "jzero.cli", "launch", "--nproc", str(nproc), "--",
                           sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(), cwd=ROOT)


def losses(out):
    return [float(r["loss"]) for r in read_csv(out / "metrics.csv")]


def assert_losses_close(got, want):
    assert len(got) == len(want)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_two_processes_train_like_one_and_checkpoints_cross(tmp_path, stage):
    """Stage 3 also moves checkpoints: saved by 2 processes -> resumed by 1, and the reverse."""
    zero = ["--set", f"zero_optimization.stage={stage}"]
    steps = ["--steps", "6"] if stage == 3 else ["--steps", "3"]
    one = jzero_cli("train", str(TINY), "--out", str(tmp_path / "one"), *ARGS, *zero, *steps)
    assert one.returncode == 0, one.stderr[-2000:]
    two = launch("train", str(TINY), "--out", str(tmp_path / "two"), *ARGS, *zero, "--steps", "3")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "[rank 0] step      1" in two.stdout and "[rank 1]" not in two.stdout  # only process 0 prints
    want = losses(tmp_path / "one")
    assert_losses_close(losses(tmp_path / "two"), want[:3])
    if stage != 3:
        return
    # 2 processes -> 1: resume the 2-process checkpoint (step 3) in one process
    resumed = jzero_cli("train", str(TINY), "--out", str(tmp_path / "two"), *ARGS, *zero, "--steps", "6")
    assert resumed.returncode == 0 and "resuming from step 3" in resumed.stdout, resumed.stderr[-2000:]
    assert_losses_close(losses(tmp_path / "two"), want)
    # 1 process -> 2: the 1-process run's step-3 checkpoint, resumed by 2 processes
    (tmp_path / "back" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "one" / "checkpoints" / "3", tmp_path / "back" / "checkpoints" / "3")
    back = launch("train", str(TINY), "--out", str(tmp_path / "back"), *ARGS, *zero, "--steps", "6")
    assert back.returncode == 0 and "resuming from step 3" in back.stdout, back.stderr[-3000:]
    assert_losses_close(losses(tmp_path / "back"), want[3:])


@pytest.mark.slow
def test_launch_stops_the_run_when_a_process_dies_and_the_rerun_resumes(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jzero.cli", "launch", "--nproc", "2", "--", sys.executable, "-m", "jzero.cli",
           "train", str(TINY), "--out", str(out), *ARGS, "--steps", "100000", "--set", "jzero.checkpoint.interval=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT)
    try:
        pids = {}
        while len(pids) < 2:  # the launcher names each rank's pid first
            line = proc.stderr.readline()
            assert line, "launcher ended early"
            if line.startswith("jzero launch: rank"):
                pids[int(line.split()[3])] = int(line.split()[5])
        wait_for(lambda: (out / "checkpoints" / "2").is_dir() or proc.poll() is not None, timeout=240)
        assert proc.poll() is None
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        rc = proc.wait(timeout=90)
        elapsed = time.monotonic() - killed_at
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.stderr.close()
    assert rc != 0 and elapsed < 60, (rc, elapsed)
    assert "jzero launch: run failed: rank 1 killed by SIGKILL" in stderr, stderr[-2000:]
    rerun = launch("train", str(TINY), "--out", str(out), *ARGS, "--steps", "3")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming from step" in rerun.stdout


@pytest.mark.parametrize("env,message", [
    ({"JZERO_NUM_PROCESSES": "2", "JZERO_PROCESS_ID": "0"}, "--coordinator (JZERO_COORDINATOR): expected HOST:PORT"),
    ({"JZERO_NUM_PROCESSES": "two"}, "--num-processes (JZERO_NUM_PROCESSES): expected an integer"),
    ({"JZERO_COORDINATOR": "h:1", "JZERO_NUM_PROCESSES": "2", "JZERO_PROCESS_ID": "2"},
     "--process-id (JZERO_PROCESS_ID): must be in 0..1"),
])
def test_bad_settings_name_the_flag_and_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        distributed.settings(environ=env)


def test_settings_come_from_flags_then_env_then_cluster():
    env = {"JZERO_COORDINATOR": "10.0.0.1:9999", "JZERO_NUM_PROCESSES": "4", "JZERO_PROCESS_ID": "3"}
    assert distributed.settings(environ=env) == distributed.Settings("10.0.0.1:9999", 4, 3)
    assert distributed.settings("127.0.0.1:1", 2, 1, environ=env) == distributed.Settings("127.0.0.1:1", 2, 1)
    assert not distributed.settings(environ={}).multi_process
    assert distributed.settings(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}).auto_detect
    assert not distributed.settings(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).multi_process


def test_communication_keys_become_gpu_xla_flags():
    from jzero.runtime import xla_flags

    cfg = jzero.load_config({"train_batch_size": 8, "communication_data_type": "bf16", "bf16": {"enabled": True},
                             "zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 1000,
                                                   "allgather_bucket_size": 10}})
    assert xla_flags.communication_flags(cfg) == [
        "--xla_gpu_enable_latency_hiding_scheduler=false",
        "--xla_gpu_all_reduce_combine_threshold_bytes=2000", "--xla_gpu_reduce_scatter_combine_threshold_bytes=2000",
        "--xla_gpu_all_gather_combine_threshold_bytes=20"]
    assert xla_flags.communication_flags(jzero.load_config({"train_batch_size": 8})) == []  # DeepSpeed's defaults
    assert "no effect on cpu" in xla_flags.describe(["--x=1"], "cpu")
    assert "in effect" in xla_flags.describe(["--x=1"], "gpu")
