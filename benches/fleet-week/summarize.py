"""The table of benches/README.md, "A week of a mixed fleet", from run folders of week.toml
(issue 33): rounds per simulated hour, declines by reason, throttled rounds, bytes resent and the
final accuracy. Usage: summarize.py RUN_DIR...

Bytes resent: the upload wire bytes beyond what one clean transfer of each acknowledged update
takes under the virtual clock's packet model (1,200 payload bytes per packet, 40 bytes around
each: `sim/src/virtual_clock.rs`), summed over the week.
"""
import collections
import csv
import json
import os
import sys

REASONS = ["battery", "thermal", "metered", "window", "busy"]


def clean_wire(payload):
    return payload + -(-payload // 1200) * 40


def resent_text(resent, payload):
    if not payload:
        return "-"
    ratio = resent / payload
    share = f"{ratio:.1%} of the payload" if ratio < 1 else f"{ratio:.1f}× the payload"
    return f"{resent / 2**30:,.1f} GiB ({share})"


def row(run):
    with open(os.path.join(run, "rounds.csv")) as f:
        rounds = list(csv.DictReader(f))
    with open(os.path.join(run, "ledger.csv")) as f:
        ledger = list(csv.DictReader(f))
    with open(os.path.join(run, "metrics.json")) as f:
        metrics = json.load(f)
    hours = sum(float(r["seconds"]) for r in rounds) / 3600
    declines = collections.Counter(r["declined"] for r in ledger if r["declined"])
    reported = [r for r in ledger if r["dropped"] != "true" and not r["declined"]]
    resent = sum(max(0, int(r["wire_up"]) - clean_wire(int(r["payload_up"]))) for r in reported)
    payload = sum(int(r["payload_up"]) for r in reported)
    throttled = sum(1 for r in ledger if r["throttled"] == "true")
    dropped = sum(1 for r in ledger if r["dropped"] == "true")
    return [
        os.path.basename(run.rstrip("/")),
        str(len(rounds)),
        f"{hours:.1f}",
        f"{len(rounds) / hours:.1f}" if hours else "-",
        " / ".join(str(declines.get(k, 0)) for k in REASONS),
        str(throttled),
        str(len(reported)),
        str(dropped),
        resent_text(resent, payload),
        f"{metrics['final_accuracy']:.1%}",
    ]


header = ["run", "rounds", "simulated h", "rounds / h", "declines: battery / thermal / metered / window / busy",
          "throttled rounds", "updates acked",
          "dropped (invited, nothing by the close)", "bytes resent", "final accuracy"]
print("| " + " | ".join(header) + " |")
print("|" + "---|" * len(header))
for run in sys.argv[1:]:
    print("| " + " | ".join(row(run)) + " |")
