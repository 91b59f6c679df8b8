#!/usr/bin/env python3
"""Seeded runs of every scenario in scenarios/ with two builds of `anchorage`, side by side: the rounds each
run's metrics.json records must be identical (accuracy and the devices' weighted train loss to the last bit,
updates aggregated, bytes), timings aside. The train loss of round r is measured on the model of round r - 1,
so identical losses and accuracies round after round mean identical models.

    benches/identical/compare.py --old cdc2055            # builds both, runs at CPU scale, prints a table
    benches/identical/compare.py --old-bin A --new-bin B  # two binaries built already

The old revision is built from a git worktree in a temporary folder (removed at the end) with
CARGO_TARGET_DIR (default $HOME/.cache/anchorage-target), in release. Scenarios whose data is not in
ANCHORAGE_DATA (default ../shared/data) fail on both sides and are listed as such. Written here rather
than as an `anchorage` command: it builds and runs binaries and reads their run folders.
"""
import argparse, json, os, pathlib, shutil, subprocess, sys, tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMING = ("seconds", "wall", "time", "elapsed", "rss", "cpu")


def build(src: pathlib.Path, target: str) -> pathlib.Path:
    env = dict(os.environ, CARGO_TARGET_DIR=target)
    subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "anchorage"], cwd=src, env=env)
    return pathlib.Path(target) / "release" / "anchorage"


def run(binary, scenario, out, args):
    cmd = [str(binary), "sim", str(scenario), "--data-dir", args.data, "--data-scale", str(args.scale),
           "--rounds", str(args.rounds), "--clock", "virtual", "--out", str(out)]
    with open(str(out) + ".log", "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    metrics = out / "metrics.json"
    if code != 0 or not metrics.exists():
        return None, open(str(out) + ".log").read().strip().splitlines()[-1:] or ["(no output)"]
    rounds = json.loads(metrics.read_text()).get("rounds", [])
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rounds], None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="git revision to compare against (built here)")
    p.add_argument("--old-bin"), p.add_argument("--new-bin")
    p.add_argument("--scale", type=float, default=0.02, help="--data-scale of every run (default 0.02)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1800, help="seconds a run may take")
    p.add_argument("--data", default=os.environ.get("ANCHORAGE_DATA", str(ROOT.parent / "shared" / "data")))
    p.add_argument("--only", nargs="*", help="scenario files to run (default: every one in scenarios/)")
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    args = p.parse_args()
    target = os.environ.get("CARGO_TARGET_DIR", str(pathlib.Path.home() / ".cache" / "anchorage-target"))
    work = pathlib.Path(tempfile.mkdtemp(prefix="anchorage-identical-"))
    worktree = None
    try:
        new_bin = pathlib.Path(args.new_bin) if args.new_bin else build(ROOT, target)
        if args.old_bin:
            old_bin = pathlib.Path(args.old_bin)
        else:
            worktree = work / "old-src"
            subprocess.check_call(["git", "worktree", "add", "-q", "--detach", str(worktree), args.old], cwd=ROOT)
            built = build(worktree, target)
            old_bin = work / "anchorage-old"
            shutil.copy(built, old_bin)
        scenarios = [pathlib.Path(s) for s in args.only] if args.only else sorted((ROOT / "scenarios").rglob("*.toml"))
        rows, differ = [], 0
        for s in scenarios:
            name = str(s.relative_to(ROOT) if s.is_absolute() else s).replace("/", "_")
            (old, old_err), (new, new_err) = (run(b, ROOT / s if not s.is_absolute() else s, work / f"{side}-{name}", args)
                                               for side, b in (("old", old_bin), ("new", new_bin)))
            if old is None or new is None:
                verdict = f"did not run: old {old_err or 'ok'} / new {new_err or 'ok'}"
                differ += (old is None) != (new is None)
            elif old == new:
                verdict = f"identical ({len(new)} rounds)"
            else:
                first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
                verdict = f"DIFFERENT from round {first + 1}: {old[first:first + 1]} vs {new[first:first + 1]}"
                differ += 1
            rows.append((name, verdict))
            print(f"{name:55} {verdict}", flush=True)
        print(f"\n{len(rows)} scenarios, {differ} differ", flush=True)
        return 1 if differ else 0
    finally:
        if worktree is not None:
            subprocess.call(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"run folders kept in {work}")


if __name__ == "__main__":
    sys.exit(main())
