#!/usr/bin/env bash
# Render a report.html in headless chromium (Debian's `chromium`) and write a PNG screenshot.
#
#   scripts/screenshot_report.sh runs/x/report.html [out.png] [WIDTHxHEIGHT]
#
# Without arguments it first runs a small `autofit tune` on the CPU (an MLP under a 24 MiB budget) into
# a temporary run directory and screenshots that report. Needs chromium:
#   apt-get update && apt-get install -y chromium
# The browser gets no network, no sync, no component updates: the report must open offline.
set -euo pipefail

report="${1:-}"
shot="${2:-report.png}"
size="${3:-1100,2400}"
browser="$(command -v chromium || command -v chromium-browser || true)"
if [[ -z "$browser" ]]; then
    echo "chromium not found: apt-get update && apt-get install -y chromium" >&2
    exit 2
fi

if [[ -z "$report" ]]; then
    work="$(mktemp -d)"
    cat > "$work/mlp.py" <<'PY'
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
        self.head = nn.Linear(256, 1)

    def forward(self, x, y):
        return (self.head(self.blocks(x)).mean(1) - y).pow(2).mean()

def make():
    return Net(), lambda n: {"x": torch.randn(n, 128, 256), "y": torch.randn(n, 1)}
PY
    python -m autofit.cli.main tune --model "$work/mlp.py:make" --global-batch-size 16 --device cpu \
        --memory-budget 24MiB --allow 0 --max-probes 8 --warmup-steps 1 --timed-steps 1 --out "$work/run" >&2 || true
    report="$work/run/report.html"
fi

profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
    --disable-sync --no-first-run --hide-scrollbars --user-data-dir="$profile" --window-size="$size" \
    --screenshot="$(realpath -m "$shot")" "file://$(realpath "$report")" >&2
echo "$(realpath -m "$shot")"
