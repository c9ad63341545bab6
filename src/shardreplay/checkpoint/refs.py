"""Reading an incremental part: rows of its user fields that live in earlier files.

An incremental part (format version 3) stores every small array as a full part does
(positions, row lengths, step types, discounts, episode ids, generations, priorities,
episode tables, sampler state), but of each user field (``field.*``) only the steps new
since the part it continues. A segment table says where each stored step's field rows
are: the steps of the part, in (row, time) order, are cut into segments
``ref.row``/``ref.step``/``ref.count`` (row, first absolute step, steps), each read
from ``ref.source`` (-1: this file; ``k``: the ``k``-th entry of the part's ``refs``, a
part file of an earlier checkpoint, listed with its size and block hashes) starting at
row ``ref.first`` of that file's array. References always name the file that holds the
rows, never a part that refers on, so no chain is followed.

:class:`ChainedReader` reads such a part with :class:`PartReader`'s interface: a field
is one array of every stored step, as in a full part, so the loader (any M -> N plan)
does not know the difference.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import numpy as np

from shardreplay.checkpoint.format import PartReader, WholeReads
from shardreplay.checkpoint.records import ManifestPart, RefSource
from shardreplay.errors import CheckpointFormatError

SEGMENT_ARRAYS = ("ref.row", "ref.step", "ref.count", "ref.source", "ref.first")


def open_part(directory: Path, part: ManifestPart) -> PartReader | ChainedReader:
    """A reader of ``part`` of the checkpoint in ``directory``: a :class:`PartReader`
    for a full part, a :class:`ChainedReader` for an incremental one.

    Raises:
        CheckpointFormatError: an unreadable or malformed file or segment table.
    """
    own = PartReader(directory / part.file, part)
    if not part.refs:
        return own
    try:
        return ChainedReader(Path(directory).parent, own, part.refs)
    except BaseException:
        own.close()
        raise


class ChainedReader(WholeReads):
    """:class:`PartReader` of an incremental part: ``field.*`` rows are read from the
    files its segment table names (opened and verified on first use), everything else
    from the part itself.

    Raises:
        CheckpointFormatError: a malformed segment table (its counts do not add up to
            the stored steps, or a source outside ``refs``).
    """

    def __init__(self, root: Path, own: PartReader, refs: tuple[RefSource, ...]) -> None:
        self._root, self._own, self._refs = Path(root), own, refs
        self.path, self.metadata, self.header = own.path, own.metadata, own.header
        self._opened: dict[int, PartReader] = {}
        self._stack = ExitStack()
        seg = {name: own.array(name).astype(np.int64) for name in SEGMENT_ARRAYS}
        self._source, self._first, count = seg["ref.source"], seg["ref.first"], seg["ref.count"]
        self._offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
        steps = int(own.array("row_length").sum())
        if len({a.shape for a in seg.values()}) != 1 or (count < 0).any() or \
                int(self._offsets[-1]) != steps or (self._first < 0).any() or \
                ((self._source < -1) | (self._source >= len(refs))).any():
            raise CheckpointFormatError(f"{self.path}: malformed segment table (ref.*)")

    def _reader(self, source: int) -> PartReader:
        if source < 0:
            return self._own
        reader = self._opened.get(source)
        if reader is None:
            ref = self._refs[source]
            reader = self._stack.enter_context(PartReader(ref.path(self._root), ref))
            self._opened[source] = reader
        return reader

    def names(self) -> list[str]:
        """Names of the arrays (user fields as whole arrays, as in a full part)."""
        return self._own.names()

    def entry(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """Dtype and shape of array ``name`` (a field: every stored step's rows)."""
        dtype, shape = self._own.entry(name)
        if name.startswith("field."):
            shape = (int(self._offsets[-1]), *shape[1:])
        return dtype, shape

    def rows_into(self, name: str, start: int, out: np.ndarray, *, defer: bool = False) -> None:
        """Fill ``out`` with rows ``start:start+len(out)`` of ``name`` (see
        :meth:`PartReader.rows_into`), a field's rows from the files that hold them.

        Raises:
            CheckpointFormatError: rows out of range, or a missing or corrupt file or block.
        """
        if not name.startswith("field."):
            self._own.rows_into(name, start, out, defer=defer)
            return
        stop = start + out.shape[0]
        if start < 0 or stop > int(self._offsets[-1]):
            raise CheckpointFormatError(f"{self.path}: rows {start}..{stop} of {name!r} lie outside "
                                        f"its {int(self._offsets[-1])} steps")
        pos = start
        k = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while pos < stop:
            end = min(int(self._offsets[k + 1]), stop)
            if end > pos:
                first = int(self._first[k]) + pos - int(self._offsets[k])
                self._reader(int(self._source[k])).rows_into(name, first, out[pos - start:end - start],
                                                             defer=defer)
            pos = end
            k += 1

    def check_pending(self) -> None:
        """Wait for every deferred check, of this part and of the files it read from.

        Raises:
            CheckpointFormatError: a block's hash differs from the one recorded.
        """
        self._own.check_pending()
        for reader in self._opened.values():
            reader.check_pending()

    def verify_all(self) -> None:
        """Check every block of the part and of every file it refers to."""
        self._own.verify_all()
        for k in range(len(self._refs)):
            self._reader(k).verify_all()

    def close(self) -> None:
        """Close every file."""
        self._stack.close()
        self._opened.clear()
        self._own.close()


AnyPartReader = PartReader | ChainedReader
