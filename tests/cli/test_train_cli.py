"""``shardreplay train`` / ``actor`` on the command line: grouped settings and --help,
YAML in both shapes, and one-line errors (exit 2, no traceback) for every way a user
typically gets the command wrong."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import pytest

from shardreplay.cli import field_help
from shardreplay.cli.main import build_parser, main
from shardreplay.cli.train import _settings, final_line
from shardreplay.errors import ConfigError, TransportError
from shardreplay.runtime.routing import check_reachable
from shardreplay.runtime.settings import FLAT, GROUPS, TrainSettings, settings_for_resume
from tests.support import free_port


def _train_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["train"].format_help()


# -- settings and --help --------------------------------------------------------------------
def test_help_is_grouped_with_one_default_and_each_text_under_its_own_flag() -> None:
    text = _train_help()
    titles = [line.split(" (")[0].rstrip(":") for line in text.splitlines()
              if line and not line.startswith(" ") and line.endswith(":")]
    assert titles == ["options", "run", "learners", "replay", "actors", "transport", "checkpoints"]
    assert "(default: None)" not in text and "``" not in text
    entries = re.split(r"\n  (?=--)", text)
    for flat in FLAT:
        entry = next(e for e in entries if re.match(f"--{flat.replace('_', '-')}[ ,\n]", e))
        assert entry.count("(default:") <= 1, entry
    by_flag = {e.split()[0]: " ".join(e.split()) for e in entries}
    assert "prioritization exponent" in by_flag["--alpha"] and "beta" not in by_flag["--alpha"]
    assert "epsilon" not in by_flag["--queued-chunks-per-actor"]
    assert "(default: 0.6)" in by_flag["--alpha"] and "(default: 2)" in by_flag["--queued-chunks-per-actor"]
    assert "(default: on)" in by_flag["--progress,"]
    assert len(text.splitlines()) < 170  # about two screens: every setting is a flag (about 60)


def test_every_setting_has_its_own_help_entry_and_no_extra() -> None:
    for cls in GROUPS.values():
        assert sorted(field_help(cls)) == sorted(f.name for f in dataclasses.fields(cls)), cls
    assert not hasattr(TrainSettings(), "extra")
    assert len(FLAT) == sum(len(dataclasses.fields(c)) for c in GROUPS.values())  # flat names unique


def test_flat_and_grouped_settings_read_the_same_and_round_trip() -> None:
    flat = TrainSettings.from_dict({"learners": 2, "alpha": 0.5, "actors": 1, "replay_capacity": 5000,
                                    "transport": "file:///tmp/spool", "progress": False})
    grouped = TrainSettings.from_dict({"learners": {"count": 2}, "replay": {"alpha": 0.5, "capacity": 5000},
                                       "actors": {"count": 1}, "transport": {"url": "file:///tmp/spool"},
                                       "run": {"progress": False}})
    assert flat == grouped
    assert (flat.learners.count, flat.replay.alpha, flat.replay.capacity) == (2, 0.5, 5000)
    assert TrainSettings.from_dict(json.loads(json.dumps(flat.to_dict()))) == flat
    assert TrainSettings.from_dict(flat.to_flat()) == flat
    mixed = TrainSettings.from_dict({"alpha": 0.5, "replay": {"capacity": 5000}})
    assert (mixed.replay.alpha, mixed.replay.capacity) == (0.5, 5000)


@pytest.mark.parametrize(("values", "message"), [
    ({"alpha": 0.5, "replay": {"alpha": 0.4}}, "alpha is given twice"),
    ({"replay": {"capacty": 5}}, "unknown setting(s) replay.capacty"),
    ({"progress": "maybe"}, "progress must be true or false, got 'maybe'"),
    ({"learners": 1.5}, "learners must be a whole number, got 1.5"),
    ({"learners": 0}, "learners must be > 0, got 0"),
    ({"hidden": [64, 0]}, "hidden must be a list of whole numbers >= 1"),
    ({"sample_mode": "global"}, "sample_mode must be 'exact' or 'local'"),
    ({"transport": "ftp://x"}, "transport must be local, file:///dir or redis://host:port/db"),
    ([{"alpha": 0.5}], "settings must be a mapping"),
])
def test_bad_settings_are_one_clear_config_error(values: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainSettings.from_dict(values)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_flags_win_over_the_config_file_of_either_shape(tmp_path: Path) -> None:
    for text in ("alpha: 0.3\nlearners: 2\n", "replay:\n  alpha: 0.3\nlearners:\n  count: 2\n"):
        config = tmp_path / "c.yaml"
        config.write_text(text)
        args = build_parser().parse_args(["train", "--config", str(config), "--alpha", "0.9"])
        settings, resume = _settings(args)
        assert not resume and (settings.replay.alpha, settings.learners.count) == (0.9, 2)


def test_a_resumed_run_reads_a_flat_config(tmp_path: Path) -> None:
    old = {"learners": 2, "prefetch": 4, "alpha": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(old))
    settings = settings_for_resume(tmp_path, {"learners": 1})
    assert (settings.learners.count, settings.replay.prefetch, settings.replay.alpha) == (1, 4, 0.5)
    assert settings.run.run_dir == str(tmp_path)


# -- one-line errors ----------------------------------------------------------------------------
def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("config", "message"), [
    (None, "--config {path}: no such file"),
    ("alpha: [1, 2\nbeta_end: 3\n", "--config {path}: not valid YAML at line 2, column 9"),
    ("- alpha: 0.5\n- lr: 1\n", "--config {path}: must be a YAML mapping of settings ('name: value' lines), "
                                "got a list"),
    ("progress: maybe\n", "--config {path}: progress must be true or false, got 'maybe'"),
    ("run:\n  progress: 1\n", "--config {path}: progress must be true or false, got 1"),
])
def test_config_file_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           config: str | None, message: str) -> None:
    path = tmp_path / "settings.yaml"
    if config is not None:
        path.write_text(config)
    err = _one_line_error(capsys, ["train", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    assert message.format(path=path) in err
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_resume_without_a_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, ["train", "--resume", str(tmp_path / "nowhere")])
    assert f"--resume {tmp_path / 'nowhere'}: no such run directory" in err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(TrainSettings().to_dict()))
    err = _one_line_error(capsys, ["train", "--resume", str(run_dir)])
    assert f"--resume {run_dir}: no checkpoint under {run_dir / 'checkpoints'}" in err


@pytest.mark.timeout(60)
def test_unreachable_redis_is_named_within_seconds(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nobody listens on it
    started = time.monotonic()
    with pytest.raises(TransportError, match=f"cannot reach redis at 127.0.0.1:{port}"):
        check_reachable(f"redis://127.0.0.1:{port}/0")
    assert time.monotonic() - started < 5.0
    started = time.monotonic()
    err = _one_line_error(capsys, ["train", "--transport", f"redis://127.0.0.1:{port}/0",
                                   "--run-dir", str(tmp_path / "run")])
    assert f"cannot reach redis at 127.0.0.1:{port}" in err
    assert time.monotonic() - started < 5.0
    err = _one_line_error(capsys, ["actor", "--actor-id", "0", "--policy-url",
                                   f"redis://127.0.0.1:{port}/0"])
    assert f"cannot reach redis at 127.0.0.1:{port}" in err


def test_actor_refuses_the_local_transport(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    err = _one_line_error(capsys, ["actor", "--actor-id", "0", "--policy-url", f"file://{tmp_path}/policy",
                                   "--transport", "local"])
    assert "--transport local: the local transport exists only inside shardreplay train" in err
    assert time.monotonic() - started < 5.0  # refused, not waiting for a policy


# -- the closing sentence -------------------------------------------------------------------------
def test_a_run_ends_with_one_sentence_saying_how_it_went() -> None:
    base = {"env_steps": 12345, "final_eval_return": 500.0, "eval_episodes": 20, "run_dir": "runs/x",
            "stop_return": 475.0, "stop_return_from": "CartPole-v1's reward_threshold"}
    solved = final_line({**base, "stopped_by": "solved"})
    assert solved.startswith("Solved after 12,345 environment steps: final evaluation 500.0 (mean return "
                             "of 20 greedy episodes; target 475 from CartPole-v1's reward_threshold). "
                             "Files in runs/x/")
    assert "summary.json" in solved and "\n" not in solved
    assert final_line({**base, "stopped_by": "time"}).startswith("Not solved (time limit reached) after")
    assert final_line({**base, "stopped_by": "signal"}).startswith("Stopped on request (not solved) after")
    never = final_line({**base, "stopped_by": "env_steps", "stop_return": None,
                        "stop_return_from": "--stop-return none"})
    assert never.startswith("Not solved (step budget used up) after 12,345 environment steps: final "
                            "evaluation 500.0 (mean return of 20 greedy episodes; no target: --stop-return "
                            "none). Files in runs/x/")
    assert solved.endswith("(summary.json, metrics.csv, learning_curve.png, checkpoints/).")
    unplotted = final_line({**base, "stopped_by": "solved", "learning_curve": None})  # --no-plot
    assert unplotted.endswith("Files in runs/x/ (summary.json, metrics.csv, checkpoints/).")
    offline = final_line({**base, "env_steps": 0, "updates": 1500, "dataset_steps": 10688,
                          "offline": "minari:sr/cartpole-v0", "stopped_by": "time"})
    assert offline.startswith("Not solved (time limit reached) after 1,500 updates on the 10,688 steps of "
                              "minari:sr/cartpole-v0 (offline): final evaluation 500.0"), offline


def test_a_refused_write_is_one_line_naming_the_path_and_the_os_error(tmp_path: Path) -> None:
    import errno

    from shardreplay._io import storage_error
    from shardreplay.cli.train import storage_advice
    from shardreplay.errors import StorageError

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "policy" / "p.safetensors"))
    try:
        try:
            raise full
        except OSError as exc:
            raise TransportError("cannot publish policy 5") from exc
    except TransportError as wrapped:
        refused = storage_error(wrapped)
    assert isinstance(refused, StorageError) and refused.errno == errno.ENOSPC
    path = tmp_path / "policy" / "p.safetensors"
    assert str(refused) == f"cannot write {path}: No space left on device (ENOSPC)"
    assert storage_error(OSError(errno.EROFS, "Read-only file system"), "/r") is not None
    assert storage_error(OSError(errno.EINVAL, "Invalid argument")) is None  # not a refused write
    assert storage_error(ValueError("x")) is None
    summary = {"run_dir": str(tmp_path), "storage_error": str(refused), "stopped_by": "storage",
               "env_steps": 10, "final_eval_return": 9.0, "eval_episodes": 2, "stop_return": None}
    advice = storage_advice(summary)
    assert "no complete checkpoint yet" in advice and f"--run-dir {tmp_path} --auto-resume" in advice
    assert final_line(summary).startswith("Stopped: the file system refused a write (not solved) after 10 ")


def test_an_unwritable_spool_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    from shardreplay.runtime.routing import check_writable

    check_writable((tmp_path / "new" / "spool").as_uri())  # a writable parent: nothing is created
    assert not (tmp_path / "new").exists()
    check_writable("local")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="transport"):  # a file where a directory should be
        check_writable((tmp_path / "file" / "spool").as_uri())


def test_checkpoints_are_periodic_by_time_by_default_and_keep_two() -> None:
    settings, _resume = _settings(build_parser().parse_args(["train"]))
    assert (settings.checkpoints.interval_minutes, settings.checkpoints.keep_last) == (10.0, 2)
    args = build_parser().parse_args(["train", "--checkpoint-interval-minutes", "0.5", "--keep-last", "3",
                                      "--checkpoint-interval-updates", "100"])
    settings, _resume = _settings(args)
    assert (settings.checkpoints.interval_minutes, settings.checkpoints.keep_last,
            settings.checkpoints.interval_updates) == (0.5, 3, 100)
    with pytest.raises(ConfigError, match="keep_last must be > 0"):
        _settings(build_parser().parse_args(["train", "--keep-last", "0"]))


# -- issue 40: targets that fit the env, paths relative to the run directory -------------------
@pytest.mark.parametrize(("flags", "target"), [
    ((), (475.0, "CartPole-v1's reward_threshold")),
    (("--env-id", "Acrobot-v1"), (-100.0, "Acrobot-v1's reward_threshold")),
    (("--env-id", "LunarLander-v3", "--stop-return", "auto"), (200.0, "LunarLander-v3's reward_threshold")),
    (("--algo", "sac", "--env-id", "Pendulum-v1"), (None, "Pendulum-v1 has no reward_threshold")),
    (("--algo", "sac", "--env-id", "Pendulum-v1", "--stop-return", "-200"), (-200.0, "--stop-return")),
    (("--stop-return", "0"), (0.0, "--stop-return")),
    (("--stop-return", "none"), (None, "--stop-return none")),
])
def test_any_number_is_a_target_none_is_never_and_the_default_is_the_envs_threshold(
        flags: tuple[str, ...], target: tuple[float | None, str]) -> None:
    from shardreplay.runtime.envs import reward_threshold

    settings, _resume = _settings(build_parser().parse_args(["train", *flags]))
    assert settings.run.stop_target(reward_threshold(settings.run.source)) == target
    assert TrainSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings


def test_a_stop_return_that_is_neither_a_number_nor_none_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--stop-return", "never"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stop_return must be a number (the target mean return), none" in err
    with pytest.raises(ConfigError, match="stop_return must be a number"):
        TrainSettings.from_dict({"stop_return": float("nan")})


def test_paths_under_the_run_directory_are_stored_relative_and_resolved_where_it_is_now(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "op"
    elsewhere = (tmp_path / "spool").as_uri()
    given = {"run_dir": str(run_dir), "transport": (run_dir / "spool").as_uri(),
             "delivery_log_dir": str(run_dir / "deliveries")}
    settings = TrainSettings.from_dict(given).with_run_dir(run_dir)
    stored = settings.stored()
    assert (stored["run"]["run_dir"], stored["transport"]["url"], stored["transport"]["policy_url"],
            stored["actors"]["delivery_log_dir"]) == ("{run_dir}", "file://{run_dir}/spool",
                                                      "file://{run_dir}/policy", "{run_dir}/deliveries")
    outside = TrainSettings.from_dict({"run_dir": str(run_dir), "transport": elsewhere}).with_run_dir(run_dir)
    assert outside.stored()["transport"]["url"] == elsewhere  # not under the run directory: as given
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(stored))
    moved = tmp_path / "runs" / "op-moved"
    run_dir.rename(moved)
    again = settings_for_resume(moved, {})
    assert again.transport.policy_url == (moved / "policy").resolve().as_uri()
    assert again.transport.url == (moved / "spool").resolve().as_uri()
    assert again.actors.delivery_log_dir == str((moved / "deliveries").resolve())
    assert again.run.run_dir == str(moved)


@pytest.mark.redis
def test_a_refused_redis_password_names_its_source_and_where_to_give_it(
        tmp_path: Path, redis_factory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """No password, a wrong one in the URL, a wrong file: each one line naming the password
    used and --redis-password-file / $SHARDREPLAY_REDIS_PASSWORD (issue 40; before: "cannot
    reach redis ...: start redis-server there or give the right URL")."""
    from shardreplay import secrets

    server = redis_factory(password="right-one")
    host = server.url.split("//", 1)[1]
    wrong = tmp_path / "pw"
    wrong.write_text("wrong-one\n")
    cases = [([f"redis://{host}"], "with no password (none in the URL"),
             ([f"redis://:wrong-one@{host}"], "with the URL's password"),
             ([f"redis://{host}", "--redis-password-file", str(wrong)],
              f"with the password of --redis-password-file {wrong}")]
    monkeypatch.setenv(secrets.ENV, "")  # recorded as unset before: undone after the test
    for args, source in cases:
        monkeypatch.delenv(secrets.ENV, raising=False)
        monkeypatch.setattr(secrets, "_source", None)
        run_dir = tmp_path / "run"
        assert main(["train", "--run-dir", str(run_dir), "--transport", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "refused the connection" in err and source in err, err
        assert "--redis-password-file FILE or $SHARDREPLAY_REDIS_PASSWORD" in err and "wrong-one" not in err
        assert not run_dir.exists()
