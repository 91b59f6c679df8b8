#!/usr/bin/env python3
"""Issue 37: a relay tier over real QUIC on loopback, measured from the outside.

Starts a root (`anchorage-server`), R relays (`anchorage-relay`, each with a [parent] table) and
R fleet workers (`anchorage fleet --index i --of R`, worker i's devices on relay i with the other
relays as fallbacks), or, with --relays 0, one root with the fleet straight on it. Every program
is a release binary in its own process with its own SQLite store. While the rounds run it samples
each process's /proc (peak RSS from VmHWM, CPU from utime + stime) and, after each round the root
closes, the size of the root's database (anchorage.db and its WAL). Prints one table:

    benches/relays/tier.py --devices 10000 --relays 4 --rounds 10 --fraction 0.05
    benches/relays/tier.py --devices 1000 --relays 0 --rounds 10 --fraction 0.05   # the baseline

Environment: ANCHORAGE_BIN (the folder of the release binaries; default
$CARGO_TARGET_DIR/release). Each relay samples `fraction` of its own devices; the root takes every
relay each round. Written here rather than as a test: it runs for minutes and reports figures,
it asserts nothing beyond the run finishing.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def proc_stats(pid):
    """(peak RSS in MiB, CPU seconds) of a live process, or None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    hwm = next((int(l.split()[1]) for l in status.splitlines() if l.startswith("VmHWM:")), None)
    if hwm is None:  # exited, not yet reaped
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return hwm / 1024, (int(stat[11]) + int(stat[12])) / ticks


def db_bytes(state):
    return sum(p.stat().st_size for p in state.glob("anchorage.db*") if p.is_file())


def server_toml(dir_, id_, port, engine, parent=None, limits=""):
    state, tls = dir_ / id_ / "state", dir_ / id_
    text = f'''bind = "127.0.0.1:{port}"
method = "fedavg"
state_dir = "{state}"
tls_dir = "{tls}"
initial_model = "{dir_ / 'initial-model.bin'}"

[engine]
{engine}

[engine.robust]
weight_cap = false
max_samples = 1000000000

[limits]
max_connections = 12000
{limits}
'''
    if parent:
        text += f'\n[parent]\naddress = "127.0.0.1:{parent}"\nserver_name = "localhost"\n'
    path = dir_ / f"{id_}.toml"
    path.write_text(text)
    return path, state


