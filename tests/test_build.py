"""Build-side checks that need no GPU: generated files are current, and the kernels compile.

The compile checks run nvcc for sm_90 on one instantiation of each kernel template (the
decode and the prefill tile of the split kernel, the combine kernel), on each of them again at
head dims 96 and 256 (other swizzle atoms and copies, Q read from shared memory, the fold's
wider lanes), the dispatch table and the torch binding, so a compile break fails CI without a
GPU. The traits static_assert that their CuTe layouts take the shared memory rules.h counts,
so these compiles also check the host's rule against the kernel's. They skip when nvcc
or the CUTLASS headers are missing; ``SPLITKV_SKIP_NVCC=1`` skips them on purpose.
"""
import concurrent.futures
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from splitkv_tune import _rules, codegen, tunables

ROOT = Path(__file__).resolve().parent.parent


def test_generated_files_match_tunables():
    stale = codegen.stale_files()
    assert not stale, f"run `python -m splitkv_tune.codegen`; stale: {[str(p) for p in stale]}"


def test_every_instantiation_is_generated():
    names = {p.name for p in codegen.INST_DIR.glob("*.cu")}
    for dt, hd, bm, bkv in codegen.split_instances():
        assert codegen.split_file(dt, hd, bm, bkv) in names
    assert len(names) == len(codegen.split_instances()) + len(tunables.DTYPES) * len(tunables.HEAD_DIMS)


def test_block_kv_per_head_dim():
    """Only the block_kv values of a head dim are instantiated, and every instantiation's
    shared memory fits sm_80's 163 KB opt-in limit (sm_90: 227 KB)."""
    got = {(hd, bkv) for _, hd, _, bkv in codegen.split_instances()}
    assert got == {(hd, bkv) for hd in tunables.HEAD_DIMS for bkv in tunables.block_kvs_for(hd)}
    assert set(tunables.BLOCK_KV_BY_HEAD_DIM) == set(tunables.HEAD_DIMS)
    assert all(set(v) <= set(tunables.BLOCK_KV) for v in tunables.BLOCK_KV_BY_HEAD_DIM.values())
    assert max(tunables.smem_bytes(hd, bkv, bm) for _, hd, bm, bkv in codegen.split_instances()) <= 163 * 1024
    assert tunables.smem_bytes(256, 128, 16) > 227 * 1024  # why 256 stops at block_kv 64


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    path = Path(cutlass_library.__file__).parent / "source" / "include"
    return path if (path / "cute" / "tensor.hpp").exists() else None


def _compile_inputs():
    inst = codegen.INST_DIR
    return [inst / "split_bf16_hd128_bm16_bkv64.cu", inst / "split_bf16_hd128_bm16_bkv32.cu",
            inst / "split_fp16_hd64_bm64_bkv32.cu", inst / "split_bf16_hd256_bm16_bkv64.cu",
            inst / "split_fp16_hd96_bm16_bkv64.cu", inst / "split_bf16_hd256_bm64_bkv64.cu",
            inst / "split_fp16_hd96_bm64_bkv128.cu", inst / "combine_bf16_hd128.cu",
            inst / "combine_bf16_hd256.cu", inst / "combine_fp16_hd96.cu", ROOT / "kernels" / "dispatch.cu"]


@pytest.fixture(scope="module")
def nvcc_flags():
    if os.environ.get("SPLITKV_SKIP_NVCC") == "1":
        pytest.skip("SPLITKV_SKIP_NVCC=1")
    nvcc = shutil.which("nvcc")
    include = _cutlass_include()
    if nvcc is None or include is None:
        pytest.skip("needs nvcc and the nvidia-cutlass headers")
    return [nvcc, "-std=c++17", "-arch=sm_90", "--use_fast_math", "--expt-relaxed-constexpr",
            f"-I{include}", f"-I{ROOT / 'kernels' / 'include'}"]


def test_kernel_templates_compile_for_sm90(nvcc_flags, tmp_path):
    def build(src: Path):
        cmd = nvcc_flags + ["-Xptxas", "-v", "-c", str(src), "-o", str(tmp_path / (src.stem + ".o"))]
        return src, subprocess.run(cmd, capture_output=True, text=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(build, _compile_inputs()))
    for src, proc in results:
        assert proc.returncode == 0, f"{src.name} failed to compile:\n{proc.stderr[-4000:]}"
        spills = _spills_by_kernel(proc.stderr)
        if src.parent.name == "instantiations":
            assert spills, f"no ptxas report for the kernels of {src.name}"
        if src.stem.startswith("split_"):
            # The analytic model's residency (rules.h split_kernel_registers) is this count.
            _, _, hd, bm, bkv = src.stem.split("_")
            want = _rules.split_kernel_registers(int(hd[2:]), int(bm[2:]), int(bkv[3:]))
            equal = [n for k, n in _registers_by_kernel(proc.stderr).items() if "split_kv_kernel" in k]
            assert equal == [want], (f"{src.name}: the equal-length kernel uses {equal} registers, rules.h "
                                     f"split_kernel_registers says {want}: update it (tools/kernel_registers.py)")
        for kernel, stored in spills.items():
            # Register spills would put the accumulators in local memory: a silent slowdown.
            if "split_kv_live_kernel" not in kernel:
                assert stored == 0, f"{src.name}: {kernel} spills registers:\n{proc.stderr[-2000:]}"
            elif not _live_kernel_may_spill(src.stem):
                # The persistent kernel's item loop costs registers (docs/NOTES.md, session 10): at
                # the decode tiles of head dims up to 128 it spills at most two values, outside
                # the key loop, and that is what its measured times include.
                assert stored <= 8, f"{src.name}: {kernel} spills {stored} bytes:\n{proc.stderr[-2000:]}"


