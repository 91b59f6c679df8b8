#!/usr/bin/env bash
# Issue 34: accuracy against ε for DP-FedAvg, FedProK and GLDP (RESULTS.md, "Differential privacy (issue 34):
# accuracy against ε"). Runs scenarios/privacy/<method>.toml at every ε of $EPSILONS (inf: the [privacy] table
# removed; otherwise its target_epsilon rewritten, its noise set to $NOISE) and every seed of $SEEDS (the
# federation's seed and the [data] seed both), $JOBS runs at a time, then prints the table: final accuracy
# mean ± sample std over the seeds, and the ε and σ the accountant reported (metrics.json `privacy`).
#
#   benches/privacy/run.sh                                  # the whole grid, central noise
#   NOISE=local METHODS=fedavg EPSILONS="8 4 1" benches/privacy/run.sh
#   TABLE_ONLY=1 benches/privacy/run.sh                     # the table of runs already there
#
# Environment: ANCHORAGE (the binary; default $CARGO_TARGET_DIR/release/anchorage), ANCHORAGE_DATA (default
# ../shared/data), OUT (default runs/privacy), JOBS (default 2), METHODS, EPSILONS, SEEDS, NOISE.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${ANCHORAGE:-${CARGO_TARGET_DIR:-target}/release/anchorage}
DATA=${ANCHORAGE_DATA:-../shared/data}
OUT=${OUT:-runs/privacy}
JOBS=${JOBS:-2}
METHODS=${METHODS:-"fedavg fedprok gldp"}
EPSILONS=${EPSILONS:-"inf 8 4 1"}
SEEDS=${SEEDS:-"1 2 3"}
NOISE=${NOISE:-central}
mkdir -p "$OUT/configs"

# One config per (method, ε, seed); one line per run for xargs.
jobs_file="$OUT/configs/jobs-$NOISE.txt"
: >"$jobs_file"
for m in $METHODS; do
  for e in $EPSILONS; do
    for s in $SEEDS; do
      name="$m-$NOISE-eps$e"
      cfg="$OUT/configs/$name-seed$s.toml"
      python3 - "scenarios/privacy/$m.toml" "$cfg" "$e" "$s" "$NOISE" <<'PY'
import re, sys
src, dst, eps, seed, noise = sys.argv[1:]
text = open(src).read()
text = re.sub(r'(?m)^seed = \d+', f'seed = {seed}', text)  # the federation's seed and [data] seed
if eps == 'inf':
    text = text[: re.search(r'(?m)^\[privacy\]', text).start()]
else:
    text = re.sub(r'(?m)^target_epsilon = .*$', f'target_epsilon = {float(eps)}', text)
    text = re.sub(r'(?m)^noise = "central"', f'noise = "{noise}"', text)
open(dst, 'w').write(text)
PY
      [ -n "${TABLE_ONLY:-}" ] || echo "$cfg $OUT/$name/seed-$s" >>"$jobs_file"
    done
  done
done

if [ -z "${TABLE_ONLY:-}" ]; then
  echo "$(wc -l <"$jobs_file") runs, $JOBS at a time, binary $BIN" >&2
  started=$(date +%s)
  # shellcheck disable=SC2016
  xargs -P "$JOBS" -L 1 sh -c '"$0" sim "$1" --data-dir "$2" --out "$3" --force --quiet >"$3.log" 2>&1 || echo "FAILED: $1 (see $3.log)" >&2' "$BIN" <<EOF_JOBS
$(while read -r cfg dir; do mkdir -p "$(dirname "$dir")"; echo "$cfg $DATA $dir"; done <"$jobs_file")
EOF_JOBS
  echo "grid wall time: $(( $(date +%s) - started )) s" >&2
fi

python3 - "$OUT" "$NOISE" "$METHODS" "$EPSILONS" "$SEEDS" <<'PY'
import json, os, statistics, sys
out, noise, methods, epsilons, seeds = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split(), sys.argv[5].split()
def cell(m, e):
    accs, eps, sigma = [], [], []
    for s in seeds:
        path = os.path.join(out, f'{m}-{noise}-eps{e}', f'seed-{s}', 'metrics.json')
        if not os.path.exists(path):
            continue
        r = json.load(open(path))
        if r.get('status') != 'finished':
            continue
        accs.append(100 * r['final_accuracy'])
        if r.get('privacy'):
            eps.append(r['privacy']['epsilon'])
            sigma.append(r['privacy']['noise_multiplier'])
    if not accs:
        return '–', '–', '–'
    sd = statistics.stdev(accs) if len(accs) > 1 else float('nan')
    acc = f'{statistics.mean(accs):.1f} ± {sd:.1f}%' + ('' if len(accs) == len(seeds) else f' (n = {len(accs)})')
    eps_s = ' / '.join(f'{x:.2f}' for x in eps) if eps else '∞ (off)'
    sig_s = f'{statistics.mean(sigma):.3f}' if sigma else '–'
    return acc, eps_s, sig_s
print(f'\n{noise} noise, seeds {", ".join(seeds)}: final accuracy mean ± std; ε the accountant reported per seed; σ\n')
print('| method | ' + ' | '.join(f'ε = {"∞" if e == "inf" else e}' for e in epsilons) + ' |')
print('|---|' + '---:|' * len(epsilons))
details = []
for m in methods:
    cells = [cell(m, e) for e in epsilons]
    print(f'| {m} | ' + ' | '.join(c[0] for c in cells) + ' |')
    details += [(m, e, c) for e, c in zip(epsilons, cells)]
print('\n| method | target ε | ε reported (per seed) | σ |')
print('|---|---:|---:|---:|')
for m, e, (acc, eps_s, sig_s) in details:
    if e != 'inf':
        print(f'| {m} | {e} | {eps_s} | {sig_s} |')
PY
