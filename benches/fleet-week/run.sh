#!/usr/bin/env bash
# A simulated week of the 1,000-device mixed fleet of week.toml, four ways (issue 33): uploads
# and broadcasts resumable or sent again from the start, and the devices' [eligibility] on or off (the battery
# and thermal models run in all four). Prints the table of benches/README.md, "A week of a mixed
# fleet". Usage: benches/fleet-week/run.sh [BIN] [OUT] (defaults: the release build, a temp folder).
# About 7 minutes of one core per variant; two run at a time.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-${CARGO_TARGET_DIR:-$here/../../target}/release/anchorage}
out=${2:-$(mktemp -d -t anchorage-week.XXXXXX)}
hours=${WEEK_HOURS:-168}
mkdir -p "$out"
variant() { # name resume eligibility
    local toml="$out/$1.toml"
    sed -e "s/^resume_uploads = .*/resume_uploads = $2/" -e "s/^resume_broadcasts = .*/resume_broadcasts = $2/" \
        -e "s/^stop_after_hours = .*/stop_after_hours = $hours.0/" "$here/week.toml" > "$toml"
    if [ "$3" = off ]; then sed -i '/^eligibility = /d' "$toml"; fi
    "$bin" sim "$toml" --quiet --force --out "$out/$1" > "$out/$1.log" 2>&1
}
variant resume-eligible true on & variant resume-always true off & wait
variant restart-eligible false on & variant restart-always false off & wait
python3 "$here/summarize.py" "$out"/resume-eligible "$out"/resume-always "$out"/restart-eligible "$out"/restart-always
