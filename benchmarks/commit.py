"""Cost of one engine-loop step commit (RedisStore.commit) against a real redis-server.

    python -m benchmarks.commit [--batch-sizes 1 16 64 256] [--steps 200] [--repeats 3]
        [--output benchmarks/results/commit.json]

For each batch size B, B requests (prompts of 32..47 tokens, so that their
block boundaries are staggered) are admitted and committed as the engine loop
commits a prefill step (block tables, running snapshot, admission queue
count). Then --steps decode steps are committed one after the other, each
what the output processor and engine loop put in a steady decode step's
StepCommit: one new token per sequence, one GenerateResponse per request
(one CompletionDelta with the token and its text), a new block for the
sequences that crossed a block boundary and the cache stats when those
changed, fenced by the loop's epoch (the running snapshot is unchanged, so
not resent). A last commit finishes every request. The whole run is repeated
--repeats times on an emptied database; the reported numbers are medians
over every timed decode commit.

Split of a commit's wall time:

    python  CPU time of this (single-threaded) process during the commit:
            building, encoding and parsing the commands, redis-py's own work
    redis   the rest of the wall time: waiting on round trips, which covers
            the server's execution (`server` alone, from INFO commandstats)

`state_digest` hashes every key, value and stream entry left in Redis after
each run: runs before and after a change to the commit must agree.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import random
import statistics
import time
from pathlib import Path

import redis
from tqdm import tqdm

from protos import common_pb2, generation_pb2, state_pb2
from scheduler_service import keys
from scheduler_service.store import CacheStats, RedisStore, StepCommit
from scheduler_service.store_types import progress_entry
from benchmarks.run_info import run_info
from shared.redis_dump import redis_state
from shared.redis_server import RedisServer

RESULTS = Path("benchmarks/results/commit.json")
WORKER = "w0"
EPOCH = 7
BLOCK_SIZE = 16
PROMPT_LEN = 32
NUM_BLOCKS = 1 << 16
# Typical detokenized text of one token.
WORDS = [" the", " of", " model", " and", " a", "ing", " serving", ".", " token", ","]


def _requests(batch: int, seed: int) -> list[state_pb2.AdmittedRequest]:
    rng = random.Random(seed)
    return [
        state_pb2.AdmittedRequest(
            request_id=f"bench-{batch}-{i:04d}", worker_id=WORKER, seq_ids=[10_000 + i], arrival_time=float(i),
            prompt_token_ids=[rng.randrange(49_152) for _ in range(PROMPT_LEN + i % BLOCK_SIZE)],
        )
        for i in range(batch)
    ]


def _blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


class _Workload:
    """The StepCommits of B requests, step by step, as the engine loop builds them."""

    def __init__(self, requests: list[state_pb2.AdmittedRequest], seed: int) -> None:
        self.requests = requests
        self.rng = random.Random(seed)
        self.tokens = {r.seq_ids[0]: len(r.prompt_token_ids) for r in requests}
        self.tables: dict[int, list[int]] = {}
        self.next_block = 0
        self.free = NUM_BLOCKS

    def _allocate(self, count: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        self.free -= count
        return ids

    def _stats(self) -> CacheStats:
        return CacheStats(self.free, NUM_BLOCKS)

    def prefill(self) -> StepCommit:
        c = StepCommit(WORKER, EPOCH)
        for r in self.requests:
            self.tables[r.seq_ids[0]] = self._allocate(_blocks_for(len(r.prompt_token_ids)))
        self._write_states(c, set(self.tables), computed_lag=len(self.requests[0].prompt_token_ids))
        c.newly_scheduled = [r.request_id for r in self.requests]
        c.running, c.waiting = [r.request_id for r in self.requests], []
        c.cache_stats = self._stats()
        return c

    def decode(self, finish: bool = False) -> StepCommit:
        c = StepCommit(WORKER, EPOCH)
        grown: set[int] = set()
        for r in self.requests:
            seq_id = r.seq_ids[0]
            token = self.rng.randrange(49_152)
            # The step computes the KV of the last sampled token: a block more when it starts one.
            if self.tokens[seq_id] % BLOCK_SIZE == 0:
                self.tables[seq_id] += self._allocate(1)
                grown.add(seq_id)
            self.tokens[seq_id] += 1
            c.new_tokens[seq_id] = [token]
            delta = generation_pb2.CompletionDelta(index=0, text=self.rng.choice(WORDS), token_ids=[token])
            msg = generation_pb2.GenerateResponse(request_id=r.request_id, outputs=[delta])
            if finish:
                delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
                msg.usage.prompt_tokens = len(r.prompt_token_ids)
                msg.usage.completion_tokens = self.tokens[seq_id] - len(r.prompt_token_ids)
                c.finished_requests.append(r.request_id)
                c.dropped_seqs.append(seq_id)
            c.outputs.append((r.request_id, msg))
        if finish:
            c.running = []
            self.free = NUM_BLOCKS
            c.dropped_seq_states = [r.seq_ids[0] for r in self.requests]
        else:
            # Every decoding sequence's computed count moves (its progress entry is rewritten each step); the
            # state with the table only for those that grew a block.
            self._write_states(c, grown, computed_lag=1)
        c.cache_stats = self._stats() if finish or any(t % BLOCK_SIZE == 1 for t in self.tokens.values()) else None
        return c

    def _write_states(self, c: StepCommit, with_table: set[int], computed_lag: int) -> None:
        """As StateJournal writes them: every sequence's progress, the whole state of those in `with_table`."""
        for seq_id, table in self.tables.items():
            computed = max(0, self.tokens[seq_id] - computed_lag)
            c.seq_progress[seq_id] = progress_entry(computed, 0)
            if seq_id in with_table:
                c.seq_states[seq_id] = state_pb2.SequenceState(
                    seq_id=seq_id, status="RUNNING", num_computed_tokens=computed,
                    table=state_pb2.SequenceState.DEVICE, block_table=table, num_hashed_blocks=-1,
                ).SerializeToString()


