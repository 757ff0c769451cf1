"""A stuck process never hangs the job: the step watchdog, start-up and barrier timeouts, the
launcher's stall detection and the checkpoint step every process agrees on. The end-to-end cases
run 2 processes x 4 simulated devices over loopback with a fault injected into one of them
(``JZERO_FAULT``, test-only)."""
import json
import shutil
import subprocess
import sys
import time

import pytest

import jzero
from jzero.config import ConfigError
from jzero.runtime import launch, progress, watchdog
from jzero.runtime.launch import free_port

from helpers import FAST, ROOT, TINY, cli_env, jzero_cli, read_csv

TIMEOUT = 12  # jzero.watchdog.step_timeout in the stall tests (first phases get min_timeout, 300)
ARGS = [*FAST, "--devices", "8", "--steps", "8", "--set", "jzero.train.eval_interval=4",
        "--set", "jzero.checkpoint.interval=2"]
STALL = ["--set", f"jzero.watchdog.step_timeout={TIMEOUT}"]
FAULT = {"JZERO_FAULT": "1:data:5:600"}  # rank 1 sleeps in the data phase of step 5, before its collective


def report(rank, step, phase, since=0.0, updated=100.0, timeout=None):
    return progress.Report(rank=rank, pid=1000 + rank, host="h", started=0.0, step=step, phase=phase, since=since,
                           updated=updated, timeout=timeout)


# ------------------------------------------------------------------------------------------
# the pieces, in one process
# ------------------------------------------------------------------------------------------
def test_likely_cause_names_the_rank_furthest_behind():
    stuck = {0: report(0, 4, "compute/collective"), 1: report(1, 4, "data"), 2: report(2, 4, "compute/collective")}
    assert [r.rank for r in progress.behind(stuck)] == [1]
    assert progress.likely_cause(stuck, 3, now=30.0).startswith("likely cause: rank 1 (pid 1001 on h) in data "
                                                                "of step 5 for 30 s")
    assert progress.likely_cause({0: report(0, 4, "data")}, 2) == "likely cause: rank 1 (no progress report)"
    level = {0: report(0, 6, "compute/collective"), 1: report(1, 6, "compute/collective")}
    assert progress.behind(level) == []  # negative control: nobody is behind when all are level
    assert "all 2 ranks are in compute/collective of step 7" in progress.likely_cause(level, 2)
    assert [r.rank for r in progress.behind({0: report(0, 2, "checkpoint"), 1: report(1, 3, "data")})] == [0]


def test_progress_reports_round_trip_and_old_ones_are_ignored(tmp_path):
    progress.write(tmp_path, report(0, 3, "evaluation", updated=50.0))
    progress.write(tmp_path, report(1, 3, "data", updated=10.0))
    (tmp_path / "rank2.json").write_text("{not json")
    assert progress.read_all(tmp_path) == {0: report(0, 3, "evaluation", updated=50.0),
                                           1: report(1, 3, "data", updated=10.0)}
    assert list(progress.read_all(tmp_path, since=20.0)) == [0]
    assert progress.read_all(tmp_path / "absent") == {}


def test_launcher_steps_in_only_past_a_watched_ranks_timeout():
    now = 1000.0
    reports = {0: report(0, 4, "compute/collective", since=now - 10, updated=now, timeout=20),
               1: report(1, 4, "data", since=now - 20 - launch.STALL_GRACE_S - 1, updated=now, timeout=20),
               2: report(2, 4, "data", since=now - 500, updated=now, timeout=None),  # unwatched
               3: report(3, 4, "data", since=now - 5, updated=now - launch.STALL_GRACE_S - 1, timeout=20)}
    assert [r.rank for r in launch.stalled(reports, [None] * 4, now)] == [1, 3]
    assert [r.rank for r in launch.stalled(reports, [None, 1, None, None], now)] == [3]  # rank 1 has exited
    assert launch.describe_exit(watchdog.EXIT_STALLED) == "exit code 75 (its watchdog: stalled)"


