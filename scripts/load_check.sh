#!/usr/bin/env bash
# The soaks beside CPU load: two busy processes (a Python `while True: pass` each, normal priority) run for the
# whole check, as other suites run beside the soak on CI's two cores.
#
#   scripts/load_check.sh [NETWORK_RUNS] [KILL_RUNS]     (defaults 10 and 3; the network runs need root,
#                                                          iproute2 and nftables, as tests/test_soak.py does)
#
# - KILL_RUNS x `hotloop soak --minutes 1 --seed N`: every must-be-0 row 0 and every kill seen by the survivors
#   within the soak's goal (1 s from the SIGKILL to the error).
# - NETWORK_RUNS x `hotloop soak --network --minutes 0.75 --seed N --network-interval-s 2` (tests/test_soak.py's
#   run, one seed each): every must-be-0 row 0, every partition seen within its bound.
#
# One line a run, then the kill -> error p50 / p99 / max over every kill of every run, per kind. The records
# (JSON, and each run's table and progress) are kept in $LOAD_CHECK_OUT (default build/load_check). Exit 0 when
# every run passed. $PYTHON picks the interpreter (default: build/venv's, else python3).
set -euo pipefail

network_runs=${1:-10}
kill_runs=${2:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x "$root/build/venv/bin/python" ]; then python="$root/build/venv/bin/python"; else python=python3; fi
fi
out=${LOAD_CHECK_OUT:-$root/build/load_check}
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.txt "$out"/*.err

busy=()
stop_busy() { [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}" 2>/dev/null || true; }
trap stop_busy EXIT
for _ in 1 2; do
  python3 -c 'while True: pass' &
  busy+=($!)
done
echo "load: two busy processes (pids ${busy[*]}); $(nproc) CPUs; records in $out"

failed=0
run() {  # run NAME ARGS...: one soak; prints its verdict line
  local name=$1
  shift
  local t0=$SECONDS rc=0
  "$python" -m hotloop.cli soak "$@" --json "$out/$name.json" >"$out/$name.txt" 2>"$out/$name.err" || rc=$?
  local verdict
  verdict=$("$python" - "$out/$name.json" <<'EOF'
import json, sys
try:
    rec = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("no record")
    sys.exit()
bad = {f"{r['section']}: {r['name']}": r["value"] for r in rec["rows"] if r["must_be_zero"] and r["value"]}
k = rec["kill_to_error_s"].get("all")
kills = f"kill -> error max {k['max']:.2f} s over {k['n']}" if k else "no kill seen"
print(("ok" if rec["ok"] else "FAIL") + f"; {kills}" + (f"; not 0: {bad}" if bad else "")
      + ("; goal missed" if rec.get("goal_missed") else ""))
EOF
)
  printf '%-14s exit %d, %3d s: %s\n' "$name" "$rc" $((SECONDS - t0)) "$verdict"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

for i in $(seq 1 "$kill_runs"); do
  run "kill-$i" --minutes 1 --seed "$i"
done
for i in $(seq 1 "$network_runs"); do
  run "network-$i" --network --minutes 0.75 --seed "$i" --network-interval-s 2
done

"$python" - "$out" <<'EOF'
import glob, json, os, sys
from collections import defaultdict

from hotloop.soak import percentiles

per_kind = defaultdict(list)
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    rec = json.load(open(path))
    for kill in rec["kills"]:
        per_kind[kill["kind"]].extend(kill["detected_s"])
print("kill -> error, s, every run (two busy processes beside):")
print(f"  {'kind':<22} {'n':>4} {'p50':>6} {'p99':>6} {'max':>6}")
for kind, xs in sorted(per_kind.items()) + [("all", [x for xs in per_kind.values() for x in xs])]:
    if xs:
        p = percentiles(xs)
        print(f"  {kind:<22} {len(xs):>4} {p['p50']:>6.3f} {p['p99']:>6.3f} {p['max']:>6.3f}")
EOF
total=$((network_runs + kill_runs))
echo "runs passed: $((total - failed)) of $total"
[ "$failed" -eq 0 ]
