"""The large fuzz run: thousands of random configs, CLI calls, data files, corrupted and hostile results folders.

    python scripts/fuzz.py --cases 5000                   # split evenly over the kinds
    python scripts/fuzz.py --cases 400 --kinds data,cli --jobs 2 --out fuzz.json
    python scripts/fuzz.py --replay data:123              # run one case again, in this process
    python scripts/fuzz.py --cases 2000 --kinds downloads,bombs,special,values   # inputs from outside only

Cases are those of ``tests/fuzzing.py`` (each drawn from ``kind:seed``); the kinds of inputs from
outside (``fuzzing.INPUT_KINDS``: hostile HTTP servers on 127.0.0.1, decompression and allocation
bombs, special files as inputs, huge and deeply nested values) bound each case by wall-clock time. They run in worker
processes,
each with a memory cap (``FEDSHUFFLE_MAX_MEMORY=1G`` for the estimates, and an address-space limit so
that an allocation that escapes the estimates fails instead of swapping); a worker that stops answering
for longer than a case may take is killed and its case counted as a hang, one that dies counts as a
traceback, and the next worker continues after it. The JSON written has the counts per kind and
outcome, and every bad case (traceback, hang, nonsense) with its seed, for ``--replay``, and, for a command
run in a process of its own (signals, TMPDIR), the end of its output; the hostile
cases are also counted per attack (links, FIFOs, names as paths, swapped and malicious checkpoints,
deep folders), and the signal cases per ending (among them those that ended in the interpreter's own start).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

import fuzzing  # noqa: E402

#: address space a worker may map (torch alone maps a few GiB of virtual memory)
WORKER_ADDRESS_SPACE = 12 << 30
#: wall-clock seconds without a line from a worker before its current case counts as a hang (a case
#: spinning on the CPU is stopped in the worker after fuzzing.CASE_SECONDS of CPU time)
SILENCE = 300


def worker(kind: str, start: int, stop: int, root: Path) -> None:
    """Run cases ``start..stop-1`` of ``kind``, one JSON line each."""
    os.environ.update(fuzzing.environment(root))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > WORKER_ADDRESS_SPACE:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE, hard))
    import torch

    torch.set_num_threads(1)
    template = (
        fuzzing.make_template(root / f"template-{os.getpid()}") if kind in ("cli", "results", "hostile") else None
    )
    for seed in range(start, stop):
        work = root / f"{kind}-{seed}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        began = time.monotonic()
        result = fuzzing.run_case(kind, seed, work, template)
        line = {
            "kind": kind,
            "seed": seed,
            "outcome": result.outcome,
            "detail": result.detail,
            "case": result.case,
            "seconds": round(time.monotonic() - began, 2),
        }
        if result.output:
            line["output"] = result.output
        print(json.dumps(line), flush=True)
        shutil.rmtree(work, ignore_errors=True)


class Worker:
    """A worker process over a range of seeds, restarted after the case it died or hung on."""

    def __init__(self, kind: str, start: int, stop: int, root: Path) -> None:
        self.kind, self.next, self.stop, self.root = kind, start, stop, root
        self.proc: subprocess.Popen | None = None
        self.last = time.monotonic()

    def launch(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", self.kind, str(self.next), str(self.stop), str(self.root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.last = time.monotonic()
        self.buffer = ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait()

    def lines(self) -> list[dict]:
        """Completed result lines read so far (non-blocking)."""
        try:
            chunk = self.proc.stdout.read()
        except (BlockingIOError, TypeError):
            chunk = None
        if not chunk:
            return []
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split("\n")
        out = []
        for text in complete:
            try:
                out.append(json.loads(text))
            except json.JSONDecodeError:
                continue
        if out:
            self.last = time.monotonic()
            self.next = out[-1]["seed"] + 1
        return out


def supervise(kinds: list[str], per_kind: int, jobs: int, root: Path, start: int, progress: bool) -> list[dict]:
    pending = []
    chunk = max(1, -(-per_kind // max(1, jobs)))
    for kind in kinds:
        for lo in range(start, start + per_kind, chunk):
            pending.append(Worker(kind, lo, min(lo + chunk, start + per_kind), root))
    running: list[Worker] = []
    results: list[dict] = []
    began = time.monotonic()
    try:
        while pending or running:
            while pending and len(running) < jobs:
                w = pending.pop(0)
                w.launch()
                running.append(w)
            time.sleep(0.2)
            for w in list(running):
                results.extend(w.lines())
                done = w.proc.poll() is not None
                if done:
                    results.extend(w.lines())
                silent = time.monotonic() - w.last > SILENCE
                if w.next >= w.stop:
                    w.kill()
                    running.remove(w)
                elif done or silent:
                    outcome = "hang" if silent and not done else "traceback"
                    detail = (
                        "worker "
                        f"{'silent for' if outcome == 'hang' else 'died (exit ' + str(w.proc.returncode) + ') in'} "
                        "case"
                    )
                    w.kill()
                    results.append(
                        {
                            "kind": w.kind,
                            "seed": w.next,
                            "outcome": outcome,
                            "detail": detail,
                            "case": "",
                            "seconds": None,
                        }
                    )
                    w.next += 1
                    running.remove(w)
                    if w.next < w.stop:
                        pending.insert(0, w)
            if progress:
                counts = Counter(r["outcome"] for r in results)
                print(
                    f"\r{len(results)} cases, {time.monotonic() - began:.0f} s: "
                    + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for w in running:
            w.kill()
    if progress:
        print(file=sys.stderr)
    return results


def report(results: list[dict], seconds: float) -> dict:
    by_kind = {
        kind: dict(Counter(r["outcome"] for r in results if r["kind"] == kind))
        for kind in sorted({r["kind"] for r in results})
    }
    totals = Counter(r["outcome"] for r in results)
    bad = [r for r in results if r["outcome"] in fuzzing.BAD]
    faults = Counter(f"{r['case']} → {r['outcome']}" for r in results if r["kind"] == "data")
    attacks = Counter(f"{r['case'].split(':', 1)[0]} → {r['outcome']}" for r in results if r["kind"] == "hostile")
    endings = Counter(f"{r['detail']} → {r['outcome']}" for r in results if r["kind"] == "signals")
    slowest = sorted((r for r in results if r["seconds"] is not None), key=lambda r: -r["seconds"])[:5]
    return {
        "cases": len(results),
        "seconds": round(seconds, 1),
        "totals": {o: totals.get(o, 0) for o in fuzzing.OUTCOMES},
        "by_kind": by_kind,
        "bad": bad[:300],
        "data_cases": dict(sorted(faults.items())),
        "hostile_attacks": dict(sorted(attacks.items())),
        "signal_endings": dict(sorted(endings.items())),
        "slowest": slowest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=5000, help="total cases, split evenly over --kinds")
    parser.add_argument("--kinds", default=",".join(fuzzing.KINDS), help=f"comma-separated: {', '.join(fuzzing.KINDS)}")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument(
        "--out", type=Path, default=Path("fuzz-results.json"), help="JSON of the counts and the bad cases"
    )
    parser.add_argument("--replay", help="KIND:SEED — run one case here and print its outcome")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--worker", nargs=4, metavar=("KIND", "START", "STOP", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, lo, hi, root = args.worker
        worker(kind, int(lo), int(hi), Path(root))
        return
    root = Path(tempfile.mkdtemp(prefix="fedshuffle-fuzz-"))
    try:
        if args.replay:
            kind, seed = args.replay.split(":")
            os.environ.update(fuzzing.environment(root))
            template = fuzzing.make_template(root / "template") if kind in ("cli", "results", "hostile") else None
            (root / "case").mkdir()
            result = fuzzing.run_case(kind, int(seed), root / "case", template)
            print(json.dumps(result.__dict__, indent=1))
            return
        kinds = [k for k in args.kinds.split(",") if k]
        unknown = set(kinds) - set(fuzzing.KINDS)
        if unknown:
            parser.error(f"unknown kinds {sorted(unknown)}; accepted: {', '.join(fuzzing.KINDS)}")
        began = time.monotonic()
        results = supervise(kinds, -(-args.cases // len(kinds)), args.jobs, root, args.start, not args.quiet)
        summary = report(results, time.monotonic() - began)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(
            json.dumps(
                {
                    "cases": summary["cases"],
                    "totals": summary["totals"],
                    "by_kind": summary["by_kind"],
                    "seconds": summary["seconds"],
                },
                indent=1,
            )
        )
        if any(summary["totals"][o] for o in fuzzing.BAD):
            sys.exit(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
