"""``shardreplay train``: distributed Ape-X DQN with sharded prioritized replay (its
settings, output and errors: docs/train.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from shardreplay.checkpoint.manifest import (
    checkpoint_dir,
    incomplete_reason,
    latest_complete,
    list_checkpoints,
)
from shardreplay.cli.train_flags import HelpFormatter, add_settings_flags, given_settings
from shardreplay.errors import CheckpointFormatError, ConfigError, IncompleteCheckpointError, ShardReplayError
from shardreplay.runtime.log_lines import configure_logging, exit_directly
from shardreplay.runtime.settings import TrainSettings, settings_for_resume
from shardreplay.secrets import ENV, adopt, mask, needs_password, read_password_file

_DESCRIPTION = """Distributed Ape-X DQN with sharded prioritized replay: learner ranks, actors,
checkpoints. Every setting is a flag; a run ends with one line saying whether it was
solved, its final evaluation and where its files are (summary.json has the details)."""


def add_parser(subparsers: Any) -> None:
    """Register ``train`` on an argparse subparsers object."""
    p = subparsers.add_parser("train", help="train distributed Ape-X DQN (default: CartPole-v1)",
                              description=_DESCRIPTION, formatter_class=HelpFormatter,
                              usage="%(prog)s [--config FILE] [--resume RUN_DIR] [--SETTING VALUE ...]")

    def config(group: Any) -> None:
        group.add_argument("--config", type=Path, metavar="FILE",
                           help="YAML file of settings: flat names as the flags (alpha: 0.6) or group "
                                "sections (replay: {alpha: 0.6}); flags given here win")

    groups = add_settings_flags(p, first={"run": config})
    groups["transport"].add_argument(
        "--redis-password-file", metavar="FILE", default=None,
        help="Redis password: FILE's first line (or $SHARDREPLAY_REDIS_PASSWORD)")
    ckpt = groups["checkpoints"]
    ckpt.add_argument("--resume", type=Path, metavar="RUN_DIR",
                      help="continue RUN_DIR from its newest complete checkpoint (flags override its "
                           "settings)")
    ckpt.add_argument("--checkpoint-id", type=int, metavar="N",
                      help="with --resume: continue from complete checkpoint N, not the newest "
                           "(newer ones move to checkpoints/incomplete/)")
    ckpt.add_argument("--no-replay", action="store_true",
                      help="with --resume: weights and counters, no replay")
    ckpt.add_argument("--auto-resume", action="store_true",
                      help="continue --run-dir from its newest complete checkpoint, else start it "
                           "(for a job a scheduler may restart; docs/train.md)")
    p.set_defaults(func=run)


def without_secrets(settings: TrainSettings, password_file: str | None) -> TrainSettings:
    """The settings with any Redis password taken out of their URLs (into this process's
    environment, which the learners and actors inherit), so nothing written holds it.

    Raises:
        ConfigError: the password file cannot be read, or a URL whose password was
            redacted (a resumed run) has none to connect with.
    """
    if password_file:
        read_password_file(password_file)
    url, policy = adopt(settings.transport.url), adopt(settings.transport.policy_url)
    if (needs_password(url) or needs_password(policy)) and ENV not in os.environ:
        raise ConfigError(f"the run's Redis URL {url if needs_password(url) else policy} needs its password, "
                          f"which run files never hold: set {ENV} or pass --redis-password-file FILE")
    return settings.updated({"transport": url, "policy_url": policy})


def _settings(args: argparse.Namespace) -> tuple[TrainSettings, bool]:
    """The run's settings (given, from --config, or a resumed run's with the given ones
    over them; without secrets) and whether it resumes."""
    given = given_settings(args)
    if args.checkpoint_id is not None and args.resume is None:
        raise ConfigError("--checkpoint-id needs --resume RUN_DIR (the run to continue from that checkpoint)")
    if args.no_replay and args.resume is None:
        raise ConfigError("--no-replay needs --resume RUN_DIR (the run whose weights to continue without "
                          "its replay)")
    if args.resume is not None:
        _check_resumable(args.resume, args.checkpoint_id)
    resume_dir = args.resume or _resumable(args)
    if resume_dir is not None:
        settings = settings_for_resume(resume_dir, given)
    else:
        settings = TrainSettings()
        if args.config is not None:
            try:
                settings = TrainSettings.from_dict(read_config(args.config))
            except ConfigError as exc:
                raise ConfigError(f"--config {args.config}: {exc}") from None
        settings = settings.updated(given)
    return without_secrets(settings, args.redis_password_file), resume_dir is not None


def read_config(path: Path) -> dict[str, Any]:
    """The mapping a YAML settings file holds (an empty file: no settings).

    Raises:
        ConfigError: no such file, unreadable, not YAML, or not a mapping (one line each).
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError("no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"must be a YAML mapping of settings ('name: value' lines), got a "
                          f"{type(data).__name__}")
    return data


