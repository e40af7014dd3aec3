"""A sensitivity sweep on one worker against the same sweep sharded over two (target: <= 0.6 x the one-worker wall
time on a machine with a core per worker).

Usage:
    python benchmarks/sharded_sweep.py                         # a random 8-block Llama, 16 x 128 tokens, INT8_W8A8
    python benchmarks/sharded_sweep.py --layers 12 --hidden 384 --samples 32
    python benchmarks/sharded_sweep.py --threads 2             # each worker's torch threads (default 1: a core each)

In a fresh embedded home (SQLite database, kombu's SQLAlchemy broker, SQLite result backend) it starts two real
``quantplan worker`` processes, registers a random-weight Llama written by the script, runs one warm-up sweep in two
shards (each worker imports torch and loads the model once; the reference log-probs are cached), then the timed
sweeps, alternating ``--shards 1`` (one worker does all) and ``--shards 2`` (the chord: one shard per worker, the
merge callback) ``--repeats`` times. Wall time is from queueing to the sweep's row reading ``succeeded``, polled
every 0.1 s: it includes each shard's model load, reference check and calibration, and the chord's callback (its
``celery.chord_unlock`` polls the SQLite result backend every second). The merged rows are checked equal to the
one-worker rows each time.

Each worker runs ``--threads`` torch threads (OMP_NUM_THREADS); with 1 on a 2-core machine, one worker uses one
core and two workers both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_RATIO = 0.6


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; a worker's torch threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_llama(folder: Path, layers: int, hidden: int, seed: int = 0) -> Path:
    """A random Llama (``layers`` blocks of width ``hidden``) and a word-level tokenizer, saved to ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.factories import WORDS, tiny_tokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                         num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=512,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--scheme", default="INT8_W8A8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    args = ap.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="qp-shard-bench-"))
    os.environ.update(QUANTPLAN_HOME=str(home / "home"), QUANTPLAN_USER="bench", OMP_NUM_THREADS=str(args.threads),
                      MKL_NUM_THREADS=str(args.threads))
    for key in [k for k in os.environ if k.startswith("QUANTPLAN_") and k not in ("QUANTPLAN_HOME", "QUANTPLAN_USER")]:
        del os.environ[key]

    from jobs.client import submit_job, wait_for
    from store import repo
    from store import shards as shard_rows
    from store.db import session_scope, upgrade
    from store.settings import get_settings
    from tests.factories import Proc

    s = get_settings()
    upgrade(s)
    workers = []
    try:
        for name in ("one", "two"):
            proc = Proc([sys.executable, "-m", "quantplan", "worker", "--queues", "cpu", "--name", f"{name}@%h"],
                        dict(os.environ), home / f"{name}.log")
            workers.append(proc)
            proc.wait_for(" ready.", timeout=180)
        folder = write_llama(home / "llama", args.layers, args.hidden)
        reg = wait_for(submit_job("register", {"source": str(folder), "name": "bench"}, settings=s).id,
                       timeout_s=600, settings=s)
        assert reg.status == "succeeded", reg.error
        model_id = reg.result["model_id"]
        sweep = {"scheme": args.scheme, "samples": args.samples, "seq_len": args.seq_len, "device": "cpu"}

        def run(shards: int) -> tuple[float, int, dict]:
            started, cpu0 = time.perf_counter(), sum(cpu_seconds(w.p.pid) for w in workers)
            job = wait_for(submit_job("sensitivity", {**sweep, "shards": shards}, model_id=model_id,
                                      settings=s).id, timeout_s=3600, settings=s, poll_s=0.1)
            took = time.perf_counter() - started
            cpu.setdefault(shards, []).append(sum(cpu_seconds(w.p.pid) for w in workers) - cpu0)
            assert job.status == "succeeded", job.error
            with session_scope(s) as session:
                rows = {r.unit: (r.kl_mean, r.top1_agree, r.sqnr_db) for r in repo.list_sensitivity(session, job.id)}
                ran_on = {sh.worker for sh in shard_rows.shards_of(session, job.id)}
            return took, len(ran_on), rows

        cpu: dict[int, list[float]] = {}
        _, warm_workers, _ = run(2)  # each worker imports torch and loads the model; the reference is cached
        one, two = [], []
        for _ in range(args.repeats):
            t1, _, rows1 = run(1)
            t2, on, rows2 = run(2)
            assert rows1 == rows2, "the merged sweep differs from the one-worker sweep"
            one.append(t1)
            two.append(t2)
        units = len(rows1)
    finally:
        for proc in workers:
            proc.stop()

    ratio = statistics.median(two) / statistics.median(one)
    machine = platform.processor() or platform.machine()
    print(f"{dt.date.today()} on {platform.node()} ({os.cpu_count()} CPUs, {machine}), {args.threads} torch thread(s) "
          "per worker")
    print(f"random Llama, {args.layers} blocks x {args.hidden} wide, {units} units of {args.scheme}, "
          f"{args.samples} x {args.seq_len} tokens; warm-up on {warm_workers} workers")
    print(f"  one worker  (--shards 1): {', '.join(f'{t:.1f}' for t in one)} s")
    print(f"  two workers (--shards 2): {', '.join(f'{t:.1f}' for t in two)} s, {on} workers took shards")
    print(f"  two / one: {ratio:.2f} (target <= {TARGET_RATIO} with a core per worker); merged rows equal: yes")
    work = statistics.median(cpu[2][1:]) / statistics.median(cpu[1])  # the warm-up's CPU time left out
    print(f"  the workers' CPU seconds, two shards / one task: {work:.2f} (the work sharding adds: each shard's "
          f"unquantized pass per batch, setup, the chord); load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
