"""Registers per thread of the split kernels of every instantiation (ptxas -v of
nvcc for sm_90, the build's optimisation flags), beside rules.h ``split_kernel_registers``: the
counts the analytic model's residency comes from. Run it after a kernel change that moves
registers (tests/test_build.py fails then, for the instantiations it compiles) and copy the
equal-length column into rules.h. About 35 s an instantiation on this 2-core box.

    PYTHONPATH=$PWD python3 tools/kernel_registers.py [--dtype bf16 [--dtype fp16]] [--jobs 2]
"""
import argparse
import concurrent.futures
import subprocess
from pathlib import Path

import cutlass_library

from splitkv_tune import _rules, codegen

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["nvcc", "-std=c++17", "-arch=sm_90", "-O3", "-DNDEBUG", "--use_fast_math",
         "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas", "-v",
         f"-I{Path(cutlass_library.__file__).parent / 'source' / 'include'}",
         f"-I{ROOT / 'kernels' / 'include'}"]


def registers(src: Path) -> dict[str, int]:
    """{"equal": n, "live": n} registers of the two split kernels of one instantiation."""
    proc = subprocess.run(FLAGS + ["-c", str(src), "-o", "/dev/null"], capture_output=True, text=True,
                          check=True)
    found = codegen.ptxas_per_kernel(proc.stderr, r"Used (\d+) registers")
    return {("live" if "split_kv_live_kernel" in kernel else "equal"): n for kernel, n in found.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", action="append", choices=["bf16", "fp16"],
                    help="only this dtype's instantiations (repeatable; default: both)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    instances = [i for i in codegen.split_instances() if i[0] in (args.dtype or ["bf16", "fp16"])]
    sources = [codegen.INST_DIR / codegen.split_file(*instance) for instance in instances]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        counts = list(pool.map(registers, sources))
    print("dtype head_dim block_m block_kv  equal  live  rules.h  CTAs a SM by registers")
    for (dt, hd, bm, bkv), found in zip(instances, counts):
        table = _rules.split_kernel_registers(hd, bm, bkv)
        mark = "" if table == found.get("equal") else "  <- differs"
        print(f"{dt:5s} {hd:8d} {bm:7d} {bkv:8d} {found.get('equal', 0):6d} {found.get('live', 0):5d} "
              f"{table:8d}  {_rules.register_residency(hd, bm, bkv)}{mark}")


if __name__ == "__main__":
    main()
