"""``shardreplay export RUN --out policy.safetensors``: a run's policy network as one file.

The weights of the network actors act with (DQN's Q-network, SAC's tanh-Gaussian policy,
R2D2's recurrent Q-network), with the settings that rebuild it (``algo``, network kind,
observation shape, action count or Box bounds, hidden sizes, environment) and its origin
(updates, evaluation) in the safetensors metadata;
``shardreplay.runtime.policy_file.load_policy(path)`` rebuilds it.
``--which`` as for ``shardreplay evaluate``. Exit codes: 0 written, 2 no such run or policy.

``shardreplay export RUN --minari ID`` writes instead the run's experience as the Minari
dataset ``ID`` (under ``MINARI_DATASETS_PATH``): the steps of its newest complete
checkpoint (``--which ID``: that one), or with ``--from rollouts`` every chunk a
``train --keep-rollouts`` run kept; episodes per actor stream, priorities, policy
version, actor and stream ids in the step infos (docs/offline.md). ``--jobs N``: up to N
processes write a checkpoint's shards in parallel. Exit code 2 also for an id that
exists, or a run without a checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardreplay.cli import plain
from shardreplay.cli.evaluate import add_which, resolve_which
from shardreplay.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    """Register ``export`` on argparse subparsers."""
    p = subparsers.add_parser("export", help="write a run's policy (weights + network) as .safetensors",
                              description=plain(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN", help="the run directory (--run-dir of train)")
    p.add_argument("--out", type=Path, help="the .safetensors file to write")
    add_which(p)
    m = p.add_argument_group("Minari dataset (pip install 'shardreplay[minari]')")
    m.add_argument("--minari", metavar="ID", help="write the run's experience as this Minari dataset instead")
    m.add_argument("--from", dest="source", choices=("checkpoint", "rollouts"), default="checkpoint",
                   help="what to read: the steps a checkpoint holds (default), or every chunk a "
                        "train --keep-rollouts run kept")
    m.add_argument("--format", choices=("hdf5", "arrow"), default="hdf5",
                   help="Minari's storage: hdf5 (default; what TorchRL reads) or arrow")
    m.add_argument("--unstack", action="store_true", help="frame stacks: keep each stack's newest frame only")
    m.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="processes writing a checkpoint's shards at once (default 1)")
    m.add_argument("--partial", choices=("seal", "drop"), default="seal",
                   help="episodes a shard holds only in part: sealed as truncated (default) or dropped; "
                        "counted in the dataset's metadata either way")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """``shardreplay export``; returns the exit code.

    Raises:
        ShardReplayError: no such run or policy, or flags that do not go together (``main``
            prints it, exit 2).
    """
    if args.minari is not None:
        return _export_minari(args)
    if args.out is None:
        raise ConfigError("give --out FILE (the policy) or --minari ID (the experience)")
    from shardreplay.runtime.policy_file import policy_of_run, save_policy

    which = resolve_which(args.run_dir, args.which)
    policy = policy_of_run(args.run_dir, which)
    save_policy(args.out, policy.net, policy.meta)
    print(json.dumps({"out": str(args.out), "which": which, **policy.described()}))
    return 0


def _export_minari(args: argparse.Namespace) -> int:
    """``export --minari ID``: a checkpoint's steps as a Minari dataset."""
    import numpy as np

    from shardreplay.offline import ChunkEpisodes, export_checkpoint, write_dataset
    from shardreplay.runtime.envs import make_env
    from shardreplay.runtime.learner.wal import iter_rollouts
    from shardreplay.runtime.settings import settings_for_resume

    if args.jobs < 1 or (args.jobs > 1 and args.source == "rollouts"):
        raise ConfigError(f"--jobs {args.jobs}: give a count >= 1; parallel export reads a checkpoint's "
                          "shards, so with --from rollouts leave --jobs out")
    settings = settings_for_resume(args.run_dir, {})
    which = args.which or "latest"
    if which == "best" or not (which == "latest" or which.isdigit()):
        raise ConfigError(f"--which {which!r}: with --minari, latest or a checkpoint id")
    layout = settings.streams
    homes: dict[tuple[int, int], tuple[int, int]] = {}  # (shard, row) -> (actor, stream)
    for actor in range(layout.num_actors):
        envs = np.arange(layout.envs_per_actor)
        for env, (shard, row) in enumerate(zip(layout.shards(actor).tolist(),
                                               layout.rows(actor, envs).tolist(), strict=True)):
            homes[(shard, row)] = (actor, env)

    def origin(shard: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pairs = np.array([homes.get((shard, int(r)), (-1, -1)) for r in rows], np.int64).reshape(-1, 2)
        return pairs[:, 0], pairs[:, 1]

    with make_env(settings.run.source) as env:
        options = {"observation_space": env.observation_space, "action_space": env.action_space,
                   "env_spec": env.spec, "data_format": args.format, "unstack": args.unstack, "metadata": {
                       "run_dir": str(args.run_dir), "env_id": settings.run.env_id,
                       "algo": settings.learners.algo, "from": args.source}}
    if args.source == "rollouts":
        episodes = ChunkEpisodes((kept.chunk for kept in iter_rollouts(args.run_dir)), args.partial)
        summary = write_dataset(episodes, args.minari, counts=episodes.counts, **options)
    else:
        summary = export_checkpoint(args.run_dir / "checkpoints", args.minari, partial=args.partial,
                                    checkpoint_id=None if which == "latest" else int(which), origin=origin,
                                    jobs=args.jobs, **options)
    print(json.dumps(summary))
    return 0
