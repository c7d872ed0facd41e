#!/usr/bin/env bash
# Get this project, its SmolLM2 target and the shipped drafter onto the GPU machine (the recipe of
# ../shared/docs/DEVICE.md). A call sends at most 64 MiB (its carry plus the working tree), and the target (94 MiB),
# the drafter (31 MiB, bfloat16) and the packages the GPU image lacks need three. Run from the repo root after
# ./scripts/setup_env.sh:
#
#   scripts/device_stage.sh build     .device1/, .device3/, .device2/: what the three calls carry (ignored)
#   scripts/device_stage.sh trim      move every tree file the run does not need to $TRIM (outside the repo)
#   scripts/device_stage.sh sizes     what each call sends: the tree plus its carry, in MiB (must be <= 64)
#   scripts/device_stage.sh restore   move them back (tracked files lost anyway come back from git)
#   scripts/device_stage.sh calls     print the three device calls to make, each within 30 s of the last
#
# The run needs hf_dspark's code, scripts/ and tests/ (device_check.py builds its tiny models with tests/helpers.py);
# the drafter's weights travel in .device3 and are put back in place on the device (`on-device`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
TRIM=${TRIM:-$(cd .. && pwd)/device-trim-$(basename "$PWD")}
DRAFTER=${DRAFTER:-hf_dspark/drafters/smollm2-135m-instruct-dspark}
LIMIT=$((64 * 1048576))
# Tree files kept for the run: the package's code (no weights), the scripts and the tests.
KEEP='^(hf_dspark/.*|scripts/.*|tests/.*|pyproject\.toml|\.gitignore)$'
DROP='\.safetensors$'

tree_files() {  # what a call sends besides its carry: tracked files and untracked files git does not ignore
  { git ls-files; git ls-files --others --exclude-standard; } | sort -u | while IFS= read -r f; do
    [ -f "$f" ] && printf '%s\n' "$f"; done
}