class Exited:
    """A process that has already ended with ``code``."""
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_launcher_blames_the_stalled_rank_even_when_all_ended_within_one_poll(tmp_path, capsys):
    # rank 1's watchdog exits 75; rank 0's collective fails at once with code 1, before the next poll
    assert launch._supervise([Exited(1), Exited(watchdog.EXIT_STALLED)], [], tmp_path) == watchdog.EXIT_STALLED
    assert "run failed: rank 1 exit code 75 (its watchdog: stalled)" in capsys.readouterr().err
    assert launch._supervise([Exited(-9), Exited(1)], [], tmp_path) == 1
    assert "run failed: rank 0 killed by SIGKILL" in capsys.readouterr().err
    assert launch._supervise([Exited(0), Exited(0)], [], tmp_path) == 0
    assert launch._supervise([Exited(0), Exited(-2)], [2], tmp_path) == 130  # a forwarded Ctrl-C: 128 + SIGINT


def test_timeout_is_fixed_or_derived_and_a_first_phase_gets_the_floor(tmp_path):
    fixed = watchdog.Watchdog(0, 1, tmp_path, tmp_path, timeout=20, floor=300)
    fixed.enter("data", 0)
    assert fixed.timeout == 300  # the first data phase may compile: at least the floor
    fixed.enter("compute/collective")
    fixed.step_done(1, 0.5)
    fixed.enter("data")
    assert fixed.timeout == 20 and fixed.report.step == 1 and fixed.report.phase == "data"
    derived = watchdog.Watchdog(0, 1, tmp_path, tmp_path, floor=1.0)
    derived.enter("data", 0)
    derived.enter("data", 0)
    for step, seconds in enumerate([0.1, 0.3, 0.2], start=1):
        derived.step_done(step, seconds)
    assert derived.timeout == pytest.approx(watchdog.FACTOR * 0.3)
    assert watchdog.auto_timeout([0.01], floor=300) == 300


def test_backstop_is_rearmed_only_when_its_margin_leaves_the_band(tmp_path, monkeypatch):
    armed = []
    monkeypatch.setattr(watchdog.faulthandler, "dump_traceback_later", lambda s, exit: armed.append(round(s)))
    monkeypatch.setattr(watchdog.faulthandler, "cancel_dump_traceback_later", lambda: armed.append("off"))
    w = watchdog.Watchdog(0, 1, tmp_path, tmp_path, timeout=12, floor=300)
    w.enter("data", 0)
    assert armed == []  # not inside ``with``: nothing is armed
    w.active = True
    w.enter("compute/collective")  # first of its kind: 300 s
    w.enter("data")  # first data phase was before: 12 s, the 330 s backstop is too late
    for _ in range(100):  # a hundred quick phases: the armed margin stays in [15, 30] s
        w.enter("compute/collective")
        w.enter("data")
    w.pause()
    assert armed == [300 + watchdog.BACKSTOP_S, 12 + watchdog.BACKSTOP_S, "off"]


@pytest.mark.parametrize("text,message", [
    ("1:data:5", "expected rank:phase:step:seconds"), ("one:data:5:9", "expected rank:phase:step:seconds"),
    ("1:loading:5:9", "unknown phase 'loading'; valid: start-up, restore, data")])
def test_bad_fault_spec_names_the_variable(text, message):
    with pytest.raises(ValueError, match=f"JZERO_FAULT: {message}"):
        watchdog.Fault.from_env({"JZERO_FAULT": text})
    assert watchdog.Fault.from_env({}) is None


@pytest.mark.parametrize("key", ["step_timeout", "min_timeout", "startup_timeout"])
def test_non_positive_timeouts_are_refused(key):
    with pytest.raises(ConfigError, match=rf"jzero.watchdog.{key}: must be > 0 seconds, got -1"):
        jzero.load_config({"train_batch_size": 8, "jzero": {"watchdog": {key: -1}}})


@pytest.mark.slow  # a whole stalled `jzero train` process (the default suite's budget)
def test_a_stalled_single_process_exits_with_its_stacks(tmp_path):
    """No launcher, one process: stuck in a checkpoint save, it says where and exits 75."""
    out = tmp_path / "run"
    env = {**cli_env(), "JZERO_FAULT": "0:checkpoint:3:600"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jzero.cli", "train", str(TINY), "--out", str(out), *FAST,
                           "--devices", "1", "--set", "jzero.watchdog.step_timeout=5",
                           "--set", "jzero.watchdog.min_timeout=60"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == watchdog.EXIT_STALLED, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 90
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("jzero watchdog:"))
    assert "rank 0 made no progress" in line and "in checkpoint of step 3" in line, line
    assert "likely cause" not in line  # one process: nobody else to blame
    stacks = (out / "watchdog" / "rank0-stacks.txt").read_text()
    assert "in enter" in stacks and "Thread" in stacks
    assert json.loads((out / "progress" / "rank0.json").read_text())["phase"] == "checkpoint"


