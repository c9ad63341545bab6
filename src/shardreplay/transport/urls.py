"""Options that shardreplay itself reads from a medium's URL query (the rest of the query
goes to redis-py as it is).

``key``: the Redis hash a policy is published under (``redis://host/0?key=NAME``;
default ``shardreplay:policy``). A run named with ``--run-id ID`` publishes under
``shardreplay:ID:policy``, so a Redis user limited to ``shardreplay:ID:*`` reaches it.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["POLICY_KEY", "pop_query", "with_policy_key"]

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
