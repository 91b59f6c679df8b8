#!/usr/bin/env bash
# Issue 34: secure aggregation in a whole federation against the same federation without it (RESULTS.md,
# "Secure aggregation (issue 34): a federation with and without it"). Runs scenarios/privacy/<method>.toml
# with its [privacy] table removed and $ROUNDS rounds (200 devices, 100 a round, CIFAR-10 ResNet-20
# features, virtual clock), once as it is and once with `[secagg] enabled = true`, one after the other,
# and prints a table: final accuracy, what each device uploaded a round (payload and wire bytes from the
# cost records: under SecAgg the masked vector), and the host's wall time of the run (the virtual clock
# runs every device's SecAgg+ state machine on this host).
#
#   benches/secagg/run.sh
#   METHODS=fedavg ROUNDS=5 benches/secagg/run.sh
#
# Environment: ANCHORAGE (the binary; default $CARGO_TARGET_DIR/release/anchorage), ANCHORAGE_DATA (default
# ../shared/data), OUT (default runs/secagg), METHODS (default "fedavg fedprok"), ROUNDS (default 10).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${ANCHORAGE:-${CARGO_TARGET_DIR:-target}/release/anchorage}
export ANCHORAGE_DATA=${ANCHORAGE_DATA:-../shared/data}
OUT=${OUT:-runs/secagg}
METHODS=${METHODS:-"fedavg fedprok"}
ROUNDS=${ROUNDS:-10}
mkdir -p "$OUT/configs"

for m in $METHODS; do
  for secagg in off on; do
    cfg="$OUT/configs/$m-secagg-$secagg.toml"
    python3 - "scenarios/privacy/$m.toml" "$cfg" "$secagg" "$ROUNDS" <<'PY'
import re, sys
src, dst, secagg, rounds = sys.argv[1:]
text = open(src).read()
text = text[: re.search(r'(?m)^\[privacy\]', text).start()].rstrip() + '\n'
text = re.sub(r'(?m)^rounds = \d+', f'rounds = {rounds}', text)
if secagg == 'on':
    # clip: above every update's norm here (the ε = ∞ run's median is 0.68); prototype_clip: above a
    # ResNet-20 feature's norm (median 8.4), so neither clips what the plain run sends.
    text += '\n[secagg]\nenabled = true\nclip = 1.0\nprototype_clip = 20.0\n'
open(dst, 'w').write(text)
PY
    start=$(date +%s.%N)
    "$BIN" sim "$cfg" --quiet --force --out "$OUT/$m-secagg-$secagg" >/dev/null
    end=$(date +%s.%N)
    echo "$m $secagg $(python3 -c "print(f'{$end - $start:.1f}')")" >>"$OUT/wall.txt"
  done
done

python3 - "$OUT" $METHODS <<'PY'
import csv, sys
out, methods = sys.argv[1], sys.argv[2:]
wall = {}
for line in open(f'{out}/wall.txt'):
    m, s, t = line.split()
    wall[(m, s)] = t
print('| method | SecAgg | final accuracy | payload up B/device/round | wire up B/device/round | host wall s |')
print('|---|---|---:|---:|---:|---:|')
for m in methods:
    for s in ('off', 'on'):
        rows = list(csv.DictReader(open(f'{out}/{m}-secagg-{s}/rounds.csv')))
        n = sum(int(r['aggregated']) for r in rows)
        pay = sum(int(r['payload_up']) for r in rows) / n
        wire = sum(int(r['wire_up']) for r in rows) / n
        print(f"| {m} | {s} | {float(rows[-1]['accuracy']):.4f} | {pay:.0f} | {wire:.0f} | {wall[(m, s)]} |")
PY
