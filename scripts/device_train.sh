#!/usr/bin/env bash
# Training on the GPU machine in one device session (scripts/device_train.py; its docstring has the details).
#   here:      ./scripts/device_train.sh prepare          # .device-train/: prompts, data (xz) and drafters, ~55 MB
#              then stage the target and packages: scripts/device_stage.sh build and trim, then the three calls
#              that `scripts/device_stage.sh calls` prints (the third can run `true`)
#   on device: call 4 at once, the tree still trimmed, carrying .device-train (a result folder to continue from
#              goes inside it):
#              bash .device2/on_device.sh env ./scripts/device_train.sh run --slice K [--from-result .device-train/R]
#   here:      ./scripts/device_train.sh unpack DIR_WITH_PARTS runs/device-K
# Without CUDA the run takes the CPU path (`run --quick` is the CPU test's form).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
mode=${1:?usage: device_train.sh prepare|run|unpack ...}; shift
case "$mode" in
    prepare) exec "$PYTHON" scripts/device_train.py --prepare "$@" ;;
    run) exec "$PYTHON" scripts/device_train.py --bundle .device-train "$@" ;;
    unpack) exec "$PYTHON" scripts/device_train.py --unpack "$1" --output "${2:-runs/device-result}" ;;
    *) echo "unknown mode $mode: prepare, run or unpack" >&2; exit 2 ;;
esac
