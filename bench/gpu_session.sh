#!/usr/bin/env bash
# One lent-GPU session in one command (each start of the machine costs minutes), side by side: the
# gpu-marked tests, the estimator against the CUDA allocator's measured peaks, the README's main job
# against the card, the smallest budget GPT-2 small's worst configurations train under
# (bench/measurements/fit_threshold.py) and what each in-process probe leaves on the card for the next
# (bench/measurements/probe_residue.py). Run from the project's root on the GPU machine, with .whl/
# carried along (../shared/gpu/make-wheels.sh cloudpickle nvidia-ml-py pytest-xdist execnet py-cpuinfo
# msgpack einops):
#
#     bash bench/gpu_session.sh [SECONDS [PART...]]   # SECONDS: each part's wall-clock limit (default 330)
#
# PART: gpu-tests, estimate, quickstart, threshold, residue, held-out, held-out-threshold, bert-reserve
# (default: all of them, at once; the held-out parts measure the models no calibration used,
# bench/measurements/estimate_accuracy.py's held_out_models; bert-reserve is BERT-large's allocated,
# reserved and nvidia-smi peaks under a 16 GiB cap, with and without expandable segments, beside the
# dry-run's prediction: bench/measurements/bert_large_reserve.py, issue 55).
#
# Everything lands in $OUT (or /tmp/gpu-session): the results files written, machine.txt, and logs.tar.gz
# (each part's log and the pytest junit file).
set -u
out=${OUT:-/tmp/gpu-session}
limit=${1:-330}
shift $(( $# > 0 ? 1 : 0 ))
only="$*"  # the parts to run (PART above); none named: all
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

part() {  # part NAME COMMAND...: one part in the background, its log and exit status in $out/NAME.log
  local name=$1; shift
  [ -z "$only" ] || [[ " $only " == *" $name "* ]] || return 0
  ( timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "exit $?" >> "$out/$name.log" ) &
}
part gpu-tests python3 -m pytest -o addopts='' -m gpu -q -n 3 --dist loadfile -rA --durations=15 \
  -p no:cacheprovider --junitxml="$out/gpu-tests.xml" tests
part estimate python3 bench/measurements/estimate_accuracy.py --device cuda --large
part quickstart python3 examples/quickstart.py
part threshold python3 bench/measurements/fit_threshold.py --only gpt2-124m --steps 5
part residue python3 bench/measurements/probe_residue.py
part held-out python3 bench/measurements/estimate_accuracy.py --device cuda --held-out
part held-out-threshold python3 bench/measurements/fit_threshold.py --held-out --steps 5
part bert-reserve python3 bench/measurements/bert_large_reserve.py
wait
find bench/results -newer "$out/machine.txt" -name '*.json' -exec cp {} "$out/" \;
nvidia-smi --query-gpu=memory.used --format=csv >> "$out/machine.txt" 2>&1
# the device tool brings back a few files only (2026-11-27: 8 of 10 came back): the logs go as one archive
( cd "$out" && shopt -s nullglob && logs=(*.log *.xml) && tar -czf logs.tar.gz "${logs[@]}" && rm -f "${logs[@]}" )
ls -la "$out"
