"""deploy/: docker compose and Kubernetes manifests run commands that really parse.

Every ``shardreplay`` command they run (directly or under ``torchrun -m``) goes through
the real CLI parser and builds real settings; ``torchrun``'s own flags (with its
``PET_*`` variables) go through torch's parser. The pieces must also fit together:
world size = actor ``--num-shards``, remote actors = actor ids, one shared run
directory on a shared volume, the Redis host a real service, rendezvous names that
resolve to rank 0.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from shardreplay.cli.main import build_parser
from shardreplay.cli.train import _settings
from shardreplay.policy.broadcast import RunInfo
from shardreplay.runtime.actor.loop import ActorSettings, resolve
from shardreplay.runtime.learner.sync import agreed_settings
from shardreplay.runtime.settings import TrainSettings
from tests.support import environ

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _argv(command: Any) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _torchrun(argv: list[str], env: dict[str, str]) -> tuple[Any, list[str]]:
    """torchrun's parsed flags (PET_* from ``env``) and the shardreplay arguments."""
    from torch.distributed.run import get_args_parser

    assert argv[0] == "torchrun", argv
    with environ({k: v for k, v in env.items() if k.startswith("PET_")}):
        ns = get_args_parser().parse_args(argv[1:])  # its env defaults are read at build time
    assert ns.module and ns.training_script == "shardreplay", "run the module: torchrun -m shardreplay"
    return ns, list(ns.training_script_args)


def _train(argv: list[str]) -> TrainSettings:
    args = build_parser().parse_args(argv)
    assert args.command == "train"
    settings, resume = _settings(args)
    assert not resume  # nothing to resume here: --auto-resume starts a new run
    return settings


