#!/usr/bin/env bash
# `pip install .` with no extras, in a fresh venv: torch is not installed, and the scheduler library,
# the simulator, the shipped grids (mapped into the wheel from profiles/) and the daemon work.
# Run from outside the clone, so the installed package is what runs. About a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
start=$SECONDS
work=$(mktemp -d)
daemon=""
cleanup() {
    if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then kill "$daemon"; fi
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "no_torch: FAILED: $*" >&2; exit 1; }

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q -c "$repo/constraints.txt" "$repo"
. "$work/venv/bin/activate"
cd "$work"
for module in torch transformers reasoning_gym psutil matplotlib pynvml cuda pyarrow; do
    python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is not None)" \
        || fail "pip install . installed $module"
done
python -c "import jigsaw.graph, jigsaw.sim, jigsaw.runtime.daemon"
python -c "
import jigsaw, jigsaw.profiles as p
assert p.SHIPPED_DIR.parts[-3:] == ('jigsaw', 'profiles', 'data') and 'site-packages' in p.SHIPPED_DIR.parts, p.SHIPPED_DIR
assert 'cpu/tiny-qwen3' in p.available(), p.available()
print('grid h100/qwen3-4b from the wheel:', jigsaw.load_grid('h100/qwen3-4b').device.sku)"
jigsaw --help > /dev/null
jigsaw sim --list > /dev/null
jigsaw sim --workload qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k --policy jigsaw --steps 1 --no-bound --no-trace > /dev/null

export JIGSAW_RUNTIME_DIR="$work/rt"
jigsaw daemon --no-trace > "$work/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do
    jigsaw daemon status > /dev/null 2>&1 && break
    kill -0 "$daemon" 2>/dev/null || fail "the daemon exited: $(cat "$work/daemon.log")"
    sleep 0.3
done
jigsaw daemon status || fail "the daemon did not answer in 30 s: $(cat "$work/daemon.log")"
[ "$(jigsaw run --name no-torch -- python -c 'print("ran")')" = ran ] || fail "jigsaw run"
jigsaw daemon stop
wait "$daemon" || fail "the daemon exited with $?: $(cat "$work/daemon.log")"
daemon=""
echo "no_torch: ok, $((SECONDS - start)) s"