sizes() {
  tree=$(tree_files | tr '\n' '\0' | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  status=0
  for d in .device1 .device3 .device2; do
    [ -d "$d" ] || { echo "$d is missing: run 'scripts/device_stage.sh build' first"; return 2; }
    s=$(du -sb "$d" | cut -f1)
    total=$((s + tree))
    verdict=ok; [ "$total" -le "$LIMIT" ] || { verdict="OVER: trim, or lower SPLIT"; status=1; }
    echo "call with $d: carry $((s / 1048576)) MiB + tree $((tree / 1048576)) MiB = $((total / 1048576)) MiB of 64 ($verdict)"
  done
  return $status
}

case "${1:-}" in
  build)
    [ -f "$DRAFTER/model.safetensors" ] || { echo "no $DRAFTER/model.safetensors"; exit 2; }
    gguf=$($PY -c "from hf_dspark.target import smollm2_gguf_path; print(smollm2_gguf_path())")
    touch .git/info/exclude
    grep -qx '/.device1/' .git/info/exclude || printf '/.device1/\n/.device2/\n' >> .git/info/exclude
    grep -qx '/.device3/' .git/info/exclude || printf '/.device3/\n' >> .git/info/exclude
    rm -rf .device1 .device2 .device3 && mkdir -p .device1 .device2 .device3
    # Three calls: part 1 of the target; the drafter (stored in bfloat16 already) and the target's middle; the rest
    # of the target, the packages and the code. Each call leaves 4 MiB for the trimmed tree.
    cp "$DRAFTER/model.safetensors" .device3/drafter.safetensors
    room=$((LIMIT - 4 * 1048576))
    middle=$((room - $(stat -c %s .device3/drafter.safetensors)))
    piece() { dd if="$gguf" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count="$3"} status=none; }
    piece .device1/part1 0 "$room"
    piece .device3/part1b "$room" "$middle"
    piece .device2/part2 $((room + middle))
    sha256sum "$gguf" | cut -d' ' -f1 > .device2/gguf.sha256
    basename "$gguf" > .device2/gguf.name
    # What the GPU image (Python 3.12) lacks or holds too old (../shared/docs/DEVICE.md): this venv's versions.
    pins=$($PY - transformers huggingface_hub httpx2 httpcore2 truststore anyio idna h11 click regex kernels tomlkit \
        gguf <<'PYV'
import sys
from importlib.metadata import PackageNotFoundError, version
found = []
for name in sys.argv[1:]:
    try:
        found.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
print(" ".join(found))
PYV
)
    whl=$(mktemp -d); site=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$whl" $pins
    for w in "$whl"/*.whl; do (cd "$site" && python3 -m zipfile -e "$w" .); done
    tar -cJf .device2/site.tar.xz -C "$site" .
    git ls-files hf_dspark | grep -Ev "$DROP" | tar -cJf .device2/pkg.tar.xz -T -
    echo hf_dspark > .device2/pkg.name
    cp ../shared/tools/device/on_device.sh .device1/; cp ../shared/tools/device/on_device.sh .device2/
    rm -rf "$whl" "$site"
    sizes || true
    ;;
  trim)
    if [ -d "$TRIM" ] && [ -n "$(find "$TRIM" -type f -print -quit)" ]; then
      echo "$TRIM holds files from an earlier trim: 'scripts/device_stage.sh restore' first"; exit 2
    fi
    mkdir -p "$TRIM"
    # One listing, taken before anything moves (.gitignore stays, so ignored files stay out of the calls).
    { tree_files | grep -Ev "$KEEP"; tree_files | grep -E "$KEEP" | grep -E "$DROP"; } > "$TRIM.list" || true
    while IFS= read -r f; do mkdir -p "$TRIM/$(dirname "$f")"; mv "$f" "$TRIM/$f"; done < "$TRIM.list"
    echo "moved $(wc -l < "$TRIM.list") files to $TRIM ('scripts/device_stage.sh restore' puts them back)"
    rm -f "$TRIM.list"
    sizes || true
    ;;
  restore)
    if [ -d "$TRIM" ]; then
      (cd "$TRIM" && find . -type f -print0) | while IFS= read -r -d '' f; do
        mkdir -p "$(dirname "$f")"; mv "$TRIM/$f" "$f"; done
      find "$TRIM" -depth -type d -empty -delete
    fi
    # A tracked file still missing (a trim interrupted mid-move) comes back from git; nothing else is touched.
    git ls-files -z --deleted | xargs -0 -r git checkout --
    git status --short | head -20
    ;;
  sizes)
    sizes
    ;;
  calls)
    cat <<EOF
Three run calls (a fourth if time allows), each within 30 s of the one before (the machine stays warm 30 s); timeout_s of the last leaves
room for a rerun:
1. carry [".device1"]: bash .device1/on_device.sh stage1
2. carry [".device3"]: cat .device3/part1b >> /tmp/stage/part1 && cp .device3/drafter.safetensors /tmp/stage/
3. carry [".device2"]: bash .device2/on_device.sh run bash scripts/device_stage.sh on-device python3 scripts/device_check.py
While warm, nothing carried: bash .device2/on_device.sh env bash scripts/device_stage.sh on-device CMD...
4. (if budget_left_s allows about 5 minutes more) DSpark with a compiled static target against compiled plain:
   bash .device2/on_device.sh env bash scripts/device_stage.sh on-device python3 scripts/device_check.py --checks smollm2 --static-assisted --prompts-per-set 1 --smollm2-budget 90
Then give_back, and 'scripts/device_stage.sh restore' here.
EOF
    ;;
  on-device)  # on the GPU machine, after on_device.sh put the package in place: the drafter's weights, then CMD
    shift
    path=${DEVICE_DRAFTER:-$DRAFTER}
    cp /tmp/stage/drafter.safetensors "$path/model.safetensors"
    exec "$@"
    ;;
  *)
    sed -n '2,15p' "$0"; exit 2
    ;;
esac