def _check_resumable(run_dir: Path, checkpoint_id: int | None = None) -> None:
    """``--resume``: refuse, before any process starts, a run directory without a
    complete checkpoint (or ``checkpoint_id`` not complete: IncompleteCheckpointError), or
    whose newest checkpoint is damaged (CheckpointFormatError: continuing from an older one
    must be asked for)."""
    if not Path(run_dir).is_dir():
        raise IncompleteCheckpointError(f"--resume {run_dir}: no such run directory; start a run there "
                                        f"with --run-dir {run_dir}")
    root = Path(run_dir) / "checkpoints"
    if checkpoint_id is not None:
        directory = checkpoint_dir(root, checkpoint_id)
        why = incomplete_reason(directory) if directory.is_dir() else "no such checkpoint"
        if why is None:
            return
        complete = [c for c in list_checkpoints(root) if incomplete_reason(checkpoint_dir(root, c)) is None]
        raise IncompleteCheckpointError(f"--resume {run_dir} --checkpoint-id {checkpoint_id}: {why}; "
                                        f"complete checkpoints: {', '.join(map(str, complete)) or 'none'}")
    newest = latest_complete(root)
    damaged = _damaged_newer(root, newest)
    if damaged is not None:
        head = f"--resume {run_dir}: checkpoint {damaged[0]} is damaged ({damaged[1]})"
        if newest is None:
            raise CheckpointFormatError(f"{head} and no older checkpoint is complete: start the run afresh "
                                        f"with --run-dir {run_dir} --auto-resume (which moves it to "
                                        f"{root / 'incomplete'}), or use another --run-dir")
        raise CheckpointFormatError(f"{head}; the newest complete one is {newest}: continue from "
                                    f"it with --resume {run_dir} --checkpoint-id {newest} (or "
                                    f"--run-dir {run_dir} --auto-resume, which takes it too)")
    if newest is not None:
        return
    if not list_checkpoints(root):
        raise IncompleteCheckpointError(f"--resume {run_dir}: no checkpoint under {root}; start the run "
                                        f"with --run-dir {run_dir} (or --auto-resume)")
    raise IncompleteCheckpointError(
        f"--resume {run_dir}: no complete checkpoint under {root}, only incomplete ones (a run stopped "
        f"before every rank saved): start it again with --run-dir {run_dir} --auto-resume (which sets "
        "them aside and starts afresh), or use another --run-dir")


def _damaged_newer(root: Path, newest_complete: int | None) -> tuple[int, str] | None:
    """The newest checkpoint newer than ``newest_complete`` that is damaged (not merely
    incomplete), with why (:func:`shardreplay.checkpoint.manifest.incomplete_reason`), or None."""
    for cid in reversed(list_checkpoints(root)):
        if newest_complete is not None and cid <= newest_complete:
            return None
        why = incomplete_reason(checkpoint_dir(root, cid), missing=False)
        if why is not None:
            return cid, why
    return None


