"""A whole run across three hosts, and a lost host survived (issue 25, item 1).

Three network namespaces stand for three machines (``benchmarks/net/netns.py``, :func:`netns.hosts`:
own addresses on one routed network, own host names, so no shared-memory shortcut between
the learners): learner hosts A and B run the commands of docs/multi-machine.md under
``torchrun --nnodes 2`` (c10d rendezvous at A), host C runs ``redis-server`` and four
``shardreplay actor`` processes; C's link has 1 ms of delay each way (netem, else the TUN relay).

1. The two learner hosts train until CartPole is solved: an evaluation of 20 greedy episodes
   averages at least 475 (gymnasium's ``reward_threshold`` for CartPole-v1; every periodic
   evaluation is the full 20-episode one here), and a complete checkpoint is made after it.
   ``--stop-return`` is above 500 so that the run goes on: the host loss must come mid-run (a
   run that stops on its return publishes "finished", and the actors would end with it).
2. Every process of host B is killed (SIGKILL): A's rank stops (within ``STOP_S``) with one line that
   names the lost node (``shardreplay train: lost learner node HOST (ADDRESS): ...``), nothing
   is left running on A, the actors on C keep waiting.
3. The page's command for the node left (``torchrun --nnodes 1``, ``--auto-resume``) on A
   continues from the newest complete checkpoint with every step back (both shards onto one
   rank); every actor on C follows its new life and feeds it; a step budget (4,000 steps)
   ends it, and the actors exit 0 with it.

Settings (``SMALL``): the demo's learning settings (``train``'s defaults: a 256x256 network, 32
samples per insert), every evaluation the full 20-episode one, a checkpoint every 250 updates.
Measured on the shared 2-core machine at load average 8-17, four runs: 144-286 s in all
(solved, a 20-episode mean of 475-500, 102-228 s after the start: 3,250-6,000 updates and
17-28k env steps; A stopped 1.6-3.9 s after the kill; the resumed life took 35-52 s, up to
13 s of it restoring). The earlier settings (a 64x64 network, 8 samples per insert: four times the env
steps per update) let a loaded run use up the page's 200k-step budget without an evaluation of
475 (at load 2-6 they reached a 5-episode 475 after 99-133 s), hence an earlier threshold of 200.

Skipped, saying why, where namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gymnasium
import netns
import pytest

from shardreplay import checkpoint
from tests.support.env import REPO
from tests.support.train_runs import TrainRun, manifest_counters, manifest_steps, metrics_rows, wait_until

pytestmark = [pytest.mark.distributed, pytest.mark.redis, pytest.mark.slow]
DELAY_MS = 1.0
# "Solves CartPole": gymnasium's threshold for CartPole-v1 (475), reached by a 20-episode mean.
SOLVED = float(gymnasium.spec("CartPole-v1").reward_threshold or 475.0)
A, B, C = 0, 1, 2
STOP_S = 150.0  # how long host A's rank may take to stop once host B is gone
NETNS = str(Path(netns.__file__).resolve())
DOC = REPO / "docs" / "multi-machine.md"
# The demo's learning settings (256x256 network, 32 samples per insert: it solves CartPole in
# 10-25k env steps, benchmarks/train/RESULTS-demo.md), every evaluation the full 20-episode one
# (so an evaluation of SOLVED is the run's own criterion), a checkpoint every 250 updates.
# Added after the page's flags (the last one counts) on every host.
SMALL = ("--no-plot", "--eval-episodes", "20", "--quick-eval-episodes", "20",
         "--eval-interval-updates", "250", "--checkpoint-interval-updates", "250",
         "--collective-timeout-s", "60", "--max-minutes", "8", "--seed", "3")
# The resumed life's step budget: enough for every actor to follow it (they join within seconds),
# short at 32 samples per insert (one rank learns 2,000 updates in it).
RESUMED_STEPS = 4000


def _doc_commands() -> list[list[str]]:
    """Every command of the page's bash blocks (comments dropped, continued lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    commands = []
    for block in blocks:
        text = re.sub(r"#[^\n]*", "", block).replace("\\\n", " ")
        commands += [shlex.split(line) for line in text.splitlines() if line.strip()]
    return commands


def _doc_command(first: str, *having: str) -> list[str]:
    """The page's one command that starts with ``first`` and holds every word of ``having``."""
    found = [c for c in _doc_commands() if c[0] == first and all(h in c for h in having)]
    assert len(found) == 1, f"docs/multi-machine.md: {len(found)} commands {first} ... {having}: {found}"
    return found[0]


def _on_hosts(command: list[str], hosts: netns.Hosts, run_dir: Path) -> list[str]:
    """The page's command for these hosts: its machines are the namespaces' host names."""
    names = {"learner-a": hosts.namespaces[A], "learner-b": hosts.namespaces[B],
             "redis-host": hosts.namespaces[C], "/shared/runs/cartpole": str(run_dir)}
    return [re.sub("|".join(map(re.escape, names)), lambda m: names[m.group(0)], w) for w in command]


@pytest.fixture
def net() -> Iterator[netns.Hosts]:
    why = netns.unavailable()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    kind = "netem" if netns.tun_unavailable() else "auto"  # no delay rather than no test
    with netns.hosts(3, DELAY_MS, delayed=(C,), kind=kind) as hosts:
        yield hosts


def _on(hosts: netns.Hosts, host: int) -> list[str]:
    """The command prefix that runs a command on ``host`` (its namespace and host name)."""
    return [sys.executable, NETNS, "exec", hosts.namespaces[host]]


