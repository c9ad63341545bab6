"""Digests of ``sample`` batches drawn with fixed seeds, to check that a change keeps them
bit-identical: run it on two checkouts and compare the printed JSON.

    git archive BASE | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base/src python benchmarks/replay/sample_digests.py > before.json
    PYTHONPATH=src python benchmarks/replay/sample_digests.py > after.json
    python -c "import json; a, b = (json.load(open(f)) for f in ('before.json', 'after.json')); \\
               print([k for k in a if a[k] != b[k]] or 'identical')"

Per spec kind (vector, float, own-array fields, nested with float16, frame-stacked pixels,
a zero-byte field), sampler (uniform, prioritized, fifo) and buffer shape, 12 batches of 1,
32 and 256 windows: every data array (name, shape, dtype, bytes, and their order), the mask,
weights, probabilities and the keys without their per-buffer random tag.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

import shardreplay as sr

LAST = 2
_PLACE_AND_GENERATION = (1 << 39) - 1  # a key's bits below its tag (kernels/codes.py)


def _specs() -> dict[str, sr.Spec]:
    return {
        "vector": sr.Spec({"obs": sr.Field((4,), np.float32), "action": sr.Field((), np.int64),
                           "reward": sr.Field((), np.float32)}),
        "float": sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field((1,), np.float32),
                          "reward": sr.Field((), np.float32)}),
        "wide": sr.Spec({"obs": sr.Field((17,), np.float32), "action": sr.Field((6,), np.float32),
                         "reward": sr.Field((), np.float64)}),
        "nested": sr.Spec({"obs": {"a": sr.Field((2, 3), np.float64), "b": sr.Field((5,), np.uint8)},
                           "action": sr.Field((), np.int32), "reward": sr.Field((), np.float32, finite=False),
                           "half": sr.Field((2,), np.float16)}),
        "pixel": sr.Spec({"obs": sr.Field((4, 6, 5), np.uint8, frame_stack=True),
                          "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)}),
        "empty": sr.Spec({"obs": sr.Field((0,), np.float32), "action": sr.Field((), np.int64),
                          "reward": sr.Field((), np.float32)}),
    }


def _fill(buf: sr.ReplayBuffer, spec: sr.Spec, streams: int, steps: int, rng: np.random.Generator) -> None:
    """``steps`` one-step adds: episodes ending at random, all streams restarting every 7th."""
    last = np.zeros((streams, 4, 6, 5), np.uint8)
    for t in range(steps):
        types = np.where(rng.random(streams) < 0.1, LAST, 1).astype(np.uint8)
        if t % 7 == 0:
            types[:] = 0
        step: dict[str, Any] = {}
        for name, f in spec.fields.items():
            if f.frame_stack:
                last = np.concatenate([last[:, 1:], rng.integers(0, 255, (streams, 1, 6, 5), dtype=np.uint8)],
                                      axis=1)
                step[name] = last
            elif f.dtype.kind == "f":
                step[name] = rng.standard_normal((streams, *f.shape)).astype(f.dtype)
            else:
                step[name] = rng.integers(0, 100, (streams, *f.shape)).astype(f.dtype)
        step["step_type"] = types
        step["discount"] = np.where(types == LAST, rng.choice([0.0, 1.0], streams), 1.0).astype(np.float32)
        for name in [k for k in step if "." in k]:
            head, tail = name.split(".")
            step.setdefault(head, {})[tail] = step.pop(name)
        buf.add(step)


def digests() -> dict[str, str]:
    """The digest of each configuration's batches (see the module docstring)."""
    out = {}
    for kind, spec in _specs().items():
        for sampler in ("uniform", "prioritized", "fifo"):
            for streams, cap, window in ((1, 50, 2), (3, 40, 4), (8, 1000, 2)):
                rng = np.random.default_rng(7)
                buf = sr.ReplayBuffer(spec, num_streams=streams, stream_capacity=cap, window=window,
                                      sampler=sampler, seed=5)
                _fill(buf, spec, streams, cap + 13 if streams < 8 else 300, rng)
                h = hashlib.sha256()
                for i in range(12):
                    try:
                        b = buf.sample([1, 32, 256][i % 3])
                    except sr.EmptyBufferError:  # fifo consumes its windows
                        h.update(b"empty")
                        continue
                    h.update(str(list(b.data)).encode())
                    for name, t in b.data.items():
                        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
                        h.update(t.numpy().tobytes())
                    for t in (b.mask, b.weights, b.probabilities):
                        h.update(t.numpy().tobytes())
                    h.update((b.keys.numpy() & _PLACE_AND_GENERATION).tobytes())
                    if sampler == "prioritized":
                        buf.update_priorities(b.keys, np.random.default_rng(i).random(len(b.keys)))
                out[f"{kind}/{sampler}/{streams}x{cap}/window {window}"] = h.hexdigest()[:16]
    return out


if __name__ == "__main__":
    print(json.dumps(digests(), indent=1))
