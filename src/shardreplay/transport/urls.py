"""Medium URLs: the one parser of ``local``, ``file://`` and ``redis://`` URLs
(:func:`parse_medium`), the one map from a URL to a transport (:func:`open_transport`:
it imports the transport's module, and redis, only then), and the one query option
shardreplay reads itself (the rest goes to redis-py): ``key``, the Redis hash a policy is
published under (default ``shardreplay:policy``; ``shardreplay:ID:policy`` for ``--run-id ID``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlparse, urlsplit, urlunsplit

from shardreplay.errors import ConfigError

if TYPE_CHECKING:
    from shardreplay.spec import Spec
    from shardreplay.transport.base import Transport

__all__ = ["POLICY_KEY", "MediumURL", "file_url", "open_transport", "parse_medium", "pop_query",
           "with_policy_key"]

POLICY_KEY = "key"


def pop_query(url: str, name: str) -> tuple[str, str | None]:
    """``url`` without query option ``name``, and that option's value (None: absent)."""
    parts = urlsplit(url)
    if not parts.query:
        return url, None
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    value = next((v for k, v in pairs if k == name), None)
    rest = urlencode([(k, v) for k, v in pairs if k != name], safe="/:")
    return urlunsplit(parts._replace(query=rest)), value


def with_policy_key(url: str, key: str) -> str:
    """``url`` with its policy key set to ``key`` (other query options kept)."""
    base, _old = pop_query(url, POLICY_KEY)
    parts = urlsplit(base)
    query = "&".join(q for q in (parts.query, urlencode([(POLICY_KEY, key)], safe=":")) if q)
    return urlunsplit(parts._replace(query=query))


# The one table of medium URLs: every scheme a transport or a policy broadcast opens.
_KINDS = {"file": "file", "redis": "redis", "rediss": "redis", "unix": "redis"}
_LOCAL = ("", "local", "local://")
_FORMS = {"local": "'local'", "file": "'file:///dir'", "redis": "'redis://host:port/db'"}
MediumKind = Literal["local", "file", "redis"]


@dataclass(frozen=True)
class MediumURL:
    """A parsed medium URL: its ``kind`` (``redis`` for every URL redis-py opens), the
    ``url`` as given (a Redis URL keeps its query and any password), and a ``file://``
    URL's directory ``path`` (``""`` otherwise)."""

    kind: MediumKind
    url: str
    path: str = ""


def parse_medium(url: str, *, kinds: tuple[MediumKind, ...] = ("local", "file", "redis"),
                 what: str = "transport") -> MediumURL:
    """Parse a transport or policy-broadcast URL: ``local`` (also ``""``, ``local://``),
    ``file:///absolute/dir`` (or ``file://localhost/dir``), ``redis://``, ``rediss://`` or
    ``unix://``, of one of ``kinds``; ``what`` names the URL in messages.

    Raises:
        ConfigError: another scheme, a kind the caller does not accept, or a ``file://``
            URL with a host or without a path; the message lists the accepted forms.
    """
    if url in _LOCAL:
        kind: str | None = "local"
        parsed = None
    else:
        parsed = urlparse(url)
        kind = _KINDS.get(parsed.scheme)
    if kind not in kinds:
        forms = [_FORMS[k] for k in kinds]  # "'local', 'file:///dir' or 'redis://host:port/db'"
        use = forms[0] if len(forms) == 1 else f"{', '.join(forms[:-1])} or {forms[-1]}"
        raise ConfigError(f"unknown {what} URL {url!r}: use {use}")
    if kind == "file":
        assert parsed is not None
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ConfigError(f"{what} needs file:///absolute/dir, got {url!r}")
        return MediumURL("file", url, parsed.path)
    return MediumURL("local" if kind == "local" else "redis", url)


def file_url(path: str) -> str:
    """The ``file://`` URL whose :func:`parse_medium` path is the absolute ``path``."""
    return f"file://{path}"


def open_transport(url: str, spec: Spec, **options: Any) -> Transport:
    """Open the transport ``url`` names (:func:`parse_medium`) for chunks of ``spec``, with
    the keyword ``options`` of ``LocalTransport``, ``SpoolTransport`` or ``RedisTransport``.

    Raises:
        ConfigError: an unknown scheme, a malformed URL or an unknown option.
    """
    medium = parse_medium(url, what="transport")
    try:
        if medium.kind == "local":
            from shardreplay.transport.local import LocalTransport

            return LocalTransport(spec, **options)
        if medium.kind == "file":
            from shardreplay.transport.spool import SpoolTransport

            return SpoolTransport(medium.path, spec, **options)
        from shardreplay.transport.redis import RedisTransport

        return RedisTransport(url, spec, **options)
    except TypeError as exc:  # an unknown keyword option
        raise ConfigError(f"bad option for transport {url!r}: {exc}") from exc