def _spills_by_kernel(ptxas_log: str) -> dict[str, int]:
    """Spill-store bytes of each entry function of a ptxas -v log."""
    return codegen.ptxas_per_kernel(ptxas_log, r"(\d+) bytes spill stores")


def _registers_by_kernel(ptxas_log: str) -> dict[str, int]:
    """Registers per thread of each entry function of a ptxas -v log."""
    return codegen.ptxas_per_kernel(ptxas_log, r"Used (\d+) registers")


def _live_kernel_may_spill(stem: str) -> bool:
    """The instantiations whose persistent kernel is known to spill (docs/PERFORMANCE.md: head dim
    256 and the 64-row tiles, 92 to 516 bytes of stores), so it is not yet the fast path there."""
    return "_hd256_" in stem or "_bm64_" in stem


def _torch_includes(tmp_path: Path) -> list[str]:
    """Torch's C++ include flags for the binding. A CPU-only torch wheel lacks the one header
    its CUDA build generates (it only says whether c10_cuda is a shared library); the check
    supplies it, as that build does."""
    from torch.utils import cpp_extension
    flags = [f"-I{p}" for p in cpp_extension.include_paths()]
    generated = Path(cpp_extension.include_paths()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not generated.exists():
        macros = tmp_path / "generated" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        macros.parent.mkdir(parents=True)
        macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        flags.append(f"-I{tmp_path / 'generated'}")
    return flags


def _binding_cxx_standard() -> str:
    """The C++ standard CMakeLists.txt compiles the binding with (torch 2.14's headers need 20)."""
    found = re.search(r"target_compile_features\(_C PRIVATE cxx_std_(\d+)\)", (ROOT / "CMakeLists.txt").read_text())
    assert found, "CMakeLists.txt names no C++ standard for _C"
    return found.group(1)


def test_binding_compiles(nvcc_flags, tmp_path):
    """bindings.cpp as CMake compiles it: the C++ compiler, the binding's standard, torch's and
    CUDA's headers."""
    import torch
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    # CUDA's headers where nvcc itself finds them (nvcc may be a wrapper outside the toolkit).
    (tmp_path / "empty.cu").write_text("")
    dry = subprocess.run([nvcc_flags[0], "--dryrun", "-c", str(tmp_path / "empty.cu")], capture_output=True, text=True)
    cuda_includes = re.findall(r'INCLUDES="(-I[^"]+)"', dry.stdout + dry.stderr)
    assert cuda_includes, f"nvcc --dryrun names no include directory:\n{dry.stderr[-2000:]}"
    cmd = [cxx, f"-std=c++{_binding_cxx_standard()}", "-fPIC", f"-I{ROOT / 'kernels' / 'include'}",
           *cuda_includes, *_torch_includes(tmp_path), f"-I{sysconfig.get_paths()['include']}",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           "-DTORCH_EXTENSION_NAME=_C", "-c", str(ROOT / "kernels" / "bindings.cpp"), "-o", str(tmp_path / "bindings.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_rules_module_matches_tunables():
    """splitkv_tune._rules was built from the tunables.h this tunables.py generates."""
    from splitkv_tune import _rules
    got = _rules.COMPILED_TUNABLES
    assert got["head_dims"] == tunables.HEAD_DIMS and got["block_kv"] == tunables.BLOCK_KV
    assert got["block_m"] == tunables.BLOCK_M
    assert got["reduce_threads"] == tunables.REDUCE_THREADS
    assert (got["max_splits"], got["kv_stages"], got["num_warps"], got["workspace_align"]) == (
        tunables.MAX_SPLITS, tunables.KV_STAGES, tunables.NUM_WARPS, tunables.WORKSPACE_ALIGN)
    assert tunables.dtype_codes() == {d: i for i, d in enumerate(tunables.DTYPES)}
    assert set(tunables.policy_codes()) == set(tunables.SPLIT_POLICIES)


def test_extension_matches_tunables():
    """The built extension's shared-memory sizes (from the C++ traits' CuTe layouts) equal the
    rules.h count that the host checks and the selector use (the traits also static_assert it)."""
    import torch  # noqa: F401  (loads libtorch's CUDA libraries before the extension)
    ext = pytest.importorskip("splitkv_tune._C", reason="extension not built")
    for dt, hd, bm, bkv in codegen.split_instances():
        code = tunables.dtype_codes()[dt]
        assert ext.split_smem_bytes(code, hd, bm, bkv) == tunables.smem_bytes(hd, bkv, bm)
    for hd in tunables.HEAD_DIMS:  # block_kv values a head dim leaves out are not built
        for bkv in set(tunables.BLOCK_KV) - set(tunables.block_kvs_for(hd)):
            assert all(ext.split_smem_bytes(0, hd, bm, bkv) == -1 for bm in tunables.BLOCK_M)
