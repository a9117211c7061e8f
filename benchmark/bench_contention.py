"""Engines on shared cores: bench_peers.py's decode and 16-stream figures, quiet, with one busy process pinned
to one of the engines' cores, and inside a cgroup limited to a fraction of the CPUs; interleaved rounds.

    python benchmark/bench_contention.py --model FOLDER [--awq AWQ_FOLDER] [--only "lmkit AWQ" "llama.cpp Q4_1"]
        [--modes quiet,busy,quota] [--quota 1.5] [--rounds 2] [--runs 3] [--new-tokens 64] [--baseline PKG:LABEL]

Modes:
  quiet   nothing else runs (as bench_peers.py).
  busy    `python -c "while True: pass"` pinned (sched_setaffinity) to the first of the CPUs this process may
          use, for the whole bench_peers run: a noisy neighbour, the api_server's own threads, a sidecar.
  quota   bench_peers and its workers in a cgroup whose CPU quota is --quota CPUs (cgroup v2 cpu.max or v1
          cpu.cfs_quota_us / period 100 ms): a Kubernetes `cpu: 1500m` limit. Needs write access to the cgroup
          file system (root in a container); skipped with a message otherwise. Every engine gets --threads
          threads regardless (lmkit's default would be the quota rounded up: lmkit/cpus.py).

Each mode of each round is one `bench_peers.py --rounds 1` run (its rows interleaved as there); the table gives
the median over rounds of each figure and its ratio to the same engine's quiet figure. TTFT is left to
bench_peers.py (here a 64-token prompt, only so that every row has one). Rows go to --csv with the mode in the
`weights` column (default benchmark/results/contention_cpu.csv).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_limits import QuotaGroup, confine  # noqa: E402
from summary import append_csv  # noqa: E402

DEFAULT_CSV = HERE / "results" / "contention_cpu.csv"
BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def busy_process(cpu: int):
    proc = subprocess.Popen([sys.executable, "-c", BUSY, str(cpu)])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def run_peers(args, mode: str, group: QuotaGroup | None, csv_path: Path) -> None:
    cmd = [sys.executable, str(HERE / "bench_peers.py"), "--model", str(args.model), "--gguf", "q4_1",
           "--threads", str(args.threads), "--rounds", "1", "--runs", str(args.runs), "--new-tokens",
           str(args.new_tokens), "--prefill-len", "64", "--concurrency", str(args.concurrency), "--csv", str(csv_path)]
    if args.awq:
        cmd += ["--awq", str(args.awq)]
    if args.only:
        cmd += ["--only", *args.only]
    for b in args.baseline:
        cmd += ["--baseline", b]

    print(f"bench_contention: {mode} ...", file=sys.stderr, flush=True)
    with busy_process(min(os.sched_getaffinity(0))) if mode == "busy" else contextlib.nullcontext():
        subprocess.run(cmd, check=True, preexec_fn=confine(group=group), stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--awq", type=Path, default=None)
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--baseline", action="append", default=[])
    ap.add_argument("--modes", default="quiet,busy,quota", type=lambda v: v.split(","))
    ap.add_argument("--quota", type=float, default=1.5, help="CPUs of the quota mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    args = ap.parse_args()
    group = QuotaGroup.create(args.quota, "quota") if "quota" in args.modes else None
    modes = [m for m in args.modes if m != "quota" or group is not None]
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                out = Path(tmp) / f"{mode}-{r}.csv"
                run_peers(args, mode, group if mode == "quota" else None, out)
                with out.open() as f:
                    rows = list(csv.DictReader(f))
                for row in rows:
                    if row["error"]:
                        print(f"bench_contention: {row['impl']} ({mode}): {row['error']}", file=sys.stderr)
                        continue
                    figures.setdefault((row["impl"], mode), []).append(
                        (float(row["decode_tok_s"]), float(row["conc_tok_s"] or "nan")))
                    row["weights"] = f"{row['weights']} [{mode}{f' {args.quota} CPUs' if mode == 'quota' else ''}]"
                append_csv(args.csv, list(rows[0].keys()) if rows else [], [list(x.values()) for x in rows])
    engines = sorted({e for e, _ in figures})
    print(f"\n{args.model.name}, {args.threads} threads, median of {args.rounds} interleaved rounds "
          f"({args.runs} runs each); busy: one busy process pinned to CPU {min(os.sched_getaffinity(0))}; "
          f"quota: {args.quota} CPUs")
    print(f"{'engine':<28}{'mode':<8}{'decode tok/s':>14}{'vs quiet':>10}{'c=' + str(args.concurrency) + ' tok/s':>14}{'vs quiet':>10}")
    for e in engines:
        quiet = figures.get((e, "quiet"))
        qd = statistics.median(d for d, _ in quiet) if quiet else None
        qc = statistics.median(c for _, c in quiet) if quiet else None
        for mode in modes:
            got = figures.get((e, mode))
            if not got:
                continue
            d, c = statistics.median(x for x, _ in got), statistics.median(y for _, y in got)
            rd = f"{d / qd:.0%}" if qd else "-"
            rc = f"{c / qc:.0%}" if qc else "-"
            print(f"{e:<28}{mode:<8}{d:>14.1f}{rd:>10}{c:>14.1f}{rc:>10}")
    if group is not None:
        group.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
