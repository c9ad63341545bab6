"""``shardreplay checkpoint inspect|verify PATH``: look at and check replay checkpoints.

PATH is one checkpoint (``.../ckpt-<id>``), a checkpoint root holding several, or a run
directory (``train --run-dir``: its ``checkpoints/``).

* ``inspect``: shards, steps, episodes, sealed/dropped partial episodes, a priority
  summary (min/mean/max of the stored priorities), the files saved beside the buffer
  and completeness; for a root, every checkpoint id with its completeness, then the newest complete one,
  and the run's rollouts archive (``train --keep-rollouts``): segments, bytes, steps, the
  time span of the chunks' insertion, every record's checksums checked (exit 1 on damage).
* ``verify``: reads every block of every part and checks its hash, the descriptions and
  the arrays; exits 1 with the reason on any problem (for a root: any checkpoint).

Exit codes: 0 fine, 1 a problem was found, 2 PATH is not a checkpoint (or root).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from shardreplay.checkpoint.manifest import checkpoint_dir, latest_complete, list_checkpoints
from shardreplay.cli import plain
from shardreplay.errors import CheckpointError, ConfigError


def _summary() -> Any:
    # Imported when a command runs: it loads the buffer (and torch), which every other
    # ``shardreplay`` command (``train``'s launcher among them) would otherwise pay for.
    from shardreplay.checkpoint import summary

    return summary


_PATH_HELP = "a checkpoint directory (ckpt-<id>), a checkpoint root or a run directory"


def add_parser(subparsers: Any) -> None:
    """Register ``checkpoint`` (with ``inspect`` and ``verify``) on argparse subparsers."""
    p = subparsers.add_parser("checkpoint", help="inspect or verify replay checkpoints",
                              description=plain(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    ins = sub.add_parser("inspect", help="describe a checkpoint, or every checkpoint under a root")
    ins.add_argument("path", type=Path, help=_PATH_HELP)
    ins.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ins.add_argument("--no-priorities", action="store_true",
                     help="skip the priority summary (reads each part's priority array)")
    ins.set_defaults(func=run_inspect)
    ver = sub.add_parser("verify", help="check every block of every part; exit 1 on any problem")
    ver.add_argument("path", type=Path, help=_PATH_HELP)
    ver.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ver.set_defaults(func=run_verify)


def _resolved(given: Path) -> tuple[Path, str]:
    """``given`` (a run directory: its ``checkpoints/`` root) and what it is: a
    ``checkpoint`` or a ``root`` holding checkpoints.

    Raises:
        ConfigError: it is neither (``main`` prints it, exit 2).
    """
    summary, path = _summary(), given
    if (path / "checkpoints").is_dir() and not summary.is_checkpoint_dir(path):
        path = path / "checkpoints"
    if path.is_dir() and summary.is_checkpoint_dir(path):
        return path, "checkpoint"
    if path.is_dir() and list_checkpoints(path):
        return path, "root"
    raise ConfigError(f"{given} is neither a checkpoint directory (ckpt-<id>), nor a directory holding "
                      "checkpoints, nor a run directory with checkpoints/")


def run_inspect(args: argparse.Namespace) -> int:
    """``shardreplay checkpoint inspect``; returns the exit code (ConfigError: PATH has no checkpoint)."""
    path, kind = _resolved(args.path)
    priorities = not args.no_priorities
    try:
        if kind == "checkpoint":
            doc: dict[str, Any] = _summary().summarize(path, priorities=priorities)
        else:
            from shardreplay.runtime.learner.wal import archive_summary

            newest = latest_complete(path)
            summary = _summary()
            doc = {"root": str(path), "checkpoints": summary.list_status(path),
                   "newest_complete": newest,
                   "newest": None if newest is None else summary.summarize(checkpoint_dir(path, newest),
                                                                           priorities=priorities),
                   "rollouts": archive_summary(path.parent)}  # the run's (None: none)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    elif kind == "checkpoint":
        print("\n".join(_describe(doc)))
    else:
        print("\n".join(_describe_root(doc)))
    return 1 if (doc.get("rollouts") or {}).get("damaged") else 0


def run_verify(args: argparse.Namespace) -> int:
    """``shardreplay checkpoint verify``; exit code 1 on any problem (ConfigError: PATH has no checkpoint)."""
    path, kind = _resolved(args.path)
    dirs = [path] if kind == "checkpoint" else \
        [checkpoint_dir(path, c) for c in list_checkpoints(path)]
    results = []
    for directory in dirs:
        try:
            results.append({"directory": str(directory), "ok": True, **_summary().verify(directory)})
        except CheckpointError as exc:
            results.append({"directory": str(directory), "ok": False, "reason": str(exc)})
    bad = [r for r in results if not r["ok"]]
    if args.json:
        print(json.dumps({"ok": not bad, "checkpoints": results}, indent=1, sort_keys=True))
    else:
        for r in results:
            if r["ok"]:
                print(f"OK    {r['directory']}: {r['num_shards']} parts, {r['steps']} steps, "
                      f"{r['bytes']} bytes in {r['blocks']} checked blocks")
            else:
                print(f"FAIL  {r['directory']}: {r['reason']}")
    for r in bad:
        print(f"error: {r['directory']}: {r['reason']}", file=sys.stderr)
    return 1 if bad else 0


def _describe_root(doc: dict[str, Any]) -> list[str]:
    lines = [f"checkpoint root {doc['root']}: {len(doc['checkpoints'])} checkpoint(s)"]
    for c in doc["checkpoints"]:
        if c["complete"]:
            lines.append(f"  {c['checkpoint_id']:>10}  complete    {c['num_shards']} shard(s), "
                         f"{c['steps']} steps, {c['episodes']} episodes")
        else:
            lines.append(f"  {c['checkpoint_id']:>10}  INCOMPLETE  {c['reason']}")
    if doc["newest"] is None:
        lines.append("no complete checkpoint")
    else:
        lines += ["", f"newest complete: {doc['newest_complete']}", *_describe(doc["newest"])]
    r = doc["rollouts"]
    if r is not None:
        when = "no insert times" if r["first_insert"] is None else \
            f"inserted {_utc(r['first_insert'])} .. {_utc(r['last_insert'])} ({r['span_s']:.1f} s)"
        lines += ["", f"rollouts archive: {r['segments']} segment(s), {r['bytes']} bytes, "
                  f"{r['chunks']} chunks, {r['steps']} steps, {when}"]
        lines += [f"  DAMAGED {d} (the rest of that segment is unreadable)" for d in r["damaged"]]
    return lines


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _describe(d: dict[str, Any]) -> list[str]:
    if not d["complete"]:
        lines = [f"checkpoint {d['directory']}: INCOMPLETE", f"  reason    {d['reason']}"]
        lines += [f"  present   {json.dumps(p, sort_keys=True)}" for p in d["parts_present"]]
        return lines
    pa = d["partial"]
    lines = [
        f"checkpoint {d['checkpoint_id']} ({d['directory']}): complete",
        f"  shards      {d['num_shards']}",
        f"  steps       {d['steps']}",
        f"  episodes    {d['episodes']}",
        f"  partial     {pa.get('partial_episodes', 0)} episodes ({pa.get('partial_steps', 0)} steps): "
        f"sealed {pa.get('sealed_episodes', 0)} ({pa.get('sealed_steps', 0)} steps), dropped "
        f"{pa.get('dropped_episodes', 0)} ({pa.get('dropped_steps', 0)} steps); "
        f"policy {', '.join(d['partial_policy'])}",
    ]
    if d.get("restored"):
        r = d["restored"]
        lines.append(f"  restored    from checkpoint {r['checkpoint_id']} ({r['saved_shards']} shards, "
                     f"{r['saved_steps']} steps): {r['steps']} steps restored, dropped "
                     f"{r['dropped_episodes']} episodes ({r['dropped_steps']} steps), sealed "
                     f"{r['sealed_episodes']} episodes ({r['sealed_steps']} steps)")
    if "priority" in d:
        lines.append(f"  priorities  {_prio(d['priority'])}")
    lines += [f"  bytes       {d['bytes']}",
              f"  files       {', '.join(n for n in d['files'] if not n.startswith('part-')) or '-'}",
              f"  spec        {_spec(d['spec'])}  (fingerprint {d['spec_fingerprint']})",
              "  shard      steps   episodes        bytes  sealed/dropped  priorities"]
    for p in d["parts"]:
        pp = p["partial"]
        prio = _prio(p["priority"]) if "priority" in p else "-"
        lines.append(f"  {p['shard']:>5} {p['steps']:>10} {p['episodes']:>10} {p['bytes']:>12}  "
                     f"{pp['sealed_episodes']:>6}/{pp['dropped_episodes']:<7}  {prio}")
    return lines


def _prio(s: dict[str, Any]) -> str:
    if not s["count"]:
        return "none stored"
    return f"min {s['min']:.6g}  mean {s['mean']:.6g}  max {s['max']:.6g}  ({s['count']} steps)"


def _spec(spec: dict[str, Any]) -> str:
    return ", ".join(f"{name}: {f['dtype']}{f['shape']}" for name, f in spec.items())
