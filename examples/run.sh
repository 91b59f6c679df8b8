#!/usr/bin/env bash
# Both examples, each in its own temporary folder (CI runs this with the debug builds:
# ANCHORAGE=target/debug/anchorage ANCHORAGE_SERVER=... ANCHORAGE_CLIENT=... examples/run.sh).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/field/run.sh"
"$here/research/run.sh"
