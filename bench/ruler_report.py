"""The scores and table of `bench/ruler.py`: RULER's own metrics per case, each (task, length) cell's mean per
mode with its points against dense, the modes' times; and the whole run as JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from ruler_cases import TASKS, Case
from ruler_modes import ModeRun


def postprocess_pred(text: str) -> str:
    """RULER eval's `postprocess_pred` (eval/evaluate.py, whose module cannot be imported: it parses its own
    command line and needs pandas): strip, control characters to newlines."""
    import re

    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def sample_scores(cases: list[Case], texts: dict[int, str]) -> dict[int, float]:
    """RULER's per-sample score (0-100) of each finished case."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    done = [c for c in cases if c.id in texts]
    return {
        c.id: METRICS[c.metric]["metric_fn_per_sample"]([postprocess_pred(texts[c.id])], [c.outputs])[0] for c in done
    }


def print_table(cases: list[Case], modes: list[str], runs: dict[str, ModeRun], num_samples: int) -> None:
    scores = {m: sample_scores(cases, runs[m].texts) for m in modes}
    others = [m for m in modes if m != "dense"] if "dense" in modes else []
    w = max(11, *(len(m) + 1 for m in modes))
    print(f"{'task':<14} {'length':>6} {'tokens':>6}" + "".join(f"{m:>{w}}" for m in modes), end="")
    print("  |" + "".join(f"{'Δ ' + m:>{w + 2}}" for m in others))
    cells = sorted({(c.task, c.length) for c in cases}, key=lambda x: (list(TASKS).index(x[0]), x[1]))
    groups = [(f"{t:<14} {n:>6}", [c for c in cases if (c.task, c.length) == (t, n)]) for t, n in cells]
    for label, mine in [*groups, (f"{'mean':<21}", cases)]:
        tokens = round(sum(len(c.prompt_token_ids) for c in mine) / len(mine))
        row = f"{label} {tokens:>6}"
        for m in modes:
            got = [scores[m][c.id] for c in mine if c.id in scores[m]]
            if not got:
                row += f"{'-':>{w}}"
                continue
            ran = [runs[m].applied[c.id] for c in mine if c.id in scores[m]]
            mark = "~" if all(r is False for r in ran) else ""
            short = f"[{len(got)}]" if len(got) < len(mine) else ""
            row += f"{f'{sum(got) / len(got):.1f}{mark}{short}':>{w}}"
        row += "  |"
        for m in others:
            both = [c.id for c in mine if c.id in scores[m] and c.id in scores["dense"]]
            delta = sum(scores[m][i] - scores["dense"][i] for i in both) / len(both) if both else None
            row += f"{'-' if delta is None else f'{delta:+.1f}':>{w + 2}}"
        print(row)
    print(f"{'time (min)':<28}" + "".join(f"{runs[m].wall_s / 60:>{w}.1f}" for m in modes))
    loads = ["-" if runs[m].load_s is None else f"{runs[m].load_s:.0f}" for m in modes]
    print(f"{'load (s)':<28}" + "".join(f"{x:>{w}}" for x in loads))
    per_case = [f"{sum(r.seconds.values()) / len(r.seconds):.1f}" if r.seconds else "-" for r in map(runs.get, modes)]
    print(f"{'s per case':<28}" + "".join(f"{x:>{w}}" for x in per_case))
    print(f"{'cases done':<28}" + "".join(f"{f'{len(runs[m].texts)}/{len(cases)}':>{w}}" for m in modes))
    for m in modes:
        if runs[m].stopped:
            print(f"{m}: {runs[m].stopped}")
    print(f"(score: RULER string match, 0-100, mean over up to {num_samples} samples; [n]: samples the mode finished;")
    print(" ~: the mode's sparse or compressed path ran on none of the cell's cases; Δ: points vs dense, same cases)")


def write_json(path: Path, args: argparse.Namespace, job: dict, cases: list[Case], runs: dict[str, ModeRun]) -> None:
    """The run's settings and every case with each mode's output, score and whether its path ran."""
    scores = {m: sample_scores(cases, runs[m].texts) for m in runs}
    rows = []
    for c in cases:
        row = {k: v for k, v in asdict(c).items() if k != "prompt_token_ids"}
        row["prompt_tokens"] = len(c.prompt_token_ids)
        row["modes"] = {
            m: {
                "text": r.texts.get(c.id),
                "score": scores[m].get(c.id),
                "applied": r.applied.get(c.id),
                "seconds": r.seconds.get(c.id),
            }
            for m, r in runs.items()
        }
        rows.append(row)
    path.write_text(json.dumps({"args": vars(args), "job": {**job, "cases": None}, "cases": rows}, indent=1))