def test_watchdog_off_means_no_thread_and_no_reports(tmp_path):
    cfg = jzero.load_config({"train_batch_size": 8, "jzero": {"watchdog": {"enabled": False}}})
    with watchdog.from_config(cfg, tmp_path) as watch:
        watch.enter("data", 0)
    assert isinstance(watch, watchdog.Unwatched) and not (tmp_path / "progress").exists()


# ------------------------------------------------------------------------------------------
# end to end: 2 processes x 4 devices
# ------------------------------------------------------------------------------------------
def losses(out):
    return [float(r["loss"]) for r in read_csv(out / "metrics.csv")]


def train_cmd(out, *extra):
    return [sys.executable, "-m", "jzero.cli", "train", str(TINY), "--out", str(out), *ARGS, *extra]


def by_hand(outs, tmp_path, *extra, env=None, timeout=300):
    """Process i of 2 started with --coordinator/--num-processes/--process-id, its --out outs[i];
    returns [(returncode, stderr, when it exited)]."""
    port = free_port()
    logs = [tmp_path / f"stderr{i}.txt" for i in range(len(outs))]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(train_cmd(outs[i], "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                                    "2", "--process-id", str(i), *extra),
                                          stdout=subprocess.DEVNULL, stderr=f, env={**cli_env(), **(env or {})},
                                          cwd=ROOT))
    ended = {}
    deadline = time.time() + timeout
    try:
        while len(ended) < len(procs) and time.time() < deadline:
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
    return [(p.wait(), log.read_text(), ended.get(i)) for i, (p, log) in enumerate(zip(procs, logs, strict=True))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of an uninterrupted 8-step run on one process x 8 devices."""
    out = tmp_path_factory.mktemp("reference")
    proc = jzero_cli("train", str(TINY), "--out", str(out), *ARGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return losses(out)


@pytest.mark.slow
def test_launched_run_with_a_stuck_rank_stops_names_it_and_resumes(tmp_path, reference):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jzero.cli", "launch", "--nproc", "2", "--", *train_cmd(out, *STALL)]
    stuck = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**cli_env(), **FAULT}, cwd=ROOT)
    ended = time.time()
    assert stuck.returncode == watchdog.EXIT_STALLED, stuck.stderr[-3000:]
    failed = next(ln for ln in stuck.stderr.splitlines() if ln.startswith("jzero launch: run failed"))
    assert "likely cause: rank 1 " in failed and "in data of step 5" in failed, failed
    assert "[rank 1] jzero watchdog: rank 1 made no progress" in stuck.stderr
    assert (out / "watchdog" / "rank1-stacks.txt").is_file()
    # the stuck phase began when rank 1 entered it; its report stays in the launcher's folder only,
    # so time the stall from the step-4 checkpoint (written just before step 5's data phase)
    began = (out / "checkpoints" / "4").stat().st_mtime
    assert ended - began < TIMEOUT + 30 + 10, ended - began  # 10 s: launcher shutdown of the survivors
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env(), cwd=ROOT)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming from step 4" in rerun.stdout
    assert losses(out) == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
def test_stuck_rank_without_launcher_both_exit_in_time(tmp_path):
    out = tmp_path / "run"
    results = by_hand([out, out], tmp_path, *STALL, env=FAULT)
    stuck_since = json.loads((out / "progress" / "rank1.json").read_text())["since"]
    for rank, (code, stderr, ended) in enumerate(results):
        assert code != 0 and ended is not None, (rank, code, stderr[-2000:])
        assert ended - stuck_since < TIMEOUT + 30, (rank, ended - stuck_since)
    code, stderr, _ = results[1]
    assert code == watchdog.EXIT_STALLED, stderr[-2000:]
    line = next(ln for ln in stderr.splitlines() if ln.startswith("jzero watchdog:"))
    assert "rank 1 made no progress" in line and "in data of step 5" in line, line
    assert "rank1-stacks.txt" in line and (out / "watchdog" / "rank1-stacks.txt").is_file()
    assert "in enter" in (out / "watchdog" / "rank1-stacks.txt").read_text()  # the injected sleep


@pytest.mark.slow
@pytest.mark.parametrize("present,message", [
    (0, "process 1 never joined the coordinator"), (1, "process 0 (the coordinator) is not listening")])
def test_a_process_that_never_starts_is_named_within_the_startup_timeout(tmp_path, present, message):
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.run(train_cmd(tmp_path / "run", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                    "--process-id", str(present), "--set", "jzero.watchdog.startup_timeout=10"),
                          capture_output=True, text=True, timeout=120, env=cli_env(), cwd=ROOT)
    elapsed = time.monotonic() - t0
    assert proc.returncode == watchdog.EXIT_STALLED, proc.stderr[-2000:]
    assert elapsed < 10 + 30, elapsed  # the timeout plus the interpreter's start
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("jzero: error: start-up:"))
    assert message in line and f"127.0.0.1:{port}" in line and "jzero.watchdog.startup_timeout" in line, line


@pytest.mark.slow
def test_a_checkpoint_damaged_in_one_process_view_makes_both_fall_back(tmp_path, reference):
    """Process 0 reads run/, process 1 a copy whose step 4 is damaged: both restore step 2."""
    out = tmp_path / "run"
    first = subprocess.run([sys.executable, "-m", "jzero.cli", "launch", "--nproc", "2", "--",
                            *train_cmd(out, "--steps", "4")],
                           capture_output=True, text=True, timeout=300, env=cli_env(), cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    view = tmp_path / "view"
    shutil.copytree(out, view)
    # damage what process 1 reads: the arrays it wrote (OCDBT may split them over several files,
    # so the largest file of the whole step can be one that only process 0 reads)
    written = (view / "checkpoints" / "4" / "state" / "ocdbt.process_1" / "d").iterdir()
    damaged = max(written, key=lambda p: p.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    # --steps 4 again: the restored runs retrain steps 3 and 4, whose checkpoint both views list
    results = by_hand([out, view], tmp_path, "--steps", "4")
    for rank, (code, stderr, _) in enumerate(results):
        assert code == 0, (rank, stderr[-3000:])
        assert "restored step 2 because newer checkpoints are unreadable (step 4: process 1: its arrays are " \
               "unreadable" in stderr, (rank, stderr[-2000:])
    assert losses(out) == pytest.approx(reference[:4], rel=1e-5)  # steps 3, 4 retrained from step 2


@pytest.mark.slow
def test_a_process_that_never_reaches_the_first_barrier_is_named(tmp_path):
    """Both join the coordinator; process 1 then hangs before the start barrier."""
    results = by_hand([tmp_path / "run"] * 2, tmp_path, "--set", "jzero.watchdog.startup_timeout=10",
                      env={"JZERO_FAULT": "1:start-up:1:600"}, timeout=120)
    code, stderr, _ = results[0]
    assert code == watchdog.EXIT_STALLED, stderr[-2000:]
    assert "jzero: error: start-up: barrier 'jzero-start': process 1 did not arrive within 10 s" in stderr, \
        stderr[-2000:]


@pytest.mark.slow
def test_backstop_ends_a_process_whose_main_thread_holds_the_gil(tmp_path):
    """A C call that never releases the GIL (a catastrophic regex) starves the watchdog thread;
    faulthandler's C thread, armed for the phase, dumps the stacks and ends the process."""
    script = (f"import re; from pathlib import Path; from jzero.runtime import watchdog\n"
              f"w = watchdog.Watchdog(0, 1, Path({str(tmp_path)!r}), Path({str(tmp_path)!r}), timeout=1, floor=1)\n"
              "with w:\n"
              "    w.enter('compute/collective', 0)\n"
              "    re.match(r'(a+)+$', 'a' * 64 + 'b')\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=cli_env(), cwd=ROOT)
    assert proc.returncode == 1 and time.monotonic() - t0 < 1 + watchdog.BACKSTOP_S + 20, proc.stderr[-2000:]
    assert "Timeout" in proc.stderr and "in <module>" in proc.stderr, proc.stderr[-2000:]
