"""Writes docs/scaling.md and its plots from the fleet benchmarks' results (`make bench-fleet`).

    python -m benchmarks.report_fleet [--results benchmarks/results] [--docs docs]

Reads fleet.json (synchronous engine loops), fleet-async.json (--async-scheduling) and every
fleet_failover*.json; a missing file leaves its section out. Plots need matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.fleet_failover import percentiles

# Issue 18's target: one replica drives this many simulated workers at this share of their modelled rate.
TARGET_WORKERS = 16
TARGET_SHARE = 0.9
TARGET_ADDED_MS = 2.0

_MODES = (("fleet.json", "sync"), ("fleet-async.json", "async"), ("fleet-front.json", "sync"),
          ("fleet-front-async.json", "async"), ("fleet-light.json", "sync"), ("fleet-wide.json", "sync"))


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _cores(r: dict[str, Any], per_step_ms: float) -> float:
    """Cores a role kept busy: its CPU per step times the fleet's steps per second."""
    return per_step_ms * r["steps_per_s_per_worker"] * r["workers"] / 1000


def engine_ms(r: dict[str, Any]) -> float:
    """CPU per step of the replicas that drive the workers (all of them when no replica is front-only)."""
    return r.get("engine_cpu_ms_per_step", r["scheduler_cpu_ms_per_step"])


def tokens_per_step(r: dict[str, Any]) -> float:
    return r["tokens_per_s"] / (r["steps_per_s_per_worker"] * r["workers"])


def ceiling(r: dict[str, Any]) -> tuple[float, float]:
    """(steps/s one replica drives with a core to itself, workers it keeps at TARGET_SHARE of their rate)."""
    steps = 1000 / engine_ms(r)
    return steps, steps / (TARGET_SHARE * 1000 / r["modelled_ms_per_step"])


def _replicas(r: dict[str, Any]) -> str:
    front = r.get("front_replicas", 0)
    return f"{r['replicas']} + {front} front-only" if front else str(r["replicas"])


def _table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    rows = ["| loop | replicas | workers | streams | steps/s per worker | tokens/step | share of modelled rate "
            "| added ms/step | scheduler CPU ms/step | scheduler CPU us/token | cores busy: schedulers / workers / "
            "client | Redis cmds/step | cmds/token | bytes/token |",
            "|---|" + "---:|" * 13]
    for mode, r in runs:
        rows.append(
            f"| {mode} | {_replicas(r)} | {r['workers']} | {r['streams']} | {r['steps_per_s_per_worker']:.1f} "
            f"| {tokens_per_step(r):.1f} | {r['busy_fraction']:.0%} | {r['added_ms_per_step']:.1f} | {r['scheduler_cpu_ms_per_step']:.2f}"
            f"{f' ({engine_ms(r):.2f} driving)' if r.get('front_replicas') else ''} "
            f"| {1000 * r['scheduler_cpu_ms_per_step'] / tokens_per_step(r):.0f} "
            f"| {_cores(r, r['scheduler_cpu_ms_per_step']):.2f} / {_cores(r, r['worker_cpu_ms_per_step']):.2f} / "
            f"{_cores(r, r['client_cpu_ms_per_step']):.2f} | {r['redis_commands_per_step']:.0f} "
            f"| {r['redis_commands_per_token']:.2f} | {r['redis_bytes_per_token']:.0f} |")
    return rows


