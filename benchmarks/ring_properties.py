"""Properties of the consistent-hash ring (`prefix_router.routing.ring.HashRing`) we sell:

- keys moved when a backend joins or leaves, against the optimum (1/(N+1) of the keys, all onto the
  newcomer; exactly the leaver's keys), for N = 4, 16, 64;
- balance: the largest backend's share of the key space over the mean share, against vnodes per
  backend (10, 40, 160, 640) — computed exactly from the arcs of the ring, not sampled;
- lookup cost (`primary`) and build cost against fleet size.

Keys are uniform 64-bit hashes (what `RoutingKey.ring_hash` is), from a seeded generator.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BackgroundMeter, markdown_table, package_version, print_header, report_results
from prefix_router.routing.hashing import vnode_hash
from prefix_router.routing.ring import HashRing, Member

SPACE = 1 << 64


def urls(n: int, start: int = 0) -> list[str]:
    return [f"http://10.0.{i // 256}.{i % 256}:8000" for i in range(start, start + n)]


def ring_of(ids: list[str], vnodes: int) -> HashRing:
    return HashRing([Member(u) for u in ids], vnodes)


def exact_shares(ids: list[str], vnodes: int) -> dict[str, float]:
    """Each backend's share of the 64-bit key space, from the ring's own point definition.

    A key goes to the first point at or after it (bisect_left), so the arc (p[i-1], p[i]] belongs to
    p[i]'s owner, and the arc past the last point wraps to the first. Cross-checked against
    `HashRing.primary` on sampled keys in `check_shares`.
    """
    points = sorted((vnode_hash(u, i), u) for u in ids for i in range(vnodes))
    share: dict[str, int] = dict.fromkeys(ids, 0)
    prev = points[-1][0] - SPACE
    for p, owner in points:
        share[owner] += p - prev
        prev = p
    return {u: s / SPACE for u, s in share.items()}


def check_shares(ids: list[str], vnodes: int, keys: list[int]) -> float:
    """Largest gap between the exact shares and the shares of sampled keys via `primary`."""
    ring = ring_of(ids, vnodes)
    counts = Counter(ring.primary(k) for k in keys)
    exact = exact_shares(ids, vnodes)
    return max(abs(counts[u] / len(keys) - exact[u]) for u in ids)


def movement(n: int, vnodes: int, keys: list[int], trials: int, rng: random.Random) -> dict[str, Any]:
    base_ids = urls(n)
    base = ring_of(base_ids, vnodes)
    before = [base.primary(k) for k in keys]
    add_moved, add_wrong, rem_moved, rem_extra = [], [], [], []
    for t in range(trials):
        newcomer = urls(1, start=1000 + t)[0]
        grown = ring_of([*base_ids, newcomer], vnodes)
        after = [grown.primary(k) for k in keys]
        moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        add_moved.append(len(moved) / len(keys))
        add_wrong.append(sum(1 for _, b in moved if b != newcomer) / len(keys))

        leaver = rng.choice(base_ids)
        shrunk = ring_of([u for u in base_ids if u != leaver], vnodes)
        after = [shrunk.primary(k) for k in keys]
        moved_r = [a for a, b in zip(before, after, strict=True) if a != b]
        rem_moved.append(len(moved_r) / len(keys))
        # Keys that moved although they were not the leaver's: must be zero.
        rem_extra.append(sum(1 for a in moved_r if a != leaver) / len(keys))
    return {
        "n": n,
        "add_moved": statistics.mean(add_moved),
        "add_optimum": 1 / (n + 1),
        "add_not_to_newcomer": max(add_wrong),
        "remove_moved": statistics.mean(rem_moved),
        "remove_optimum": 1 / n,
        "remove_not_from_leaver": max(rem_extra),
    }


def timed(fn: Any, number: int, repeats: int) -> float:
    """Best seconds per call over `repeats` runs of `number` calls (the machine may be shared)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return min(samples)