def state_digest(client: redis.Redis) -> str:
    return hashlib.sha256(repr(redis_state(client)).encode()).hexdigest()[:16]


# The commit's top-level commands: EXEC's time covers the commands it runs (and those the time of the
# commands their scripts call), which commandstats also counts under their own names.
_TOP_LEVEL = ("cmdstat_watch", "cmdstat_get", "cmdstat_multi", "cmdstat_exec", "cmdstat_unwatch", "cmdstat_discard")


def _server_usec(client: redis.Redis) -> int:
    """Microseconds the server spent executing the commits' commands so far."""
    return sum(int(v["usec"]) for k, v in client.info("commandstats").items() if k in _TOP_LEVEL)


async def _run(store: RedisStore, client: redis.Redis, batch: int, steps: int, seed: int) -> dict[str, object]:
    client.flushdb()
    client.set(keys.epoch(WORKER), EPOCH)
    requests = _requests(batch, seed)
    for r in requests:
        await store.admit(r)
    work = _Workload(requests, seed)
    await store.commit(work.prefill())
    commits = [work.decode() for _ in range(steps)]  # built up front: that is the output processor's work
    python, wall = [], []
    usec = _server_usec(client)
    for c in commits:
        c0, w0 = time.process_time(), time.perf_counter()
        await store.commit(c)
        wall.append(time.perf_counter() - w0)
        python.append(time.process_time() - c0)
    server_s = (_server_usec(client) - usec) / steps * 1e-6
    await store.commit(work.decode(finish=True))
    return {"python": python, "wall": wall, "server_s": server_s, "digest": state_digest(client)}


async def measure(url: str, batch_sizes: list[int], steps: int, repeats: int, warmup: int) -> list[dict[str, object]]:
    store = RedisStore.from_url(url)
    client = redis.Redis.from_url(url)
    rows = []
    try:
        for batch in tqdm(batch_sizes, desc="commit", unit="batch size"):
            python: list[float] = []
            wall: list[float] = []
            server: list[float] = []
            digests = set()
            for _ in range(repeats):
                run = await _run(store, client, batch, steps, seed=batch)
                python += run["python"][warmup:]
                wall += run["wall"][warmup:]
                server.append(run["server_s"])
                digests.add(run["digest"])
            if len(digests) != 1:
                raise RuntimeError(f"batch {batch}: the same commits left different states in Redis: {digests}")
            redis_s = [w - p for w, p in zip(wall, python)]
            rows.append({
                "batch": batch, "commits": len(wall),
                "python_ms": statistics.median(python) * 1e3, "redis_ms": statistics.median(redis_s) * 1e3,
                "total_ms": statistics.median(wall) * 1e3, "server_ms": statistics.median(server) * 1e3,
                "state_digest": digests.pop(),
            })
    finally:
        await store.close()
        client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=200, help="decode commits per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch size")
    parser.add_argument("--warmup", type=int, default=5, help="first commits of each run left out of the medians")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from redis.utils import HIREDIS_AVAILABLE  # noqa: PLC0415 - only for the report

    with RedisServer() as server:
        rows = asyncio.run(measure(server.url, args.batch_sizes, args.steps, args.repeats, args.warmup))
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
    result = {
        **run_info(f"Python {platform.python_version()}",
                   f"redis-py {redis.__version__} (hiredis {'yes' if HIREDIS_AVAILABLE else 'no'})",
                   f"redis-server {version} on localhost TCP"),
        "description": (f"RedisStore.commit of steady decode steps of B requests ({PROMPT_LEN}..{PROMPT_LEN + 15}-token "
                        "prompts, one token, one output message per request, new blocks at block boundaries, fenced); "
                        f"medians over {args.repeats} x {args.steps - args.warmup} commits. python: client CPU time; "
                        "redis: wall - python (round trips and server execution); server: the server's own execution "
                        "time per commit (INFO commandstats)."),
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"batch {row['batch']:>3}: python {row['python_ms']:.2f} ms, redis {row['redis_ms']:.2f} ms "
              f"(server {row['server_ms']:.2f}), total {row['total_ms']:.2f} ms, state {row['state_digest']}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