def failover_section(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Failover at scale", "",
        "`benchmarks/fleet_failover.py`: one replica holds the leases of every simulated worker and serves every "
        "client; a standby replica joins once the load runs, and the first replica is SIGKILLed. The clients' "
        "streams break and re-attach to the standby through llmserve's own client (Resume from the next index). "
        "Times in seconds after the kill (min / median / p90 / max):", "",
        "| workers | streams | lease TTL | leases held by the killed replica | lease moved | of which after "
        "it expired | stream pause | all streams resumed | requests finished | with the predicted tokens | lost "
        "| tokens recomputed |",
        "|" + "---:|" * 12,
    ]
    for run in runs:
        r = run["result"]
        lines.append(
            f"| {r['workers']} | {r['streams']} | {r['lease_ttl_s']:g} s | {r['leases_held_at_kill']} "
            f"| {percentiles(r['lease_moved_s'])} | {percentiles(r['after_expiry_s'])} | {percentiles(r['stream_pause_s'])} "
            f"| {r['all_resumed_s']:.2f} | {r['requests_finished']} | {r['requests_matching']} "
            f"| {r['requests_lost']} | {r['recomputed_tokens']} |")
    results = [run["result"] for run in runs]
    exact = all(r["requests_matching"] == r["requests_finished"] and not r["requests_lost"] for r in results)
    recomputed = sum(r["recomputed_tokens"] for r in results)
    lines += [
        "", "A dead replica is noticed only when its leases expire: the lease TTL (`--lease-ttl`, 10 s by default) "
        "bounds the pause, less the time since the last renewal. What the standby adds after the expiry (taking "
        "the lease, reading the stored state, fencing the worker and landing its kept steps) is the \"after it "
        "expired\" column. "
        + ("Every request ended with exactly the tokens the simulated workers' rule predicts, none lost; "
           if exact else "NOT every request ended with the predicted tokens: see the table; ")
        + ("every sequence continued on its worker's KV cache (no token recomputed)." if recomputed == 0 else
           f"{recomputed} token(s) were recomputed by the workers (a sequence that could not continue on its "
           "KV cache)."),
    ]
    return lines


def _fleet_size(r: dict[str, Any]) -> str:
    return f"{r['workers']}/{r['replicas']}"