def run(args):
    bins = Path(os.environ.get("ANCHORAGE_BIN", Path(os.environ.get("CARGO_TARGET_DIR", "target")) / "release"))
    anchorage = str(bins / "anchorage")
    dir_ = Path(tempfile.mkdtemp(prefix="anchorage-tier-"))
    logs = []

    def spawn(cmd, name):
        log = open(dir_ / f"{name}.log", "w")
        logs.append(log)
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ANCHORAGE_LOG": "info"})

    subprocess.run([anchorage, "ca", "init", "--dir", str(dir_ / "ca"), "--name", "tier"], check=True, capture_output=True)
    issue = lambda kind, id_: subprocess.run(
        [anchorage, "ca", "issue", kind, id_, "--name", "localhost", "--dir", str(dir_ / "ca"), "--out", str(dir_ / id_)],
        check=True, capture_output=True)
    issue("server", "root")
    scenario = dir_ / "fleet.toml"
    scenario.write_text(
        f"clients = {args.devices}\nrounds = {args.rounds}\nfraction = {args.fraction}\nmin_available = {args.devices}\n"
        f"seed = 7\nalpha = 100.0\ntrain_per_class = {max(3000, args.devices * 3 // 2)}\ntest_per_class = 100\n")
    # The embedded model's round-1 blocks, as `anchorage provision` writes them for a server.
    model_project = dir_ / "model-project.toml"
    model_project.write_text(
        f'name = "tier-model"\nca = "{dir_ / "model-ca"}"\nout = "{dir_ / "model"}"\nmethod = "fedavg"\n\n'
        '[server]\naddress = "127.0.0.1:4433"\n\n[[devices]]\nid = "unused"\n')
    subprocess.run([anchorage, "provision", str(model_project)], check=True, capture_output=True)
    model = next((dir_ / "model").rglob("initial-model.bin"))
    (dir_ / "initial-model.bin").write_bytes(model.read_bytes())

    per_round = lambda n: max(1, round(n * args.fraction))
    root_port = free_port()
    if args.relays == 0:
        engine = (f"rounds = {args.rounds}\nmin_available = {args.devices}\nmin_fit = {per_round(args.devices)}\n"
                  f"fraction = {args.fraction}\nround_deadline = 600000")
        limits = f"max_handshakes_per_ip = {args.devices + 100}"
    else:
        engine = f"rounds = {args.rounds}\nmin_available = {args.relays}\nmin_fit = {args.relays}\nfraction = 1.0\nround_deadline = 600000"
        limits = ""
    root_toml, root_state = server_toml(dir_, "root", root_port, engine, limits=limits)
    procs = {"root": spawn([str(bins / "anchorage-server"), "--config", str(root_toml)], "root")}
    targets = []
    for r in range(args.relays):
        id_ = f"relay-{r}"
        issue("relay", id_)
        port = free_port()
        devices = args.devices * (r + 1) // args.relays - args.devices * r // args.relays
        # 90% of its devices: in a connection storm some fail over to another relay (their
        # connect timed out), and a relay that waited for all of its own would never open.
        engine = (f"min_available = {devices * 9 // 10}\nmin_fit = {per_round(devices)}\nfraction = {args.fraction}\n"
                  "round_deadline = 300000")
        toml, _ = server_toml(dir_, id_, port, engine, parent=root_port, limits=f"max_handshakes_per_ip = {devices + 100}")
        procs[id_] = spawn([str(bins / "anchorage-relay"), "--config", str(toml)], id_)
        targets.append(port)
    if not targets:
        targets = [root_port]
    workers = len(targets)
    for i, port in enumerate(targets):
        fallbacks = [a for p in targets if p != port for a in ("--fallback", f"127.0.0.1:{p}")]
        cmd = [anchorage, "fleet", "--scenario", str(scenario), "--index", str(i), "--of", str(workers),
               "--server", f"127.0.0.1:{port}", "--server-name", "localhost", "--ca", str(dir_ / "ca"), *fallbacks]
        procs[f"worker-{i}"] = spawn(cmd, f"worker-{i}")

    started = time.time()
    peaks = {name: (0.0, 0.0) for name in procs}
    db_by_round, seen_rounds = [], 0
    while procs["root"].poll() is None:
        for name, p in procs.items():
            s = proc_stats(p.pid)
            if s:
                peaks[name] = (max(peaks[name][0], s[0]), max(peaks[name][1], s[1]))
        closed = (dir_ / "root.log").read_text().count("round closed") if (dir_ / "root.log").exists() else 0
        if closed > seen_rounds:
            seen_rounds = closed
            db_by_round.append((closed, db_bytes(root_state), time.time() - started))
        if time.time() - started > args.timeout:
            print(f"timed out after {args.timeout} s; logs in {dir_}", file=sys.stderr)
            break
        time.sleep(0.2)
    wall = time.time() - started
    for p in procs.values():
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    mode = f"{args.relays} relays × {args.devices // max(1, args.relays):,} devices" if args.relays else f"{args.devices:,} devices straight to the root"
    print(f"\n{mode}, {args.rounds} rounds, {args.fraction:.0%} of devices a round; wall {wall:.0f} s\n")
    print("| process | peak RSS (MiB) | CPU (s) | CPU per round (s) |")
    print("|---|---:|---:|---:|")
    for name, (rss, cpu) in peaks.items():
        print(f"| {name} | {rss:.0f} | {cpu:.1f} | {cpu / max(1, seen_rounds):.2f} |")
    if len(db_by_round) > 1:
        growth = [(b2 - b1) / 1024 for (_, b1, _), (_, b2, _) in zip(db_by_round, db_by_round[1:])]
        print(f"\nroot database after each round (KiB): {[round(b / 1024) for _, b, _ in db_by_round]}")
        print(f"root database growth per round: mean {sum(growth) / len(growth):.0f} KiB "
              f"(min {min(growth):.0f}, max {max(growth):.0f})")
        times = [t for _, _, t in db_by_round]
        print(f"round closes at (s): {[round(t, 1) for t in times]}")
    print(f"rounds closed at the root: {seen_rounds}")
    if not args.keep:
        # Every relay keeps its devices' updates: gigabytes after a large run.
        shutil.rmtree(dir_, ignore_errors=True)
    return 0 if seen_rounds >= args.rounds else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=10000)
    p.add_argument("--relays", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--keep", action="store_true", help="keep the folder (logs, stores) instead of removing it")
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    main()
