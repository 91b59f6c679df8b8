#!/usr/bin/env bash
# A minimal research sweep (see sweep.toml beside this file): the same configuration with seeds
# 7 and 8, each into its own run folder, then the sweep's mean ± std (sweep.md, sweep.json).
#
#   examples/research/run.sh [WORK_DIR]
#
# `anchorage` comes from $PATH or $ANCHORAGE (e.g. target/release/anchorage).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
anchorage="${ANCHORAGE:-anchorage}"
work="${1:-$(mktemp -d "${TMPDIR:-/tmp}/anchorage-sweep.XXXXXX")}"
mkdir -p "$work"

"$anchorage" sim "$here/sweep.toml" --seeds 2 --out "$work/sweep" --quiet
echo "research example done: $work/sweep (seed-7/, seed-8/, sweep.md, sweep.json)"