def lookup_ns(ring: HashRing, keys: list[int], repeats: int) -> float:
    primary = ring.primary
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k in keys:
            primary(k)
        samples.append((time.perf_counter() - t0) / len(keys))
    return min(samples) * 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=200_000, help="sampled keys (default 200000)")
    p.add_argument("--trials", type=int, default=5, help="joins/leaves averaged per N (default 5)")
    p.add_argument("--sizes", default="4,16,64", help="N for movement and balance (default %(default)s)")
    p.add_argument("--vnodes-list", default="10,40,160,640", help="vnodes for balance (default %(default)s)")
    p.add_argument(
        "--fleets", default="4,32,256,1000,4000", help="fleet sizes for costs (default %(default)s)"
    )
    p.add_argument("--vnodes", type=int, default=160, help="vnodes for movement and costs (default 160)")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats, best kept (default 5)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="40000 keys, 2 trials, 3 repeats")
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/*.json")
    args = p.parse_args()
    if args.quick:
        args.keys, args.trials, args.repeats = 40_000, 2, 3

    versions = {
        "python": sys.version.split()[0],
        "prefix-router": package_version("prefix-router"),
        "xxhash": package_version("xxhash"),
    }
    meta = print_header("hash ring properties", versions)
    rng = random.Random(args.seed)
    keys = [rng.getrandbits(64) for _ in range(args.keys)]
    sizes = [int(x) for x in args.sizes.split(",") if x]
    vnodes_list = [int(x) for x in args.vnodes_list.split(",") if x]
    fleets = [int(x) for x in args.fleets.split(",") if x]
    print(f"- {args.keys:,} sampled keys, {args.trials} trials per N, {args.vnodes} vnodes unless stated\n")

    # -- movement ------------------------------------------------------------------------------
    moves = [movement(n, args.vnodes, keys, args.trials, rng) for n in sizes]
    rows = [
        [
            m["n"],
            f"{m['add_moved']:.2%}",
            f"{m['add_optimum']:.2%}",
            f"{m['add_moved'] / m['add_optimum']:.2f}",
            f"{m['add_not_to_newcomer']:.3%}",
            f"{m['remove_moved']:.2%}",
            f"{m['remove_optimum']:.2%}",
            f"{m['remove_moved'] / m['remove_optimum']:.2f}",
            f"{m['remove_not_from_leaver']:.3%}",
        ]
        for m in moves
    ]
    print("keys moved by one join / one leave (mean of trials; optimum = 1/(N+1) and 1/N):\n")
    print(
        markdown_table(
            [
                "N",
                "join: moved",
                "optimum",
                "ratio",
                "moved elsewhere",
                "leave: moved",
                "optimum",
                "ratio",
                "moved not from leaver",
            ],
            rows,
        )
    )

    # -- balance -------------------------------------------------------------------------------
    balance: list[dict[str, Any]] = []
    brows = []
    for n in sizes:
        ids = urls(n)
        row: list[Any] = [n]
        for v in vnodes_list:
            shares = list(exact_shares(ids, v).values())
            mean = 1 / n
            entry = {
                "n": n,
                "vnodes": v,
                "max_over_mean": max(shares) / mean,
                "min_over_mean": min(shares) / mean,
                "cv": statistics.pstdev(shares) / mean,
            }
            balance.append(entry)
            row.append(f"{entry['max_over_mean']:.3f} (cv {entry['cv']:.1%})")
        brows.append(row)
    gap = check_shares(urls(sizes[0]), vnodes_list[0], keys)
    print("\nbalance: largest share / mean share (coefficient of variation), exact from the ring's arcs:\n")
    print(markdown_table(["N", *[f"{v} vnodes" for v in vnodes_list]], brows))
    print(
        f"\n(check: exact shares vs {args.keys:,} keys through `primary` at N={sizes[0]}, "
        f"{vnodes_list[0]} vnodes: largest gap {gap:.2%})"
    )

    # -- costs (timed: the best of --repeats, and the background load is reported) -------------
    meter = BackgroundMeter()
    # -- costs ---------------------------------------------------------------------------------
    lookup_keys = keys[: min(len(keys), 100_000)]
    costs: list[dict[str, Any]] = []
    crows = []
    for n in fleets:
        ids = urls(n)
        build_number = max(1, int(2000 / n))
        build_repeats = args.repeats if n < 1000 else min(args.repeats, 3)
        build_s = timed(lambda ids=ids: ring_of(ids, args.vnodes), build_number, build_repeats)
        ring = ring_of(ids, args.vnodes)
        ns = lookup_ns(ring, lookup_keys, args.repeats)
        walk = ring.walk
        walk2_ns = timed(
            lambda walk=walk: [b for _, b in zip(range(2), walk(keys[0]), strict=False)], 20_000, args.repeats
        )
        costs.append(
            {
                "fleet": n,
                "points": n * args.vnodes,
                "lookup_ns": ns,
                "walk2_ns": walk2_ns * 1e9,
                "build_ms": build_s * 1e3,
            }
        )
        crows.append(
            [n, f"{n * args.vnodes:,}", f"{ns:.0f}", f"{walk2_ns * 1e9:.0f}", f"{build_s * 1e3:.2f}"]
        )
    meter.stop()
    print(
        f"\nlookup and build cost by fleet size ({args.vnodes} vnodes; best of {args.repeats}; "
        f"{meter.note()}):\n"
    )
    print(markdown_table(["backends", "points", "primary, ns", "first 2 of walk, ns", "build, ms"], crows))

    payload = {
        **meta,
        "movement": moves,
        "balance": balance,
        "costs": costs,
        "share_check_gap": gap,
        "background_cpus": meter.cpus,
    }
    report_results("ring_properties", payload, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
