"""One bench script of two commits of rayapp, in one run: is the later one slower?

Each commit's tree (a `git worktree` of BEFORE in a temp dir; AFTER is the working tree unless given) runs its own
`bench/<script>` with its own `rayapp` package first on PYTHONPATH (so `serve run`'s Ray workers import it too),
from its own root (so a script that serves `rayapp.config.yaml` serves that commit's), alternately `--rounds` times:
before, after, before, after. Every output line that both commits print with the same words is shown once, each
number in it as `before -> after (xratio)`, the medians over the rounds; lines with no number are left out.

    python bench/compare_commits.py 7c79014 -- engine_throughput.py
    python bench/compare_commits.py 7c79014 --rounds 1 -- serve_multiturn.py --workloads 1x --systems rayapp

A ratio names after/before: above 1 is more of the number (faster for tok/s, slower for seconds).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A number as a bench prints it: 12, -0.5, 1.5e-3, 2,048 (thousands separated), with an optional x or % beside it;
# not the digits of a word (bfloat16, AVX512-BF16).
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# A progress bar (tqdm's `| 148/272 [00:00<00:00, 1479.63it/s]`): not a result.
_PROGRESS = re.compile(r"\| *\d+/\d+ \[")


def _template(line: str) -> tuple[str, list[float]]:
    """The line's words with each number replaced by {} and runs of spaces by one (table columns are as wide as
    their numbers), and the numbers."""
    line = " ".join(line.split())
    values = [float(m.group().replace(",", "")) for m in _NUMBER.finditer(line)]
    return _NUMBER.sub("{}", line), values


def _numbers_by_line(output: str) -> dict[tuple[str, int], list[float]]:
    """{(template, occurrence): numbers} of every line holding a number; occurrence tells repeated templates apart."""
    seen: dict[str, int] = defaultdict(int)
    found = {}
    for line in output.splitlines():
        if _PROGRESS.search(line):
            continue
        template, values = _template(line)
        if values:
            found[(template, seen[template])] = values
            seen[template] += 1
    return found


def _run(tree: Path, script: list[str], label: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    print(f"--- {label}: {tree} ---", flush=True)
    proc = subprocess.run(
        [sys.executable, str(tree / "bench" / script[0]), *script[1:]],
        cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        sys.exit(f"{label}: {script[0]} exited with {proc.returncode}")
    return proc.stdout


def _describe(before: list[float], after: list[float]) -> list[str]:
    return [f"{b:g} -> {a:g} (x{a / b:.3f})" if b else f"{b:g} -> {a:g}" for b, a in zip(before, after, strict=True)]


def compare(outputs: dict[str, list[str]]) -> list[str]:
    """The lines both commits print, each number as before -> after (xratio), medians over the rounds."""
    parsed = {label: [_numbers_by_line(out) for out in runs] for label, runs in outputs.items()}
    lines = []
    for key in parsed["before"][0]:
        runs = [p.get(key) for label in ("before", "after") for p in parsed[label]]
        if any(values is None or len(values) != len(runs[0]) for values in runs):
            continue  # printed by one commit only, or with other numbers in it
        per_commit = {}
        for label in ("before", "after"):
            rounds = [p[key] for p in parsed[label]]
            per_commit[label] = [statistics.median(column) for column in zip(*rounds)]
        lines.append(key[0].format(*_describe(per_commit["before"], per_commit["after"])))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the earlier commit (anything `git worktree add` takes)")
    parser.add_argument("--after", default=None, help="the later commit; default: this working tree as it is")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each commit, alternating")
    parser.usage = "%(prog)s BEFORE [--after COMMIT] [--rounds N] -- SCRIPT [ARGS...]"
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("name the bench script (in bench/) after --, e.g. -- engine_throughput.py")
    split = argv.index("--")
    args, script = parser.parse_args(argv[:split]), argv[split + 1 :]
    with tempfile.TemporaryDirectory(prefix="compare_commits_") as tmp:
        trees = {"before": Path(tmp) / "before", "after": ROOT if args.after is None else Path(tmp) / "after"}
        commits = {"before": args.before, "after": args.after}
        made = []
        try:
            for label, tree in trees.items():
                if commits[label] is not None:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commits[label]],
                                   check=True, capture_output=True)  # fmt: skip
                    made.append(tree)
            outputs: dict[str, list[str]] = {"before": [], "after": []}
            for i in range(args.rounds):
                for label in ("before", "after"):
                    outputs[label].append(_run(trees[label], script, f"{label} ({commits[label] or 'working tree'}), "
                                                                     f"round {i + 1}/{args.rounds}"))  # fmt: skip
        finally:
            for tree in made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"=== {' '.join(script)}: {args.before} -> {args.after or 'working tree'}, medians of {args.rounds} round(s)")
    for line in compare(outputs):
        print(line)


if __name__ == "__main__":
    main()