def redis_section(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Whether Redis commands per step and per token grew with the fleet at a fixed load per worker, from the
    runs themselves: for each load (streams per worker) and loop, over the fleet sizes whose steps were full."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for mode, r in runs:
        if not r.get("front_replicas"):
            groups.setdefault((r["streams"] // r["workers"], mode), []).append(r)
    lines = []
    for (load, mode), group in sorted(groups.items()):
        full = sorted((r for r in group if tokens_per_step(r) >= 0.9 * load),
                      key=lambda r: (r["replicas"], r["workers"]))
        if len(full) < 2:
            continue
        per_step = [r["redis_commands_per_step"] for r in full]
        per_token = [r["redis_commands_per_token"] for r in full]
        flat = max(per_step) / min(per_step) < 1.3 and max(per_token) / min(per_token) < 1.3
        lines.append(
            f"- {load} streams per worker ({mode}), workers / replicas {', '.join(map(_fleet_size, full))}: "
            f"{min(per_step):.1f} to {max(per_step):.1f} commands per step, {min(per_token):.2f} to "
            f"{max(per_token):.2f} per generated token: " + ("flat (within 30 %)." if flat else
                                                           "NOT flat (more than 30 % apart)."))
    head = ("Redis commands per step and per generated token at a fixed load per worker, over the fleet sizes "
            "where one replica kept every step full (a run whose steps carried fewer sequences than its "
            "streams measures a replica that could not keep up, not the load):")
    tail = ("Each engine loop commits its step in one transaction (one script call for all its sequences' new "
            "tokens and output messages, one write per changed state hash), and each replica reads all its "
            "clients' output streams with one XREAD: nothing grows with the number of workers or replicas.")
    return "\n".join([head, "", *(lines or ["- no load had two fleet sizes with full steps"]), "", tail])


def _load_of(r: dict[str, Any]) -> int:
    return r["streams"] // r["workers"]


def limit_section(runs: list[tuple[str, dict[str, Any]]], cpus: int, load: int) -> list[str]:
    """The limit at the benchmark's load per worker (`load` streams); lighter loads show the per-step floor."""
    ones = [r for _, r in runs if r["replicas"] == 1]
    one = [r for r in ones if _load_of(r) == load]
    serving = [r for r in one if not r.get("front_replicas")]
    if not serving:
        return []
    both = min(_full_steps(serving), key=engine_ms)
    per_replica = [_cores(r, r["scheduler_cpu_ms_per_step"]) for r in serving]
    tokens = [r["tokens_per_s"] for r in serving]
    modelled = 1000 / both["modelled_ms_per_step"]
    lines = [
        "## Where it saturates", "",
        f"Every process of these runs shares this machine's {cpus} cores: the replicas, the simulated workers, "
        "Redis and the client. With one replica, that replica's process kept "
        f"{min(per_replica):.2f} to {max(per_replica):.2f} of a core busy whatever the fleet, the fleet generated "
        f"{min(tokens):.0f} to {max(tokens):.0f} tokens/s whether it had 1 or {max(r['workers'] for r in serving)} "
        "workers, and each worker's share of its modelled rate fell as workers were added: the limit is the "
        "replica's one core. A replica runs its engine loops and its clients' streams on one asyncio thread (the "
        "GIL would serialize threads anyway), so what it can drive is one core divided by its CPU per step, "
        "whatever the machine.", "",
        _ceiling_line(both, "A replica that serves its clients and drives their workers") + ".",
    ]
    split = [r for r in one if r.get("front_replicas")]
    if split:
        driving = min(_full_steps(split), key=engine_ms)
        lines += ["", _ceiling_line(driving, "With the clients on a front-only replica, the replica that drives the "
                                             "workers") + f" (the front-only replica spent "
                  f"{driving['scheduler_cpu_ms_per_step'] - engine_ms(driving):.1f} ms per step on the streams)."]
        best = driving if engine_ms(driving) < engine_ms(both) else both
    else:
        best = both
    needed = 1000 / (TARGET_WORKERS * TARGET_SHARE * modelled)
    lines += ["", f"The target of {TARGET_WORKERS} such workers at {TARGET_SHARE:.0%} from one replica needs "
                  f"{needed:.2f} ms of the replica's CPU per step: {engine_ms(best) / needed:.0f}x less than the "
                  "best measured, NOT met. A fleet that size needs that many replicas' worth of cores: each replica "
                  "drives the workers whose leases it holds, and replicas share the leases evenly."]
    light = _full_steps([r for r in ones if _load_of(r) < load and not r.get("front_replicas")])
    if light:
        floor = min(light, key=engine_ms)
        lines += ["", f"At {_load_of(floor)} streams per worker a step of {tokens_per_step(floor):.0f} tokens still "
                      f"cost the replica {engine_ms(floor):.1f} ms: the part of a step that does not depend on its "
                      "sequences (scheduling, the plan, the worker call, the commit's round trips to Redis) caps one "
                      f"replica near {1000 / engine_ms(floor):.0f} steps/s however small the steps."]
    return lines


def _full_steps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs whose steps carried (nearly) every stream of their worker; all of them if none did. A step of
    fewer tokens costs less, so only full steps say what a worker with its load costs."""
    full = [r for r in runs if tokens_per_step(r) >= 0.9 * r["streams"] / r["workers"]]
    return full or runs


def _ceiling_line(r: dict[str, Any], who: str) -> str:
    steps, workers = ceiling(r)
    return (f"{who} spent {engine_ms(r):.1f} ms of CPU per step of {tokens_per_step(r):.0f} tokens "
            f"({r['workers']} worker{'s' if r['workers'] > 1 else ''}): with a core to itself it drives about "
            f"{steps:.0f} steps/s. A simulated H100 running Llama-3-8B takes {r['modelled_ms_per_step']:.1f} ms per "
            f"step here ({1000 / r['modelled_ms_per_step']:.0f} steps/s), so such a replica keeps about "
            f"{workers:.1f} of them at {TARGET_SHARE:.0%} of their rate")


def plots(runs: list[tuple[str, dict[str, Any]]], failovers: list[dict[str, Any]], docs: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    series: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for mode, r in runs:
        series.setdefault((mode, _replicas(r), r["streams"] // r["workers"]), []).append(r)
    for (mode, replicas, load), rows in sorted(series.items()):
        rows.sort(key=lambda r: r["workers"])
        x = [r["workers"] for r in rows]
        label = f"{replicas} repl., {mode}, {load}/worker"
        axes[0].plot(x, [100 * r["busy_fraction"] for r in rows], marker="o", label=label)
        axes[1].plot(x, [r["scheduler_cpu_ms_per_step"] for r in rows], marker="o", label=label)
        axes[2].plot(x, [r["redis_commands_per_token"] for r in rows], marker="o", label=label)
    axes[0].axhline(100 * TARGET_SHARE, color="gray", linestyle="--", label="target")
    for ax, title in zip(axes, ("share of the modelled step rate (%)", "scheduler CPU per step (ms)",
                                "Redis commands per generated token")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated workers")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    path = docs / "scaling-fleet.png"
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path.name)
    if failovers:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in failovers:
            r = run["result"]
            for key, what in (("lease_moved_s", "lease moved"), ("stream_pause_s", "stream pause")):
                values = sorted(r[key])
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                        label=f"{what}, TTL {r['lease_ttl_s']:g} s")
        ax.set_xlabel("seconds after the kill")
        ax.set_ylabel("fraction of workers / streams")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = docs / "scaling-failover.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path.name)
    return written


def render(results: Path, docs: Path) -> str:
    runs: list[tuple[str, dict[str, Any]]] = []
    meta: dict[str, Any] = {}
    for name, mode in _MODES:
        data = _load(results / name)
        if data is not None:
            meta = meta if "date" in meta else data
            runs += [(mode, r) for r in data["results"]]
    failovers = [d for p in sorted(results.glob("fleet_failover*.json")) if (d := _load(p)) is not None]
    lines = ["# The control plane at fleet scale", ""]
    if meta:
        load = meta["load"]
        lines += [
            f"Run of {meta.get('date', 'an earlier date')} on a {meta['cpus']}-core {meta['machine']} machine "
            "(`make bench-fleet`: benchmarks/fleet.py, benchmarks/fleet_failover.py, this page by "
            "benchmarks/report_fleet.py). Scheduler replicas drive simulated workers (`llmserve worker --simulate "
            f"{runs[0][1]['profile']}`: the real worker service with its forward pass replaced by the profile's "
            "modelled step time, see worker_service/profiles/). Each worker gets "
            f"{load['streams_per_worker']} greedy streams of {load['prompt_len']} prompt and {load['max_tokens']} "
            f"output tokens, kept in flight through gRPC Generate; {load['window_s']:g} s measured after "
            f"{load['warmup_s']:g} s of warm-up.", "",
            "- share of modelled rate: the time each worker spent executing steps (its modelled step time), over "
            "the window: 100 % is a worker never kept waiting by the control plane;",
            "- added ms/step: the wall time per step outside the worker's execution;",
            "- cores busy: each role's CPU per step times the fleet's steps per second (the rest of the cores: Redis "
            "and idle).", "",
            *_table(runs), "",
            *limit_section(runs, meta["cpus"], load["streams_per_worker"]), "",
            "What lowered a replica's CPU per step so far, each with its same-machine A/B (hiredis's reply parser "
            "and command packer, the front-only role), is in docs/benchmarks-history.md.", "",
            redis_section(runs), "",
        ]
    if failovers:
        lines += [*failover_section(failovers), ""]
    lines += [f"![{Path(p).stem}]({p})" for p in plots(runs, failovers, docs)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    page = args.docs / "scaling.md"
    page.write_text(render(args.results, args.docs))
    print(f"wrote {page}")


if __name__ == "__main__":
    main()
