"""The peer benchmark's driver: the same FedAvg jobs in `anchorage sim` (real and virtual clock)
and in Flower's simulation engine, side by side. Run it through run.sh, which makes the virtual
environment and builds `anchorage`:

    python compare.py --anchorage PATH --data-dir DIR --out DIR [--quick] [--jobs a,b] [--flower-cpus N]

For each job: `anchorage export` writes the job (features, rows, batch order, selection, initial
weights); then each contender runs as its own process while a sampler reads /proc every 0.1 s:
wall time of the whole process, peak memory (Flower: the PSS of every process of its tree
summed, sampled from /proc/PID/smaps_rollup; Anchorage: the peak RSS the kernel reports for the
process, VmHWM via wait4, and its sampled PSS), the global accuracy after every round. It checks
that the clients Anchorage trained in each round (its ledger) are those the export promised,
and prints the table with the ratios Anchorage / Flower. Then the two microbenchmarks: the
training step against PyTorch on 1 and 2 threads, and FedAvg of 100 updates of 1 MB against
a STREAM-like copy measured in the same run.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (clients, samples per client, fraction per round, rounds, MNIST scale)
JOBS = {
    "10x600-r3": (10, 600, 1.0, 3, 0.1),
    "10x600-r20": (10, 600, 1.0, 20, 0.1),
    "100x600-10pct-r20": (100, 600, 0.1, 20, 1.0),
    "100x600-all-r20": (100, 600, 1.0, 20, 1.0),
    "1000x60-10pct-r20": (1000, 60, 0.1, 20, 1.0),
    "1000x60-10pct-r20-eval": (1000, 60, 0.1, 20, 1.0),
}
# Jobs where each sampled client also evaluates its trained local model on the whole test set
# every round, as the papers report (issue 35): Anchorage's default (no eval_every), Flower's
# ClientApp after training (flower_job.py --local-eval).
LOCAL_EVAL = {"1000x60-10pct-r20-eval"}
QUICK = ["10x600-r3", "10x600-r20"]
LABEL = {
    "10x600-r3": "10 clients × 600, 3 rounds",
    "10x600-r20": "10 clients × 600, 20 rounds",
    "100x600-10pct-r20": "100 × 600, 10% per round, 20 rounds",
    "100x600-all-r20": "100 × 600, all per round, 20 rounds",
    "1000x60-10pct-r20": "1,000 × 60, 10% per round, 20 rounds",
    "1000x60-10pct-r20-eval": "1,000 × 60, 10% per round, 20 rounds, clients evaluate",
}

SCENARIO = """# The peer benchmark's job {name} (written by benches/peers/compare.py).
[scenario]
name = "peers-{name}"

[method]
name = "fedavg"

[model]
backbone = "identity"    # the MLP 784-256-10 on raw pixels, trained whole
hidden = [256]

[federation]
clients = {clients}
fraction = {fraction}
rounds = {rounds}
local_epochs = 1
batch_size = 32
learning_rate = 0.001
round_deadline_secs = 3600.0
{eval_every}
[data]
dataset = "mnist"
scale = {scale}
test_scale = {scale}    # the jobs' test sets as published (the test set is whole by default)
seed = 1

