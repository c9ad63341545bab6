#!/usr/bin/env bash
# Rebuild TorchRL's C++ extension (torchrl._torchrl) against the installed torch.
#
# The torchrl 0.14.1 wheel ships an extension built against another torch; with torch
# 2.13.0 it fails to load (undefined symbol) and TorchRL's PrioritizedReplayBuffer then
# raises "SumSegmentTreeFp32 is not available". The wheel ships the C++ sources too, so
# we compile them with the flags of torchrl's own setup.py for a CPU build.
#
# usage: build_torchrl_ext.sh PYTHON SCRATCH_DIR [--keep]
#   --keep: leave the extension in SCRATCH_DIR/torchrl/ (the environment is not touched:
#           no pip install, no copy into site-packages); bench_sequences.py --torchrl-ext FILE
#           loads it from there. torch ships the pybind11 headers it needs.
set -euo pipefail
py="${1:?usage: build_torchrl_ext.sh PYTHON SCRATCH_DIR [--keep]}"
scratch="${2:?usage: build_torchrl_ext.sh PYTHON SCRATCH_DIR [--keep]}"
keep="${3:-}"
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"

site="$("$py" -c 'import os, torchrl; print(os.path.dirname(torchrl.__file__))')"
suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
echo "rebuilding torchrl._torchrl for $("$py" -c 'import torch; print(torch.__version__)') in $scratch" >&2
[ "$keep" = "--keep" ] || "$py" -m pip install -q pybind11 wheel
rm -rf "$scratch"
mkdir -p "$scratch/torchrl"
cp -r "$site/csrc" "$scratch/torchrl/"
cat > "$scratch/setup.py" <<'PYEOF'
import glob, os
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension
srcs = [os.path.relpath(f) for f in glob.glob("torchrl/csrc/*.cpp")]
setup(name="torchrl_ext_rebuild",
      ext_modules=[CppExtension("torchrl._torchrl", srcs, include_dirs=["."],
                                extra_compile_args={"cxx": ["-O3"]}, extra_link_args=["-Wl,-s"])],
      cmdclass={"build_ext": BuildExtension})
PYEOF
(cd "$scratch" && MAX_JOBS="${MAX_JOBS:-2}" "$py" setup.py -q build_ext --inplace)
if [ "$keep" = "--keep" ]; then
  echo "built $scratch/torchrl/_torchrl$suffix (use: bench_sequences.py --torchrl-ext FILE)" >&2
  exit 0
fi
cp "$scratch/torchrl/_torchrl$suffix" "$site/"
"$py" -c "import torchrl._torchrl" && echo "torchrl._torchrl loads" >&2
