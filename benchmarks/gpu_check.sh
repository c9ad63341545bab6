#!/usr/bin/env bash
# The GPU checks of issue 21 (item 4), in one run on a machine with a CUDA GPU: run from the
# repository root; every figure and log lands in $OUT (default /tmp/gpu_check). Sections
# have their own time limits, so one that fails or hangs does not cost the others:
#   env      nvidia-smi, torch, CUDA and NCCL versions
#   tests    the tests marked cuda (batches on the GPU equal to the CPU's, NCCL sampling,
#            DDP of ranks sharing a GPU, train --device cuda and its resume on the CPU)
#   nccl2    whether NCCL takes two ranks on one GPU (it refuses: "Duplicate GPU")
#   learner  bench_learner.py, conv and MLP nets on CUDA at batch 512: own, strict, pipelined
#   pong     shardreplay train on ALE/Pong-v5 with the learner on CUDA, as long as allowed
# Packages the machine lacks (lz4, gymnasium, ale-py) can travel as wheels in .whl/.
set -u
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-python3}
PONG_MINUTES=${PONG_MINUTES:-2}
TESTS_S=${TESTS_S:-240}
LEARNER_S=${LEARNER_S:-200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
section() { echo "=== $1 $(date +%T)"; }

section env
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')"
  nproc; } 2>&1 | tee "$OUT/env.txt"

section tests
timeout $TESTS_S $PY -m pytest -q -p no:cacheprovider -n 4 -o addopts="-ra --import-mode=importlib" --timeout 220 \
  tests/buffer/test_device.py tests/runtime/learner/test_devices.py tests/distributed/test_sharded_cuda.py \
  tests/runtime/launch/test_train_cuda.py --durations=10 2>&1 | tee "$OUT/tests.txt" | tail -25

section nccl2
cat > "$OUT/nccl2.py" <<'EOF'
import datetime, socket
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, port):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    t = torch.ones(1, device="cuda")
    try:
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print("rank", r, "nccl on one GPU: all_reduce gave", t.item(), flush=True)
    except Exception as exc:  # NCCL 2.28: "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device"
        print("rank", r, "nccl on one GPU refused:", str(exc).splitlines()[-1][:200], flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":  # a file, not stdin: spawn re-imports the main module
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(rank, args=(port,), nprocs=2)
EOF
timeout 60 $PY "$OUT/nccl2.py" 2>&1 | grep "nccl on one GPU" | tee "$OUT/nccl2.txt"

section learner
timeout $LEARNER_S $PY benchmarks/train/bench_learner.py --device cuda --batch 512 --nets conv,mlp --threads 4 \
  --out "$OUT/learner.json" 2>&1 | tail -3

section pong
[ "$PONG_MINUTES" -gt 0 ] && timeout $((PONG_MINUTES * 60 + 90)) $PY -m shardreplay train --env-id ALE/Pong-v5 --device cuda \
  --run-dir /tmp/pong --actors 12 --envs-per-actor 2 --batch-size 512 --replay-capacity 200000 \
  --min-replay 5000 --samples-per-insert 8 --max-minutes "$PONG_MINUTES" --stop-return none \
  --eval-interval-updates 1000000 --eval-episodes 1 --env-kwargs '{"max_num_frames_per_episode": 4000}' \
  --no-progress 2>&1 | tail -5 | tee "$OUT/pong.txt"
cp /tmp/pong/summary.json "$OUT/pong_summary.json" 2>/dev/null
tail -3 /tmp/pong/metrics.csv > "$OUT/pong_metrics_tail.csv" 2>/dev/null
section done
