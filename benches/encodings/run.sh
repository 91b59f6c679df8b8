#!/usr/bin/env bash
# Issue 33, item 4: upload bytes against accuracy for every update encoding, side by side in one
# run: FedAvg and FedProK (a prototype method) on the embedded default, 4 clients on the lte
# preset, the virtual clock, 20 rounds, 3 seeds each (`--seeds 3`: seeds 7, 8, 9).
#   cargo build --release -p anchorage
#   bash benches/encodings/run.sh [OUT]        (default OUT: /tmp/anchorage-encodings)
# Prints the Markdown table of benches/README.md ("Smaller updates").
set -euo pipefail
cd "$(dirname "$0")/../.."
ANCHORAGE="${ANCHORAGE:-${CARGO_TARGET_DIR:-target}/release/anchorage}"
OUT="${1:-/tmp/anchorage-encodings}"
mkdir -p "$OUT"
ROUNDS="${ROUNDS:-20}"
CONFIGS=(
  "f32|--encoding f32"
  "f16|--encoding f16"
  "int8|--encoding int8"
  "f32 + zstd|--encoding f32 --compress zstd"
  "int8 + zstd|--encoding int8 --compress zstd"
  "top-k 10%, f32 values|--encoding f32 --top-k 0.1"
  "top-k 10%, int8 values + zstd|--encoding int8 --top-k 0.1 --compress zstd"
  "top-k 1%, f32 values|--encoding f32 --top-k 0.01"
  "top-k 1%, f16 values + zstd|--encoding f16 --top-k 0.01 --compress zstd"
)
for method in fedavg fedprok; do
  for entry in "${CONFIGS[@]}"; do
    name="${entry%%|*}"
    read -r -a flags <<<"${entry#*|}"
    dir="$OUT/$method/$(echo "$name" | tr -c 'a-z0-9\n' '-')"
    "$ANCHORAGE" sim --method "$method" --clock virtual --link lte --rounds "$ROUNDS" --seeds 3 \
      "${flags[@]}" --out "$dir" --force --quiet >/dev/null
    echo "$method|$name|$dir"
  done
done >"$OUT/runs.txt"
python3 - "$OUT/runs.txt" <<'PY'
import csv, glob, json, sys
rows = [line.rstrip("\n").split("|") for line in open(sys.argv[1])]
base = {}
print("| method | upload encoding | up payload per client-round | vs f32 | up wire per client-round "
      "| final accuracy (mean ± std, 3 seeds) | simulated seconds, 20 rounds |")
print("|---|---|---:|---:|---:|---:|---:|")
for method, name, folder in rows:
    m = json.load(open(f"{folder}/sweep.json"))["metrics"]
    payload = m["mean_upload_payload"]["mean"]
    base.setdefault(method, payload)
    uploads = [r for f in glob.glob(f"{folder}/seed-*/ledger.csv") for r in csv.DictReader(open(f))
               if int(r["payload_up"]) > 0]
    wire = sum(int(r["wire_up"]) for r in uploads) / len(uploads)
    acc = m["final_accuracy"]
    sim = m["simulated_seconds"]["mean"]
    print(f"| {method} | {name} | {payload / 1024:,.1f} KiB | {base[method] / payload:.1f}× | {wire / 1024:,.1f} KiB | "
          f"{100 * acc['mean']:.2f}% ± {100 * acc['std']:.2f} | {sim:.1f} s |")
PY