[data.partition]
kind = "iid"
clients = {clients}
"""


def mib(kb: float) -> float:
    return kb / 1024.0


class TreeSampler(threading.Thread):
    """Peak summed PSS and RSS (kB) of a process and all its descendants, every `period` s. A
    process seen once stays counted while it lives, even if it is re-parented."""

    def __init__(self, root: int, period: float = 0.1):
        super().__init__(daemon=True)
        self.root, self.period = root, period
        self.known = {root}
        self.peak_pss = self.peak_rss = 0
        self.max_procs = 0
        self.at_peak: dict[str, float] = {}
        self.stop = threading.Event()

    def scan(self):
        parent = {}
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                with open(f"/proc/{p}/stat", "rb") as f:
                    s = f.read()
                parent[int(p)] = int(s[s.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError):
                pass
        changed = True
        while changed:
            changed = False
            for pid, ppid in parent.items():
                if ppid in self.known and pid not in self.known:
                    self.known.add(pid)
                    changed = True
        alive = [p for p in self.known if p in parent]
        pss = rss = 0
        by_name: dict[str, float] = {}
        for pid in alive:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            kb = int(line.split()[1])
                            pss += kb
                            by_name[name] = by_name.get(name, 0.0) + mib(kb)
                        elif line.startswith("Rss:"):
                            rss += int(line.split()[1])
            except OSError:
                pass
        if pss > self.peak_pss:
            self.at_peak = {k: round(v, 1) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}
        self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
        self.max_procs = max(self.max_procs, len(alive))

    def run(self):
        while not self.stop.is_set():
            self.scan()
            self.stop.wait(self.period)


def measure(cmd, log_path, env=None, cwd=None):
    """Runs `cmd`; returns wall seconds, the sampler's peaks, the process's own peak RSS (kB)."""
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = open(log_path).read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; the end of {log_path}:\n{tail}")
    return {
        "wall_s": wall,
        "peak_pss_mib": mib(sampler.peak_pss),
        "peak_rss_sum_mib": mib(sampler.peak_rss),
        "own_peak_rss_mib": mib(usage.ru_maxrss),
        "processes": sampler.max_procs,
        "pss_at_peak_by_process_name_mib": sampler.at_peak,
    }


def anchorage_rounds(run_dir):
    with open(os.path.join(run_dir, "rounds.csv")) as f:
        return [float(r["accuracy"]) for r in csv.DictReader(f)]


def ledger_compute(run_dir):
    """Seconds of local training the ledger records, summed over client-rounds."""
    with open(os.path.join(run_dir, "ledger.csv")) as f:
        return sum(float(r["compute_seconds"]) for r in csv.DictReader(f))


def ledger_selection(run_dir):
    by_round = {}
    with open(os.path.join(run_dir, "ledger.csv")) as f:
        for r in csv.DictReader(f):
            by_round.setdefault(int(r["round"]), set()).add(int(r["client"].rsplit("-", 1)[1]))
    return by_round


def run_job(name, args, out):
    import numpy as np

    clients, per_client, fraction, rounds, scale = JOBS[name]
    job = os.path.join(out, name)
    os.makedirs(job, exist_ok=True)
    scenario = os.path.join(job, "scenario.toml")
    fields = dict(name=name, clients=clients, fraction=fraction, rounds=rounds, scale=scale)
    # Both sides evaluate the global model every round on the server; clients' own evaluation
    # of their local model is off on both (Flower: fraction_evaluate = 0), except in the
    # LOCAL_EVAL jobs, where every sampled client evaluates after training on both.
    client_eval = name in LOCAL_EVAL
    with open(scenario, "w") as f:
        f.write(SCENARIO.format(eval_every="" if client_eval else f"eval_every = {10**9}", **fields))
    export = os.path.join(job, "export")
    res = subprocess.run(
        [args.anchorage, "export", scenario, "--data-dir", args.data_dir, "--out", export],
        capture_output=True,
        text=True,
    )
    local_eval = "every round" if client_eval else "off"
    if res.returncode != 0 and "eval_every" in res.stderr:
        # An anchorage without the evaluation policy: its clients evaluate every round.
        with open(scenario, "w") as f:
            f.write(SCENARIO.format(eval_every="", **fields))
        local_eval = "every round (this anchorage has no eval_every)"
        res = subprocess.run(
            [args.anchorage, "export", scenario, "--data-dir", args.data_dir, "--out", export],
            capture_output=True,
            text=True,
        )
    if res.returncode != 0:
        raise RuntimeError(f"anchorage export failed:\n{res.stderr}")
    meta = json.load(open(os.path.join(export, "meta.json")))
    assert all(n == per_client for n in meta["train_samples"]), "unequal client shares"
    selection = np.load(os.path.join(export, "selection.npy"))
    result = {"job": name, "label": LABEL[name], "local_eval": local_eval, "test_rows": meta["test_samples"]}

    for clock in ["real", "virtual"]:
        run_dir = os.path.join(job, f"anchorage-{clock}")
        if os.path.exists(run_dir):
            subprocess.run(["rm", "-rf", run_dir], check=True)
        cmd = [args.anchorage, "sim", scenario, "--data-dir", args.data_dir, "--clock", clock, "--out", run_dir]
        m = measure(cmd, os.path.join(job, f"anchorage-{clock}.log"))
        m["accuracy"] = anchorage_rounds(run_dir)
        m["ledger_compute_s"] = ledger_compute(run_dir)
        trained = ledger_selection(run_dir)
        m["selection_matches"] = all(
            trained.get(r + 1, set()) == set(int(c) for c in selection[r]) for r in range(rounds)
        )
        result[f"anchorage_{clock}"] = m
        print(
            f"  anchorage {clock:7}: {m['wall_s']:7.2f} s  peak RSS {m['own_peak_rss_mib']:7.0f} MiB  "
            f"accuracy {m['accuracy'][-1] * 100:.2f}%  training (ledger) {m['ledger_compute_s']:.2f} s  "
            f"selection as exported: {m['selection_matches']}",
            flush=True,
        )

    if not args.skip_flower:
        flower_json = os.path.join(job, "flower.json")
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
        cmd = [sys.executable, os.path.join(HERE, "flower_job.py"), export, flower_json]
        cmd += ["--cpus-per-client", str(args.flower_cpus)]
        if client_eval:
            cmd.append("--local-eval")
        m = measure(cmd, os.path.join(job, "flower.log"), env=env)
        fr = json.load(open(flower_json))
        m["accuracy"] = [r["accuracy"] for r in fr["rounds"] if r["round"] > 0]
        result["flower"] = m
        print(
            f"  flower           : {m['wall_s']:7.2f} s  PSS {m['peak_pss_mib']:7.0f} MiB over {m['processes']} "
            f"processes  accuracy {m['accuracy'][-1] * 100:.2f}%",
            flush=True,
        )
    with open(os.path.join(job, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def microbenches(args, out):
    res = {"anchorage": {}, "torch": {}}
    for t in (1, 2):
        env = dict(os.environ, RAYON_NUM_THREADS=str(t))
        r = subprocess.run([args.anchorage, "microbench"], capture_output=True, text=True, env=env, check=True)
        res["anchorage"][t] = json.loads(r.stdout.strip().splitlines()[-1])
        r = subprocess.run(
            [sys.executable, os.path.join(HERE, "torch_step.py"), str(t)], capture_output=True, text=True, check=True
        )
        res["torch"][t] = json.loads(r.stdout.strip().splitlines()[-1])
    with open(os.path.join(out, "microbench.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def print_table(results, micro, args):
    print()
    print("| job | Anchorage wall, real / virtual | Flower wall | ratio real / virtual (target) | "
          "Anchorage peak RSS, real / virtual | Flower PSS (processes) | ratio real / virtual (≤ 0.20) | "
          "final accuracy, Anchorage real / virtual / Flower | max round gap |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        a, v = r["anchorage_real"], r["anchorage_virtual"]
        f = r.get("flower")
        target = "≤ 0.10" if r["job"].startswith("10x") else "≤ 0.33"
        if f:
            gap = max(
                max(abs(x - y) for x, y in zip(a["accuracy"], f["accuracy"])),
                max(abs(x - y) for x, y in zip(v["accuracy"], f["accuracy"])),
            )
            print(
                f"| {r['label']} | {a['wall_s']:.2f} / {v['wall_s']:.2f} s | {f['wall_s']:.1f} s | "
                f"{a['wall_s'] / f['wall_s']:.3f} / {v['wall_s'] / f['wall_s']:.3f} ({target}) | "
                f"{a['own_peak_rss_mib']:.0f} / {v['own_peak_rss_mib']:.0f} MiB | "
                f"{f['peak_pss_mib']:.0f} MiB ({f['processes']}) | "
                f"{a['own_peak_rss_mib'] / f['peak_pss_mib']:.3f} / {v['own_peak_rss_mib'] / f['peak_pss_mib']:.3f} | "
                f"{a['accuracy'][-1] * 100:.2f}% / {v['accuracy'][-1] * 100:.2f}% / {f['accuracy'][-1] * 100:.2f}% | "
                f"{gap * 100:.2f} pt |"
            )
        else:
            print(f"| {r['label']} | {a['wall_s']:.2f} / {v['wall_s']:.2f} s | – | – | "
                  f"{a['own_peak_rss_mib']:.0f} / {v['own_peak_rss_mib']:.0f} MiB | – | – | "
                  f"{a['accuracy'][-1] * 100:.2f}% / {v['accuracy'][-1] * 100:.2f}% / – | – |")
    if micro:
        print()
        print("| kernel | threads | Anchorage (burn flex) | PyTorch | Anchorage / PyTorch |")
        print("|---|---:|---:|---:|---:|")
        for t in (1, 2):
            a, p = micro["anchorage"][t], micro["torch"][t]
            print(f"| training step, MLP 784-256-10, Adam, batch 32 | {t} | {a['step_ms']:.3f} ms | "
                  f"{p['step_ms']:.3f} ms | {a['step_ms'] / p['step_ms']:.2f} |")
        for t in (1, 2):
            a, p = micro["anchorage"][t], micro["torch"][t]
            print(f"| f32 matmul 1024³ | {t} | {a['matmul_gflops']:.1f} GFLOP/s | {p['matmul_gflops']:.1f} GFLOP/s | "
                  f"{a['matmul_gflops'] / p['matmul_gflops']:.2f} |")
        for t in (1, 2):
            a, p = micro["anchorage"][t], micro["torch"][t]
            print(f"| step as a fraction of its own matmul rate ({a['step_flop'] / 1e6:.1f} MFLOP per step) | {t} | "
                  f"{a['step_fraction_of_matmul'] * 100:.1f}% | {p['step_fraction_of_matmul'] * 100:.1f}% | – |")
        for t in (1, 2):
            a = micro["anchorage"][t]
            if "step_ms_b256" not in a:  # an anchorage from before issue 35's batch-256 figures
                continue
            print(f"| its five matrix products alone, batch 32 | {t} | {a['step_products_ms']:.3f} ms | – | – |")
            print(f"| training step, batch 256 (issue 35's target: ≥ 50 % of the matmul rate) | {t} | "
                  f"{a['step_ms_b256']:.3f} ms, {a['step_fraction_of_matmul_b256'] * 100:.1f}% | – | – |")
            print(f"| its five matrix products alone, batch 256 | {t} | {a['step_products_ms_b256']:.3f} ms | – | – |")
        print()
        print("| aggregation, 100 updates × 1 MB | threads | time | update bytes read / s | STREAM-like copy (same run) | fraction |")
        print("|---|---:|---:|---:|---:|---:|")
        for t in (1, 2):
            a = micro["anchorage"][t]
            print(f"| server FedAvg (decode, f64 weighted mean, encode) | {t} | {a['aggregate_ms']:.1f} ms | "
                  f"{a['aggregate_gbps']:.2f} GB/s | {a['copy_gbps']:.1f} GB/s | {a['aggregate_gbps'] / a['copy_gbps'] * 100:.1f}% |")
            print(f"| of which decoding the blocks (bytes → Vec<f32>) | {t} | {a['decode_ms']:.1f} ms | – | – | – |")
            print(f"| weighted mean alone (decoded blocks) | {t} | {a['mean_ms']:.1f} ms | "
                  f"{a['mean_gbps']:.2f} GB/s | {a['copy_gbps']:.1f} GB/s | {a['mean_gbps'] / a['copy_gbps'] * 100:.1f}% |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--anchorage", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="only the two 10-client jobs")
    p.add_argument("--jobs", help="comma-separated job names: " + ", ".join(JOBS))
    p.add_argument("--flower-cpus", type=int, default=1, help="Flower's client_resources num_cpus")
    p.add_argument("--skip-flower", action="store_true")
    p.add_argument("--skip-micro", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = args.jobs.split(",") if args.jobs else (QUICK if args.quick else list(JOBS))
    results = []
    for name in names:
        print(f"job {name} ({LABEL[name]})", flush=True)
        results.append(run_job(name, args, args.out))
    micro = None if args.skip_micro else microbenches(args, args.out)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"jobs": results, "microbench": micro, "load_average": os.getloadavg()}, f, indent=1)
    print_table(results, micro, args)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"logs, run folders and results.json in {args.out}")


if __name__ == "__main__":
    main()
