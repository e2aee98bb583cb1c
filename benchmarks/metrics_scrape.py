"""What a scrape of the router's /metrics costs against fleet size: samples exported (every labelled
series at 0 from the moment a backend joins) and the time to render them, which the main port's event
loop spends on every scrape. No traffic: the series are all there from the start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prometheus_client
from prometheus_client import generate_latest

from _common import markdown_table, package_version, print_header, report_results
from prefix_router.router import create_app
from prefix_router.settings import load_settings


def measure(backends: int, repeats: int) -> dict[str, Any]:
    urls = [f"http://10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(backends)]
    settings = load_settings(None, {"backends": [{"url": u} for u in urls]}, environ=False)
    app = create_app(settings)
    body = generate_latest(app.registry)
    samples = [line for line in body.decode().splitlines() if line and not line.startswith("#")]
    per_backend = sum(1 for line in samples if 'backend="http://10.0.' in line) / backends
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        generate_latest(app.registry)
        times.append(time.perf_counter() - started)
    return {
        "backends": backends,
        "samples": len(samples),
        "samples_per_backend": per_backend,
        "bytes": len(body),
        "render_ms_median": statistics.median(times) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    # As `prefix-router serve` does: no `_created` series.
    prometheus_client.disable_created_metrics()
    meta = print_header("/metrics scrape cost", {"prometheus_client": package_version("prometheus_client")})
    rows = [measure(n, args.repeats) for n in args.backends]
    print(
        markdown_table(
            ["backends", "samples", "samples per backend", "bytes", "render ms (median)"],
            [
                (
                    r["backends"],
                    r["samples"],
                    f"{r['samples_per_backend']:.0f}",
                    r["bytes"],
                    f"{r['render_ms_median']:.1f}",
                )
                for r in rows
            ],
        )
    )
    report_results("metrics_scrape", {**meta, "rows": rows}, save=not args.no_write)


if __name__ == "__main__":
    main()
