#!/usr/bin/env bash
# One lent-GPU session in one command (each start of the machine costs minutes): the gpu-marked tests,
# the estimator against the CUDA allocator's measured peaks, the README's main job against the card, and
# the smallest budget GPT-2 small's worst configurations train under (bench/fit_threshold.py), side by
# side. Run from the project's root on the GPU machine, with .whl/ carried along
# (../shared/gpu/make-wheels.sh cloudpickle nvidia-ml-py pytest-xdist execnet py-cpuinfo msgpack einops):
#
#     bash bench/gpu_session.sh [SECONDS]      # SECONDS: the wall-clock limit of each part (default 330)
#
# Everything lands in $OUT (or /tmp/gpu-session): logs, the pytest junit file, the estimate results.
set -u
out=${OUT:-/tmp/gpu-session}
limit=${1:-330}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
# the console script `pip install -e .` would make (no network here, so no install)
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from autofit.cli.main import main; sys.exit(main())" "$@"\n' \
  > /tmp/bin/autofit
chmod +x /tmp/bin/autofit
export PATH=/tmp/bin:$PATH
{ date -u; nvidia-smi; python3 -c 'import torch, transformers, sys; print(sys.version, torch.__version__,
  torch.version.cuda, transformers.__version__, torch.cuda.get_device_name(0))'; git log -1 --oneline; } \
  > "$out/machine.txt" 2>&1

( timeout "$limit" python3 -m pytest -o addopts='' -m gpu -q -n 3 --dist loadfile -rA --durations=15 \
    -p no:cacheprovider --junitxml="$out/gpu-tests.xml" tests > "$out/gpu-tests.log" 2>&1
  echo "exit $?" >> "$out/gpu-tests.log" ) &
( timeout "$limit" python3 bench/estimate_accuracy.py --device cuda --large > "$out/estimate.log" 2>&1
  echo "exit $?" >> "$out/estimate.log"; cp bench/results/estimate-cuda-*.json "$out/" 2>/dev/null ) &
( timeout "$limit" python3 examples/quickstart.py > "$out/quickstart.log" 2>&1
  echo "exit $?" >> "$out/quickstart.log" ) &
( timeout "$limit" python3 bench/fit_threshold.py --only gpt2-124m > "$out/threshold.log" 2>&1
  echo "exit $?" >> "$out/threshold.log"; cp bench/results/fit-threshold-cuda-*.json "$out/" 2>/dev/null ) &
wait
nvidia-smi --query-gpu=memory.used --format=csv >> "$out/machine.txt" 2>&1
ls -la "$out"
