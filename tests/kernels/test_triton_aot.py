"""The Triton retrieval kernels compile ahead of time for CUDA and ROCm targets, on a machine with neither."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from rayapp.kernels.triton import compile_for, interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(interpreting(), reason="triton was imported under TRITON_INTERPRET=1")
KERNELS = ["score_blocks_kernel", "decode_split_kernel", "merge_splits_kernel"]


@pytest.mark.parametrize(
    "target,binary_format,assembly,arch_marker",
    [
        pytest.param(GPUTarget("cuda", 80, 32), "cubin", "ptx", ".target sm_80", id="cuda-sm80"),
        pytest.param(GPUTarget("cuda", 90, 32), "cubin", "ptx", ".target sm_90", id="cuda-sm90"),
        pytest.param(GPUTarget("hip", "gfx942", 64), "hsaco", "amdgcn", "gfx942", id="hip-gfx942"),
    ],
)
def test_every_kernel_compiles_to_a_device_binary_for_the_target(target, binary_format, assembly, arch_marker):
    compiled = compile_for(target)
    assert [c.name for c in compiled] == KERNELS
    for kernel in compiled:
        assert kernel.binary_format == binary_format
        assert kernel.binary[:4] == b"\x7fELF", f"{kernel.name}: not an ELF device binary"
        assert arch_marker in kernel.compiled.asm[assembly], f"{kernel.name} was not compiled for {target}"
        assert kernel.seconds > 0
