"""Bytes on the wire for Atari frames: whole stacks against packed chunks (frames once,
compressed with each codec), and the CPU each side pays per chunk.

Records a Pong trajectory with ale-py and gymnasium's standard DQN preprocessing (84x84
grayscale, frame skip 4 with max-pooling, no-op starts, 4-frame stacks; random actions),
cuts it into chunks of ``--steps`` steps the way an actor does, and for each codec packs
and decodes every chunk (:mod:`shardreplay.transport.codec`), checking the round trip.
Prints one JSON line. Needs the ``atari`` extra (``pip install -e .[atari]``).

    python benchmarks/transport/bench_wire_frames.py [--frames 4000] [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import common

from shardreplay import Field, Spec
from shardreplay.transport.codec import CODECS, Chunk, decode, encode, pack


def record_pong(frames: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``frames`` preprocessed Pong stacks [N, 4, 84, 84] uint8 and their dm_env step types."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = FrameStackObservation(AtariPreprocessing(gym.make("ALE/Pong-v5", frameskip=1), frame_skip=4,
                                                   noop_max=30), 4)
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    stacks, types = [obs], [0]
    while len(stacks) < frames:
        obs, _r, term, trunc, _ = env.step(env.action_space.sample())
        stacks.append(obs)
        types.append(2 if term or trunc else 1)
        if term or trunc:
            obs, _ = env.reset()
            stacks.append(obs)
            types.append(0)
    env.close()
    return np.stack(stacks[:frames]), np.array(types[:frames], np.uint8)


def chunks_of(obs: np.ndarray, step_type: np.ndarray, steps: int, spec: Spec) -> list[bytes]:
    """The trajectory as encoded chunks of one stream, ``steps`` steps each."""
    out = []
    for seq, at in enumerate(range(0, len(obs) - steps + 1, steps)):
        t = slice(at, at + steps)
        fields = {"obs": obs[t][None], "action": np.zeros((1, steps), np.int64),
                  "reward": np.zeros((1, steps), np.float32), "step_type": step_type[t][None],
                  "discount": np.ones((1, steps), np.float32)}
        out.append(encode(Chunk(0, seq, 0, np.array([0]), fields), spec))
    return out


def measure(chunks: list[bytes], spec: Spec, codec: str) -> dict[str, float]:
    """Packed bytes and CPU microseconds per chunk to pack and to decode, for one codec."""
    with common.timed() as packing:
        packed = [pack(c, spec, codec) for c in chunks]
    with common.timed() as decoding:
        decoded = [decode(p, spec, max_bytes=1 << 30) for p in packed]
    for back, c in zip(decoded, chunks, strict=True):  # bit for bit, outside the timing
        assert back.steps["obs"].tobytes() == decode(c, spec, max_bytes=1 << 30).steps["obs"].tobytes()
    n = len(chunks)
    return {"bytes": sum(map(len, packed)), "pack_us": packing.cpu_s / n * 1e6,
            "decode_us": decoding.cpu_s / n * 1e6}


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--frames", type=int, default=4000, help="Pong steps to record (default 4000)")
    ap.add_argument("--steps", type=int, default=64, help="steps per chunk (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per codec, the median kept (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    spec = Spec({"obs": Field((4, 84, 84), np.uint8, frame_stack=True), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})
    obs, step_type = record_pong(args.frames, args.seed)
    chunks = chunks_of(obs, step_type, args.steps, spec)
    for c in chunks[:2]:  # compile the decoder's checks outside the timed rounds
        decode(c, spec, max_bytes=1 << 30)
    steps = len(chunks) * args.steps
    plain = sum(map(len, chunks))
    out: dict[str, object] = {"bench": "wire_frames", "env": "ALE/Pong-v5", "steps": steps,
                              "steps_per_chunk": args.steps, "whole_stack_bytes_per_step": plain / steps}
    with common.timed() as whole:
        for c in chunks:
            decode(c, spec, max_bytes=1 << 30)
    out["decode_whole_stacks_us_per_chunk"] = round(whole.cpu_s / len(chunks) * 1e6, 1)
    for codec in CODECS:
        rounds = [measure(chunks, spec, codec) for _ in range(args.rounds)]
        size = rounds[0]["bytes"]
        out[codec] = {"bytes_per_step": round(size / steps, 1),
                      "ratio_vs_whole_stacks": round(size / plain, 5),
                      "pack_us_per_chunk": common.median((r["pack_us"] for r in rounds), 1),
                      "decode_us_per_chunk": common.median((r["decode_us"] for r in rounds), 1)}
    common.emit_line(out, args.out)


if __name__ == "__main__":
    main()
