"""The Triton retrieval kernels (rayapp.kernels.triton) through triton-ascend, without an NPU or CANN:
lowered to the Linalg stage for an Ascend 910B3 and run under Triton's interpreter against rayapp's
references. Only the last step, Linalg to an NPU binary (bishengir-compile), needs CANN.

triton-ascend replaces the triton package, so it runs in a venv of its own:

    python -m venv /work/ta-venv && /work/ta-venv/bin/pip install -c constraints.txt \\
        triton-ascend==3.2.0 pybind11 'numpy<2' torch
    PYTHONPATH=. /work/ta-venv/bin/python bench/triton_ascend_lowering.py

Shapes are SmolLM2-135M's (9 query / 3 KV heads of 64), bfloat16, 128-token pages (vllm-ascend's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend

from rayapp.kernels.triton import kernel_sources

TARGET = GPUTarget("npu", "Ascend910B3", 0)
# The Linalg ops that show a kernel's structure survived lowering: its loops and its dots.
SHOWN_OPS = ("scf.for", "linalg.matmul", "linalg.reduce", "linalg.generic")


def lower(source, stop_before: str = "npubin") -> tuple[dict[str, str], dict[str, float]]:
    """``source``'s IR at each triton-ascend stage before ``stop_before``, and the seconds each took."""
    backend = make_backend(TARGET)
    options = backend.parse_options({})
    metadata = {"hash": source.hash(), "target": TARGET, **options.__dict__}
    stages: dict = {}
    backend.add_stages(stages, options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    start = time.perf_counter()
    module = source.make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(), context)
    texts, seconds = {}, {"ast": time.perf_counter() - start}
    for name, stage in stages.items():
        if name == stop_before:
            break
        start = time.perf_counter()
        module = stage(module, metadata)
        seconds[name] = time.perf_counter() - start
        texts[name] = str(module)
    return texts, seconds


def report_lowering(dump_dir: Path | None) -> None:
    print(f"\n## Lowered for {TARGET.arch} with triton-ascend {triton.__version__} (seconds; ops in the Linalg stage)")
    print(f"{'kernel':<22} {'ttir s':>7} {'linalg s':>9} " + " ".join(f"{op:>14}" for op in SHOWN_OPS))
    sources = kernel_sources(TARGET, dtype=torch.bfloat16, head_dim=64, group=3, page_size=128)
    for source in sources:
        texts, seconds = lower(source)
        linalg = texts["ttadapter"]
        counts = " ".join(f"{linalg.count(op + ' ') + linalg.count(op + '('):>14}" for op in SHOWN_OPS)
        print(f"{source.name:<22} {seconds['ast'] + seconds['ttir']:>7.2f} {seconds['ttadapter']:>9.2f} {counts}")
        if dump_dir is not None:
            dump_dir.mkdir(parents=True, exist_ok=True)
            (dump_dir / f"{source.name}.linalg.mlir").write_text(linalg)
    # The last stage needs CANN's bishengir-compile: show what it says here, for the last kernel lowered.
    backend = make_backend(TARGET)
    options = backend.parse_options({})
    stages: dict = {}
    backend.add_stages(stages, options)
    try:
        stages["npubin"](linalg, {"hash": sources[-1].hash(), "target": TARGET, **options.__dict__})
        print("Linalg to NPU binary: compiled (CANN present)")
    except Exception as error:  # reported, not handled: without CANN this step is expected to fail
        print(f"Linalg to NPU binary: {type(error).__name__}: {str(error).splitlines()[0][:160]}")


def main() -> None:
    if "ascend" not in triton.backends.backends:
        sys.exit(f"triton {triton.__version__} here has no Ascend backend: run this in triton-ascend's venv")
    print(f"# rayapp.kernels.triton on triton-ascend {triton.__version__}, torch {torch.__version__}")
    report_lowering(Path(os.environ["DUMP_DIR"]) if "DUMP_DIR" in os.environ else None)
    print("\n## Under TRITON_INTERPRET=1 against rayapp.kernels.retrieval's references")
    sys.stdout.flush()  # the child writes to the same stdout
    check = Path(__file__).with_name("triton_kernels.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, str(check), "--interpreter-check"], env=env, check=True)


if __name__ == "__main__":
    main()
