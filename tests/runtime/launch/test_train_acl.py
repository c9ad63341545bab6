"""A run under the least-privilege Redis user that docs/multi-machine.md documents.

The ACL line is read from the page itself (between ``acl-begin`` and ``acl-end``), so
the documented user is the tested one. An administrator creates it for run ``run-a``;
``shardreplay train --run-id run-a`` then runs to its end as that user (learner and
its actors), and the same user is refused another run's keys and the unnamed policy.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from shardreplay.secrets import ENV
from tests.support.env import REPO
from tests.support.train_runs import FAST, TrainRun

pytestmark = [pytest.mark.slow, pytest.mark.redis]

DOC = REPO / "docs" / "multi-machine.md"


def documented_acl(run_id: str, password: str) -> list[str]:
    """The ``ACL SETUSER`` command of the docs, for ``run_id``, as arguments."""
    block = DOC.read_text().split("<!-- acl-begin -->")[1].split("<!-- acl-end -->")[0]
    line = next(x.strip() for x in block.splitlines() if x.strip().startswith("ACL SETUSER"))
    line = re.sub(r"\bRUN\b", run_id, line).replace(">PASSWORD", f">{password}")
    return line.split()


@pytest.mark.timeout(600)
def test_a_run_works_under_the_documented_user_and_cannot_touch_another_runs_keys(
        tmp_path: Path, redis_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "")
    monkeypatch.delenv(ENV)  # restored to absent after the test
    server = redis_factory(password="admin-pw")
    admin = redis.Redis(host="127.0.0.1", port=server.port, password="admin-pw")
    try:
        assert admin.execute_command(*documented_acl("run-a", "pw-a")) in (b"OK", "OK", True)
        admin.xadd("shardreplay:run-b:chunks:0", {"x": b"another run's chunk"})
    finally:
        admin.close()
    url = f"redis://run-a:pw-a@127.0.0.1:{server.port}/0"
    run_dir = tmp_path / "run"
    with TrainRun(["train", "--run-dir", str(run_dir), "--run-id", "run-a", "--transport", url, *FAST,
                   "--learners", "1", "--actors", "1", "--hidden", "16", "--total-env-steps", "600"],
                  tmp_path / "logs") as run:
        assert run.wait(300) == 0, run.explain()
        assert run.leftovers() == [], run.explain()
        refused = [line for line in run.stderr().splitlines() if "permission" in line
                   and "could not look for other runs' chunks" not in line]  # that one is meant to fail
        assert refused == [], refused[:5]
        summary = run.summary()
    assert summary["env_steps"] >= 600
    user = redis.Redis(host="127.0.0.1", port=server.port, username="run-a", password="pw-a")
    try:
        assert user.hgetall("shardreplay:run-a:policy") and user.xlen("shardreplay:run-a:chunks:0") >= 0
        for refused in (lambda: user.xadd("shardreplay:run-b:chunks:0", {"x": b"1"}),
                        lambda: user.xlen("shardreplay:run-b:chunks:0"),
                        lambda: user.hgetall("shardreplay:policy"),
                        lambda: user.publish("shardreplay:run-b:policy:news", b"1"),
                        lambda: user.flushall()):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        user.close()
