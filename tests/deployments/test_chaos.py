"""A minute of the chaos soak (`bench/chaos.py`, a fixed seed): two replicas and the cluster tier under a multi-turn
load while replicas, the PrefixIndex, the tier store and the MetricsHub are killed, the catalog is frozen and clients
vanish, sometimes two faults at once. Every request completes with its reference answer or fails cleanly, every
fault heals, no page stays held, the index names only blocks its replicas hold, and /health and /metrics answer
throughout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a served app with the tier, for two minutes

BENCH = Path(__file__).resolve().parents[2] / "bench"
KINDS = {"replica", "index", "store", "hub", "catalog", "client"}


def test_a_minute_of_chaos_loses_no_request_page_or_index_entry(tmp_path, free_port):
    path = tmp_path / "chaos.json"
    soak = ["--duration", "60", "--seed", "1", "--fault-every", "8", "--clients", "4", "--conversations", "4",
            "--turns", "3", "--max-tokens", "16", "--port", str(free_port()), "--json", str(path)]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "chaos.py", *soak], cwd=BENCH, capture_output=True, text=True, timeout=900, check=False
    )
    assert path.exists(), run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(path.read_text())
    faults = report["faults"]
    assert {f["kind"] for f in faults} == KINDS
    assert len({f["event"] for f in faults}) < len(faults)  # two at once, at least once
    requests = report["requests"]
    assert requests.get("ok", 0) >= 40 and requests.get("abandoned", 0) >= 1
    assert not {"mismatch", "refused", "cut", "hung"} & set(requests), report["problems"]
    assert [f for f in faults if f["heal_s"] is None] == []
    assert report["health_failures"] == []
    end = report["end"]
    assert end["replicas_back"] and not any(end["pages_held"].values())
    assert not any(end["index_blocks_not_held"].values()) and end["index_unknown_replicas"] == []
    assert sum(end["cached_blocks"].values()) > 0  # the index check compared something
    assert run.returncode == 0 and report["broken"] == []