def _actor(argv: list[str]) -> ActorSettings:
    args = build_parser().parse_args(argv)
    assert args.command == "actor"
    names = {f.name for f in dataclasses.fields(ActorSettings)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["hidden"] = tuple(values["hidden"])
    return ActorSettings(**values)


def _check_actors(actors: list[ActorSettings], train: TrainSettings, world: int) -> None:
    """What each actor runs once it took the settings its learners publish."""
    assert sorted(a.actor_id for a in actors) == list(range(train.actors.remote))
    info = RunInfo(run_id="r", life=0, env_steps=0, seed=train.run.seed, transport=train.transport.url,
                   settings=agreed_settings(train, world))
    for a in actors:
        r = resolve(a, info)  # a flag contradicting the learners would raise here
        assert r.num_actors == train.total_actors and r.num_shards == world
        assert r.transport == r.policy_url == train.transport.url  # policy defaults to the Redis URL
        assert r.env_id == train.run.env_id and r.envs_per_actor == train.actors.envs_per_actor
        assert r.queued_chunks_per_actor == train.actors.queued_chunks_per_actor
        assert r.chunk_steps == train.actors.chunk_steps
        assert (r.epsilon_base, r.epsilon_exponent, r.epsilon_warmup_steps) == \
            (train.actors.epsilon_base, train.actors.epsilon_exponent, train.actors.epsilon_warmup_steps)


# -- docker compose -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_commands_parse_and_fit_together(compose: dict[str, Any]) -> None:
    services = compose["services"]
    learners, actors = {}, []
    for name, svc in services.items():
        argv = _argv(svc.get("command", []))
        if argv[:1] == ["torchrun"]:
            env = {k: str(v) for k, v in svc.get("environment", {}).items()}
            learners[name] = (svc, *_torchrun(argv, env))
        elif argv[:1] == ["shardreplay"]:
            actors.append(_actor(argv[1:]))
        if argv[:1] in (["torchrun"], ["shardreplay"]):
            context = (DEPLOY / svc["build"]["context"]).resolve()
            assert context == ROOT and (context / svc["build"]["dockerfile"]).exists()
    assert len(learners) >= 2 and actors
    trains = {name: _train(args) for name, (_svc, _ns, args) in learners.items()}
    assert len({tuple(args) for _svc, _ns, args in learners.values()}) == 1  # same run everywhere
    train = next(iter(trains.values()))
    nnodes = {int(ns.nnodes) for _svc, ns, _args in learners.values()}
    nproc = {int(ns.nproc_per_node) for _svc, ns, _args in learners.values()}
    assert nnodes == {len(learners)} and len(nproc) == 1
    world = len(learners) * nproc.pop()
    ranks = {int(ns.node_rank): name for name, (_svc, ns, _args) in learners.items()}
    assert sorted(ranks) == list(range(len(learners)))
    rank0 = services[ranks[0]]
    for _svc, ns, _args in learners.values():
        assert ns.master_addr in (ranks[0], rank0.get("hostname"))
    # Learners run with remote actors only, through the Redis service.
    assert train.actors.count == 0 and train.actors.remote == len(actors)
    url = urlparse(train.transport.url)
    assert url.scheme == "redis" and url.hostname in services and url.port == 6379
    # The run directory lies on one volume that every learner mounts.
    mounts = [{v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
              for svc, _ns, _a in learners.values()]
    shared = [{vol for target, vol in m.items() if train.run.run_dir.startswith(target.rstrip("/") + "/")}
              for m in mounts]
    assert shared[0] and all(s == shared[0] for s in shared)
    assert shared[0] <= set(compose.get("volumes", {}))
    _check_actors(actors, train, world)


# -- Kubernetes -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"one {kind} {name!r} expected"
    return found[0]


def _container_env(container: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """Literal values, and the field paths of downward-API values."""
    values, fields = {}, {}
    for e in container.get("env", []):
        if "value" in e:
            values[e["name"]] = str(e["value"])
        else:
            fields[e["name"]] = e["valueFrom"]["fieldRef"]["fieldPath"]
    return values, fields


def _expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion in command and args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]


def _selects(service: dict[str, Any], template: dict[str, Any]) -> bool:
    labels = template["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_k8s_manifests_commands_parse_and_fit_together(manifests: list[dict[str, Any]]) -> None:
    learner_job = _find(manifests, "Job", "learner")
    actor_job = _find(manifests, "Job", "actor")
    pod = learner_job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    values, fields = _container_env(container)
    assert fields == {"PET_NODE_RANK": INDEX_FIELD}  # node rank = the Job's completion index
    spec = learner_job["spec"]
    ns, args = _torchrun(_argv(container.get("command", [])) + _argv(container.get("args", [])),
                         {**values, "PET_NODE_RANK": "0"})
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(ns.nnodes)
    world = int(ns.nnodes) * int(ns.nproc_per_node)
    # Rank 0 is reachable by name through a headless Service over the learner pods.
    subdomain = pod["spec"]["subdomain"]
    headless = _find(manifests, "Service", subdomain)
    assert headless["spec"]["clusterIP"] == "None" and _selects(headless, pod)
    assert ns.master_addr == f"{learner_job['metadata']['name']}-0.{subdomain}"
    assert int(ns.master_port) in {p["port"] for p in headless["spec"]["ports"]}
    train = _train(args)
    assert train.actors.count == 0 and train.actors.remote == actor_job["spec"]["completions"]
    # The transport names the Redis Service, which selects the Redis Deployment.
    url = urlparse(train.transport.url)
    redis_svc = _find(manifests, "Service", url.hostname)
    assert url.port in {p["port"] for p in redis_svc["spec"]["ports"]}
    assert _selects(redis_svc, _find(manifests, "Deployment", "redis")["spec"]["template"])
    # The run directory is on a ReadWriteMany claim that every learner pod mounts.
    mount = next(m for m in container["volumeMounts"] if train.run.run_dir.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    claim = _find(manifests, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(values["PET_SHUTDOWN_TIMEOUT"])
    # Actors: one per completion index, each parsed with its own --actor-id.
    a_spec = actor_job["spec"]
    assert a_spec["completionMode"] == "Indexed"
    assert a_spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    (a_container,) = a_spec["template"]["spec"]["containers"]
    a_values, a_fields = _container_env(a_container)
    index_vars = [k for k, v in a_fields.items() if v == INDEX_FIELD]
    assert index_vars, "the actor id must come from the completion index"
    argv = _argv(a_container.get("command", [])) + _argv(a_container.get("args", []))
    assert argv[0] == "shardreplay"
    actors = [_actor(_expand(argv[1:], {**a_values, **dict.fromkeys(index_vars, str(i))}))
              for i in range(a_spec["completions"])]
    _check_actors(actors, train, world)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_the_image_installs_what_the_commands_need() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = re.search(r'pip install [^\n]*"\.\[([\w,]+)\]"', dockerfile)
    assert extras is not None
    assert set(extras.group(1).split(",")) <= set(project["optional-dependencies"])
    assert project["scripts"]["shardreplay"] == "shardreplay.cli.main:console"
    assert "torch==" in dockerfile  # torchrun comes with torch
