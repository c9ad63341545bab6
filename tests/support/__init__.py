"""What tests in every area share: gloo ranks and torchrun (:mod:`.ranks`), free ports that
do not race between xdist workers (:mod:`.ports`), a real redis-server (:mod:`.redis`), and
environments for child processes (:mod:`.env`). Import as ``from tests.support import ...``."""

from tests.support.env import BENCHMARKS, REPO, child_env, environ
from tests.support.ports import free_port
from tests.support.ranks import run_ranks, torchrun
from tests.support.redis import RedisServer, start_redis

__all__ = ["BENCHMARKS", "REPO", "RedisServer", "child_env", "environ", "free_port", "run_ranks",
           "start_redis", "torchrun"]