def _resumable(args: argparse.Namespace) -> Path | None:
    """``--auto-resume``: the run directory when it holds a complete checkpoint, else None
    (the run starts afresh; the launcher sets incomplete ones aside). Checkpoints appear
    only once every rank runs, so under torchrun all ranks see the same answer here."""
    if not args.auto_resume:
        return None
    if not args.run_dir:
        raise ConfigError("--auto-resume needs --run-dir (the directory to continue or start)")
    run_dir = Path(args.run_dir)
    newest = latest_complete(run_dir / "checkpoints")
    damaged = _damaged_newer(run_dir / "checkpoints", newest)
    if damaged is not None:  # set aside with the incomplete ones: say it is not one of them
        taken = "starts afresh" if newest is None else f"continues from checkpoint {newest}"
        logging.getLogger("shardreplay.train").warning(
            "%s: checkpoint %d is damaged (%s); --auto-resume sets it aside and %s", run_dir, damaged[0],
            damaged[1], taken)
    if (run_dir / "config.json").exists() and newest is not None:
        return run_dir
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``train``; returns the exit code (a rank under torchrun exits here instead)."""
    from shardreplay.runtime.launch.launcher import under_torchrun

    # Under torchrun every rank writes to the same terminal: its lines say which rank.
    rank = f" rank {os.environ['RANK']}" if under_torchrun() else ""
    configure_logging(logging.INFO, f"%(asctime)s{rank} %(name)s: %(message)s")
    code = _run(args)
    if under_torchrun():  # as the spawned learner ranks do (see exit_directly)
        exit_directly(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        settings, resume = _settings(args)
        from shardreplay.runtime.launch.launcher import train

        summary = train(settings, resume, auto_resume=bool(args.auto_resume),
                        checkpoint_id=args.checkpoint_id, replay=not args.no_replay)
    except ShardReplayError as exc:
        print(mask(f"shardreplay train: {exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the launcher took over the signal
        print("shardreplay train: interrupted before training started", file=sys.stderr)
        return 130
    if summary.get("rank", 0) == 0:  # one line for the run, not one per rank
        print(final_line(summary))
    if summary.get("storage_error") or summary.get("storage_stop"):
        print(f"shardreplay train: {storage_advice(summary)}", file=sys.stderr)
        return 2
    if summary.get("stopped_by") == "actors":
        print(f"shardreplay train: {actors_advice(summary)}", file=sys.stderr)
        return 2
    return 0


def actors_advice(summary: dict[str, Any]) -> str:
    """One line for a run that stopped because every actor gave up: why nothing more
    would arrive, where their errors are, and the command that continues."""
    run_dir = summary.get("run_dir")
    return (f"every actor gave up ({summary.get('actors_given_up')} died after "
            f"{summary.get('actor_restarts')} restarts in all; their errors are above), so no new "
            f"experience would arrive: training stopped and saved {Path(summary['checkpoint']).name}. "
            f"Fix what makes them fail, then continue with --run-dir {run_dir} --auto-resume "
            "(learners that wait for actors started elsewhere take --remote-actors N)")


def storage_advice(summary: dict[str, Any]) -> str:
    """One line for a run that ended because its file system refused a write: what was
    refused, the checkpoint a continuation starts from, and the command that continues."""
    run_dir = Path(summary.get("run_dir") or Path(summary["checkpoint"]).parents[1])
    newest = latest_complete(run_dir / "checkpoints")
    kept = "no complete checkpoint yet (the run starts afresh)" if newest is None else \
        f"the newest complete checkpoint is {checkpoint_dir(run_dir / 'checkpoints', newest).name}"
    refused = summary.get("storage_error") or "another rank's file system refused a write (its line names it)"
    return (f"{refused}; {kept}. Free space (or make it writable), then continue with --run-dir {run_dir} "
            "--auto-resume")


def final_line(summary: dict[str, Any]) -> str:
    """The sentence that ends a run: solved or not, the final evaluation, where the files are."""
    if summary.get("stopped_during_startup"):
        where = summary.get("run_dir")
        again = f" Continue it with --run-dir {where} --auto-resume." if where else ""
        return f"Stopped on request while starting: nothing new was trained or saved.{again}"
    run_dir = summary.get("run_dir") or str(Path(summary.get("checkpoint", ".")).parents[2])
    steps = f"{summary.get('env_steps', 0):,} environment steps"
    if summary.get("offline"):  # no environment step: the updates on the dataset say what happened
        steps = f"{summary.get('updates', 0):,} updates on the {summary.get('dataset_steps', 0):,} " \
                f"steps of {summary['offline']} (offline)"
    final, target = summary.get("final_eval_return"), summary.get("stop_return")
    where = summary.get("stop_return_from")
    goal = "" if where is None and target is None else f"; no target: {where}" if target is None else \
        f"; target {target:g}" + (f" from {where}" if where else "")
    evaluation = "no final evaluation" if final is None else \
        f"final evaluation {final:.1f} (mean return of {summary.get('eval_episodes')} greedy episodes{goal})"
    why = {"solved": "Solved", "signal": "Stopped on request (not solved)",
           "storage": "Stopped: the file system refused a write (not solved)",
           "actors": "Stopped: every actor gave up (not solved)",
           "env_steps": "Not solved (step budget used up)", "time": "Not solved (time limit reached)"}
    head = why.get(str(summary.get("stopped_by")), "Finished")
    plot = "" if "learning_curve" in summary and summary["learning_curve"] is None else "learning_curve.png, "
    return f"{head} after {steps}: {evaluation}. Files in {run_dir}/ (summary.json, metrics.csv, " \
           f"{plot}checkpoints/)."
