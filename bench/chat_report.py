"""The tables of `bench/serve_multiturn.py`: each system's measures on one workload side by side, then the ratios
of rayapp's served engine to its offline run and of every other system to each anchor.
"""

from __future__ import annotations

from collections.abc import Callable

from chat_load import EngineWork, LoadSummary
from chat_servers import ANCHOR_ROUTERS
from chat_workloads import Workload


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


# The rows of rayapp's engine counters: label, cell(engine work, wall s).
ENGINE_ROWS: list[tuple[str, Callable[[EngineWork, float], str]]] = [
    ("engine steps", lambda e, _: f"{e.steps}"),
    ("step ms (mean)", lambda e, _: f"{1000 * e.step_s / e.steps:.1f}"),
    ("tokens per step", lambda e, _: f"{e.computed_tokens / e.steps:.1f}"),
    ("steps' share of wall", lambda e, wall_s: f"{e.step_s / wall_s:.0%}"),
    ("step thread CPU share", lambda e, _: f"{e.step_cpu_s / e.step_s:.0%}"),
]


def _engine_cell(summary: LoadSummary, cell: Callable[[EngineWork, float], str]) -> str:
    """n/a for a server that does not report rayapp's engine counters."""
    if summary.engine is None or summary.engine.steps == 0:
        return "n/a"
    return cell(summary.engine, summary.wall_s)


def _content(workload: Workload) -> str:
    if workload.source == "sharegpt":
        return f"ShareGPT histories of at most {workload.prompt_budget} tokens"
    if workload.source == "documents":
        return f"~{workload.context_tokens}-token documents (RULER's haystack with facts), {workload.users} users each"
    return f"~{workload.context_tokens}-token documents, ~300-token shared system prompt"


def print_table(summaries: dict[str, LoadSummary], workload: Workload) -> None:
    """`workload`'s table, a column per system (in the order of `summaries`), and the ratios under it."""
    print(
        f"\nworkload {workload.name}: {workload.replicas} replica(s), {workload.conversations} conversations x "
        f"{workload.turns} turns, max_tokens {workload.max_tokens}, {_content(workload)}, streaming, temperature 0"
    )
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(s.requests) for s in summaries.values()]),
        ("wall time (s)", [f"{s.wall_s:.1f}" for s in summaries.values()]),
        ("output tokens/s", [f"{s.output_tokens_per_s:.1f}" for s in summaries.values()]),
        ("TTFT p50 (ms)", [f"{s.ttft_p50_s * 1000:.0f}" for s in summaries.values()]),
        ("TTFT p90 (ms)", [f"{s.ttft_p90_s * 1000:.0f}" for s in summaries.values()]),
        ("ITL p50 (ms)", [f"{s.itl_p50_s * 1000:.1f}" for s in summaries.values()]),
        ("cached prompt share", [_share(s.cached_share) for s in summaries.values()]),
        ("delivered hit share", [_share(s.hit_share) for s in summaries.values()]),
    ]
    if any(s.correct_share is not None for s in summaries.values()):
        rows.append(("answers with the fact", [_share(s.correct_share) for s in summaries.values()]))
    if any(s.engine is not None for s in summaries.values()):
        rows += [(label, [_engine_cell(s, cell) for s in summaries.values()]) for label, cell in ENGINE_ROWS]
    print(f"{'':<22}" + "".join(f"{n:>14}" for n in summaries))
    for label, cells in rows:
        print(f"{label:<22}" + "".join(f"{c:>14}" for c in cells))
    if "rayapp" in summaries and "rayapp-offline" in summaries:
        served, offline = summaries["rayapp"], summaries["rayapp-offline"]
        print(
            "rayapp served / offline: output tokens/s "
            f"{served.output_tokens_per_s / offline.output_tokens_per_s:.2f}x, "
            f"ITL p50 {served.itl_p50_s / offline.itl_p50_s:.2f}x"
        )
    for base, name in ((a, n) for a in ANCHOR_ROUTERS if a in summaries for n in summaries if n not in ANCHOR_ROUTERS):
        ours, anchor = summaries[name], summaries[base]
        print(
            f"{name} / {base}: output tokens/s {ours.output_tokens_per_s / anchor.output_tokens_per_s:.2f}x "
            f"(higher is better), ITL p50 {ours.itl_p50_s / anchor.itl_p50_s:.2f}x and "
            f"TTFT p50 {ours.ttft_p50_s / anchor.ttft_p50_s:.2f}x (lower is better)"
        )
