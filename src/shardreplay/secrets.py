"""Redis passwords: used to connect, never written down (where one comes from and what is
redacted: docs/multi-machine.md, step 1). :func:`adopt` takes it out of a command-line URL;
:class:`~shardreplay.transport.redis.RedisLink` puts it back when it connects
(:func:`connect_args`); every log line passes through :func:`mask`.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from shardreplay.errors import ConfigError

__all__ = ["ENV", "MASK", "adopt", "connect_args", "mask", "needs_password", "password_source",
           "read_password_file", "redact"]
# Where this process's password came from, for messages (see password_source).
_source: str | None = None

ENV = "SHARDREPLAY_REDIS_PASSWORD"
MASK = "***"
_SCHEMES = ("redis", "rediss", "unix")


def _parts(url: str) -> tuple[str | None, str | None, str] | None:
    """``(username, password, host:port)`` of a Redis URL, or None for other URLs."""
    parsed = urlsplit(url)
    if parsed.scheme not in _SCHEMES or "@" not in parsed.netloc:
        return None
    userinfo, host = parsed.netloc.rsplit("@", 1)
    user, sep, password = userinfo.partition(":")
    return (user or None), (password if sep else None), host


def _with_userinfo(url: str, user: str | None, password: str | None) -> str:
    parsed = urlsplit(url)
    host = parsed.netloc.rsplit("@", 1)[-1]
    info = (user or "") + (f":{password}" if password is not None else "")
    return urlunsplit(parsed._replace(netloc=f"{info}@{host}" if info else host))


def redact(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``; any other URL unchanged."""
    parts = _parts(url)
    if parts is None or parts[1] is None:
        return url
    return _with_userinfo(url, parts[0], MASK)


def needs_password(url: str) -> bool:
    """The URL's password was redacted: it must come from the environment."""
    parts = _parts(url)
    return parts is not None and parts[1] == MASK


def adopt(url: str) -> str:
    """Take a password out of a command-line URL: put it in the environment (where child
    processes find it) and return the redacted URL.

    Raises:
        ConfigError: the URL's password differs from one already in the environment
            (two passwords for one run).
    """
    parts = _parts(url)
    if parts is None or parts[1] in (None, MASK):
        return url
    password = parts[1]
    held = os.environ.get(ENV)
    if held is not None and held != password:
        raise ConfigError(f"{redact(url)}: its password differs from ${ENV}: give the password once "
                          f"(in ${ENV}, --redis-password-file or the URL)")
    os.environ[ENV] = password
    global _source
    _source = "the URL's password"
    return redact(url)


def read_password_file(path: str) -> None:
    """Read a password file (its first line) into the environment for this run.

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--redis-password-file {path}: {exc.strerror or exc}") from exc
    lines = text.splitlines()
    if not lines or not lines[0]:
        raise ConfigError(f"--redis-password-file {path}: the file is empty; its first line must be the "
                          "password")
    os.environ[ENV] = lines[0]
    global _source
    _source = f"the password of --redis-password-file {path}"


def password_source() -> str:
    """Where the Redis password this process connects with came from, for a message:
    the URL, ``--redis-password-file FILE``, ``$SHARDREPLAY_REDIS_PASSWORD``, or none."""
    if _source is not None:
        return _source
    if ENV in os.environ:
        return f"the password of ${ENV}"
    return f"no password (none in the URL, no --redis-password-file, ${ENV} unset)"


def connect_args(url: str) -> tuple[str, str | None]:
    """What to connect with: the URL without its password, and the password (the URL's
    own, or for a redacted or password-less one the environment's).

    Raises:
        ConfigError: a redacted URL and no password in the environment.
    """
    parts = _parts(url)
    password = os.environ.get(ENV)
    if parts is not None and parts[1] not in (None, MASK):
        password = parts[1]
    if parts is not None and parts[1] == MASK and password is None:
        raise ConfigError(f"{url} needs its password: set ${ENV} or pass --redis-password-file FILE "
                          "(a run directory stores the URL without it)")
    bare = url if parts is None else _with_userinfo(url, parts[0], None)
    return bare, password


def mask(text: str) -> str:
    """``text`` with the run's Redis password (if any) replaced by ``***``."""
    secret = os.environ.get(ENV)
    return text.replace(secret, MASK) if secret and secret in text else text
