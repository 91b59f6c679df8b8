#!/usr/bin/env python3
"""Issue 36: a scenario's variants over seeds, side by side, with paired differences.

Each variant is the scenario with some `[method]` keys set (or another method, through
`anchorage sim --method`); every variant runs `anchorage sim --seeds N` on the same seeds (the
same data splits), and the table gives each metric as mean ± sample std over the seeds and the
paired difference of the headline accuracy against the baseline variant (per seed, then mean ±
std), the way RESULTS.md reports them.

    benches/fidelity/ablate.py scenarios/fidelity/gldp_cifar10_resnet20.toml \\
        --variant gldp:global_head=true --variant gp_off:lambda=1.0,global_head=true \\
        --variant fedavg:method=fedavg --baseline fedavg --seeds 5 -- --data-scale 0.2 --rounds 50

A variant is NAME:key=value,key=value (values as TOML: 1.0, true, "head"); `method=NAME` replaces
the [method] table by that method with the variant's other keys (its defaults otherwise). `--table-only` prints the table of runs
already in the output folder. Environment: ANCHORAGE (the binary; default
$CARGO_TARGET_DIR/release/anchorage), ANCHORAGE_DATA (default ../shared/data).

Written here rather than as an `anchorage` command: it only runs the binary and reads the
sweep.json files it writes.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (sweep.json key, column) in table order; missing metrics print as "–".
COLUMNS = [
    ("final_accuracy", "A^glo"),
    ("continual.average_accuracy", "A^glo avg"),
    ("continual.local_final_accuracy", "A^loc"),
    ("continual.selected_final_accuracy", "A^sel"),
    ("probes.head_accuracy", "global head (probe)"),
    ("probes.separability", "tr(S_B)/tr(S_W) (probe)"),
]


def parse_variant(text):
    name, _, keys = text.partition(":")
    pairs = [kv.split("=", 1) for kv in keys.split(",") if kv]
    if not name or any(len(p) != 2 for p in pairs):
        sys.exit(f"bad variant `{text}`: NAME:key=value,key=value")
    return name, dict(pairs)


def with_method_keys(text, keys, method=None):
    """The scenario text with `keys` set in its [method] table (replaced or added after `name`), or
    with that table replaced by `method` and `keys` alone."""
    start = re.search(r"(?m)^\[method\]\s*$", text)
    if start is None:
        sys.exit("the scenario has no [method] table")
    end = re.search(r"(?m)^\[", text[start.end():])
    end = start.end() + end.start() if end else len(text)
    table = text[start.end():end]
    if method is not None:
        table = f'\nname = "{method}"\n\n'
    for key, value in keys.items():
        line = f"{key} = {value}"
        table, n = re.subn(rf"(?m)^{re.escape(key)}\s*=.*$", line, table)
        if n == 0:
            table = re.sub(r"(?m)^(name\s*=.*)$", lambda m: m.group(1) + "\n" + line, table, count=1)
    return text[:start.end()] + table + text[end:]


def run(binary, data, scenario, out, name, keys, seeds, extra):
    keys = dict(keys)
    method = keys.pop("method", None)
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{name}.toml"
    config.write_text(with_method_keys(scenario.read_text(), keys, method))
    cmd = [binary, "sim", str(config), "--data-dir", data, "--seeds", str(seeds), "--out", str(out / name),
           "--force", "--quiet", *extra]
    with open(out / f"{name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        print(f"{name}: anchorage sim exited with {code}; see {out / (name + '.log')}", file=sys.stderr)
    return code


def metric(sweep, key):
    m = sweep["metrics"].get(key)
    return dict(zip(m["seeds"], m["values"])) if m else {}


def show(values, key):
    if not values:
        return "–"
    v = list(values.values())
    mean = statistics.mean(v)
    std = statistics.stdev(v) if len(v) > 1 else float("nan")
    if key == "probes.separability":
        return f"{mean:.3f} ± {std:.3f}"
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def paired(values, base):
    seeds = sorted(set(values) & set(base))
    if len(seeds) < 2:
        return "–"
    d = [100 * (values[s] - base[s]) for s in seeds]
    below = sum(x < 0 for x in d)
    return f"{statistics.mean(d):+.1f} ± {statistics.stdev(d):.1f} ({below}/{len(d)} below)"


def table(out, names, baseline):
    sweeps = {}
    for name in names:
        path = out / name / "sweep.json"
        if path.exists():
            sweeps[name] = json.loads(path.read_text())
        else:
            print(f"{name}: no {path}", file=sys.stderr)
    base = metric(sweeps[baseline], "final_accuracy") if baseline in sweeps else {}
    head = ["variant", *[c for _, c in COLUMNS], f"A^glo − {baseline} (paired)", "seeds"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, sweep in sweeps.items():
        cells = [show(metric(sweep, k), k) for k, _ in COLUMNS]
        diff = "—" if name == baseline else paired(metric(sweep, "final_accuracy"), base)
        seeds = sweep["finished_seeds"]
        print(f"| {name} | " + " | ".join(cells) + f" | {diff} | {len(seeds)} |")


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("scenario", type=Path)
    p.add_argument("--variant", action="append", required=True, help="NAME:key=value,...")
    p.add_argument("--baseline", help="the variant the paired differences are against (default: the first)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    names = [n for n, _ in variants]
    out = args.out or Path("runs/fidelity") / args.scenario.stem
    baseline = args.baseline or names[0]
    if baseline not in names:
        sys.exit(f"--baseline {baseline} is not a variant ({', '.join(names)})")
    if not args.table_only:
        target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
        binary = os.environ.get("ANCHORAGE", f"{target}/release/anchorage")
        data = os.environ.get("ANCHORAGE_DATA", str(ROOT.parent / "shared" / "data"))
        if not Path(binary).is_file():
            sys.exit(f"no binary at {binary}: build it (cargo build --release -p anchorage) or set ANCHORAGE")
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            codes = list(pool.map(lambda v: run(binary, data, args.scenario, out, v[0], v[1], args.seeds, extra),
                                  variants))
        if any(codes):
            print("some variants failed; the table covers those that finished", file=sys.stderr)
    print(f"{args.scenario} (output {out}; mean ± sample std over seeds; accuracies in %)\n")
    table(out, names, baseline)


if __name__ == "__main__":
    main()
