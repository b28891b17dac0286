#!/usr/bin/env bash
# Installs the code some sources measured (litgpt and the lightning it imports) into
# bench/calibration/vendor (or $AUTOFIT_CALIBRATION_VENDOR), without touching the Python environment:
# calibrate.py puts those folders on sys.path for the litgpt rows only. See measured_code.py.
set -euo pipefail
vendor="${AUTOFIT_CALIBRATION_VENDOR:-$(cd "$(dirname "$0")" && pwd)/vendor}"
python3 -m pip install --no-deps --target "$vendor/litgpt-0.4.0" litgpt==0.4.0
python3 -m pip install --no-deps --target "$vendor/lightning" lightning==2.6.6 lightning-utilities torchmetrics
