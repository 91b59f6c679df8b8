#!/usr/bin/env bash
# Issue 34: how `clip` in scenarios/privacy/<method>.toml was chosen. Runs the method once at ε = ∞ (the [privacy]
# table removed, seed 1) with `robust = { norm_cap = 1.0, ... }`, whose bound is the round's median delta norm, so
# that the server logs that median every round ("influence bounded", norm_bound); prints the median over the rounds.
# A diagnostic only: that run clips every update above the median, so it is not a row of the table.
#
#   benches/privacy/clip.sh fedavg        # then set [privacy] clip near the printed median
#
# Environment: ANCHORAGE (the binary; default $CARGO_TARGET_DIR/release/anchorage), ANCHORAGE_DATA (default
# ../shared/data), OUT (default runs/privacy).
set -euo pipefail
cd "$(dirname "$0")/../.."
m=${1:?usage: benches/privacy/clip.sh METHOD (a file of scenarios/privacy/)}
BIN=${ANCHORAGE:-${CARGO_TARGET_DIR:-target}/release/anchorage}
DATA=${ANCHORAGE_DATA:-../shared/data}
OUT=${OUT:-runs/privacy}
mkdir -p "$OUT/clip"
cfg="$OUT/clip/$m.toml"
python3 - "scenarios/privacy/$m.toml" "$cfg" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
text = text[: re.search(r'(?m)^\[privacy\]', text).start()]
robust = 'robust = { norm_cap = 1.0, weight_cap = false, min_norm_ratio = false, max_sign_agreement = false }\n'
at = re.search(r'(?m)^\[', text).start()  # the flat keys end at the first table
open(sys.argv[2], 'w').write(text[:at] + robust + '\n' + text[at:])
PY
"$BIN" sim "$cfg" --data-dir "$DATA" --out "$OUT/clip/$m" --force --log info 2>&1 | tee "$OUT/clip/$m.log" | grep -v INFO
python3 - "$OUT/clip/$m.log" <<'PY'
import re, statistics, sys
norms = [float(x) for x in re.findall(r'influence bounded.*?norm_bound=Some\(([0-9.e+-]+)\)', open(sys.argv[1]).read())]
print(f'{len(norms)} rounds; median delta norm per round: first {norms[0]:.3f}, last {norms[-1]:.3f}; '
      f'median over the rounds {statistics.median(norms):.3f}')
PY