@contextlib.contextmanager
def _redis_on(hosts: netns.Hosts, workdir: Path) -> Iterator[None]:
    """redis-server on host C, started as the page says."""
    workdir.mkdir()
    command = _doc_command("redis-server")
    with open(workdir / "redis.log", "wb") as log:
        proc = subprocess.Popen([*_on(hosts, C), *command, "--port", "6379", "--dir", str(workdir)],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        ping = [*_on(hosts, C), "redis-cli", "-h", hosts.namespaces[C], "ping"]
        wait_until(lambda: subprocess.run(ping, capture_output=True, text=True, check=False).stdout.strip()
                   == "PONG", 30, "redis-server on host C")
        yield
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _torchrun(command: list[str], hosts: netns.Hosts, host: int, run_dir: Path, log_dir: Path,
              name: str) -> TrainRun:
    """A ``torchrun`` command of the page, run on ``host`` (python -m torch.distributed.run)."""
    assert command[0] == "torchrun"
    return TrainRun(_on_hosts(command[1:], hosts, run_dir), log_dir, module="torch.distributed.run",
                    prefix=f"{name}-", wrap=_on(hosts, host))


def _best_eval(run_dir: Path) -> float:
    returns = [float(r["eval_return"]) for r in metrics_rows(run_dir) if r.get("eval_return")]
    return max(returns, default=float("-inf"))


def _checkpoint_after_solving(run_dir: Path) -> bool:
    """An evaluation reached SOLVED and a complete checkpoint was made after it."""
    rows = metrics_rows(run_dir)
    solved = [int(r["updates"]) for r in rows if r.get("eval_return") and float(r["eval_return"]) >= SOLVED]
    newest = checkpoint.latest_complete(run_dir / "checkpoints") if solved else None
    return newest is not None and newest >= solved[0]  # a checkpoint's id is its update count


@pytest.mark.timeout(900)
def test_three_hosts_solve_lose_a_learner_host_and_resume(net: netns.Hosts, tmp_path: Path) -> None:
    run_dir = tmp_path / "shared" / "run"
    learners = [*_doc_command("torchrun", "cartpole"), *SMALL]
    assert learners[learners.index("--nnodes") + 1] == "2"
    resume = _doc_command("torchrun", "cartpole-2")  # the page's run on the node left
    at = learners.index("--auto-resume") + 1  # the page's "..." is the rest of step 2's flags
    resume = [*resume[:resume.index("...")], *learners[at:]]
    assert resume[resume.index("--nnodes") + 1] == "1"
    timings: dict[str, float] = {}
    runs: list[TrainRun] = []
    with _redis_on(net, tmp_path / "redis"):
        try:
            start = time.monotonic()
            actor = _on_hosts(_doc_command("shardreplay", "actor", "redis://redis-host:6379/0"), net, run_dir)
            actors = [TrainRun([*actor[1:3], str(i), *actor[4:]], tmp_path, prefix=f"actor{i}-",
                               wrap=_on(net, C)) for i in range(4)]
            runs += actors
            # Past 500 for now: the run must go on after solving, to lose host B mid-run.
            a, b = (_torchrun([*learners, "--stop-return", "501"], net, host, run_dir, tmp_path, name)
                    for host, name in ((A, "a"), (B, "b")))
            runs += [a, b]
            wait_until(lambda: _checkpoint_after_solving(run_dir), 480, f"an evaluation of {SOLVED:g} "
                       "and a checkpoint after it", a, poll_s=1.0)
            timings["solve_s"] = time.monotonic() - start
            best = _best_eval(run_dir)

            killed = time.monotonic()
            b.close()  # SIGKILL to every process of host B
            # Measured 1.4-3.9 s; the bound leaves room for a save in flight on a loaded CI host
            # (the writer runs at nice 10), and a real hang fails with every process's stack.
            code = a.wait_explained(STOP_S, f"host A after host B was killed ({timings})")
            timings["stop_s"] = time.monotonic() - killed
            assert code != 0, a.explain()
            assert a.leftovers() == [], a.explain()
            lost = [line for line in a.stderr().splitlines() if "lost learner node" in line]
            named = f"lost learner node {net.namespaces[B]} ({net.addresses[B]}): "
            assert len(lost) == 1 and lost[0].startswith(f"shardreplay train: {named}"), a.explain()
            assert all(actor.proc.poll() is None for actor in actors)  # they wait for a learner

            root = run_dir / "checkpoints"
            newest = checkpoint.latest_complete(root)
            assert newest is not None
            manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(root, newest))
            saved = manifest_counters(manifest)["env_steps"]
            resumed_at = time.monotonic()
            # A step budget (not the inherited 501) ends it, long enough for every actor to follow.
            budget = ["--total-env-steps", str(saved + RESUMED_STEPS)]
            alone = _torchrun([*resume, *budget], net, A, run_dir, tmp_path, "a-alone")
            runs.append(alone)
            assert alone.wait_explained(240, "the resumed run on host A alone") == 0, alone.explain()
            timings["resume_s"] = time.monotonic() - resumed_at
            summary = alone.summary()
            back = summary["resumed_from"]
            assert back["checkpoint_id"] == newest and back["saved_shards"] == 2 and back["shards"] == 1, back
            assert back["steps"] == back["saved_steps"] == manifest_steps(manifest), (back, manifest.parts)
            assert summary["env_steps"] > saved, summary  # C's actors fed it
            for actor in actors:  # each followed the new life, and ended with it ("finished")
                assert actor.wait(60) == 0, actor.explain()
                assert f"serving run {summary['run_id']} (life 1)" in actor.stderr(), actor.explain()
            print(f"three hosts ({net.delay_kind}, {net.delay_ms} ms each way on C's link): best evaluation "
                  f"{best:.0f}, resumed run stopped by {summary['stopped_by']}, timings {timings}")
        finally:
            for run in runs:
                run.close()
