"""The ``shardreplay`` command line: one module per subcommand (see :mod:`.main`)."""

import re


def plain(doc: str | None) -> str:
    """A docstring as ``--help`` shows it: reStructuredText's ````code```` as plain text."""
    return re.sub(r"``([^`]*)``", r"\1", doc or "")
