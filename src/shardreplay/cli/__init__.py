"""The ``shardreplay`` command line: one module per subcommand (see :mod:`.main`)."""

import re


def plain(doc: str | None) -> str:
    """A docstring as ``--help`` shows it: reStructuredText's ````code```` as plain text."""
    return re.sub(r"``([^`]*)``", r"\1", doc or "")


_ENTRY = re.compile(r"^ {8}(\w+(?:, \w+)*): (.*(?:\n {12}.*)*)", re.M)


def field_help(cls: type) -> dict[str, str]:
    """Each field's text in the ``Attributes:`` section of ``cls``'s docstring (one
    ``name: text`` entry per field, or ``a, b: text`` for several, continued on
    deeper-indented lines), as ``--help`` shows it."""
    doc = (cls.__doc__ or "").split("Attributes:", 1)[-1]
    return {name: plain(" ".join(text.split())).rstrip(".")
            for names, text in _ENTRY.findall(doc) for name in names.split(", ")}
