"""Live registers of the split kernels of one instantiation, from the machine code: the peak
number of registers live at once, and in the main loop (the smallest loop that holds an MMA)
its own peak, how many registers stay live through the whole loop and how many of those the
loop never reads or writes (values carried across it).

The loop's instructions with uniform-register operands count the work the loop keeps off the
per-thread registers: values the compiler knows are the same in every thread (the equal-length
kernel's item comes from blockIdx, the live kernel's from shared memory).

Why: ptxas's "Used N registers" is not what a kernel needs. Once a kernel is held to some CTAs
a SM by its registers, ptxas spends the registers up to that bound, so the live kernel's 255
says only "two CTAs a SM"; its peak of live registers says how far it is from three (168).

    PYTHONPATH=$PWD python3 tools/kernel_liveness.py [--dtype bf16] [--head-dim 128] [--block-m 16] [--block-kv 64]

Needs nvcc (it compiles the instantiation as tools/kernel_registers.py does) and nvdisasm (CUDA
toolkit, or `pip install nvidia-cuda-nvdisasm`); about 20 s an instantiation here. R1, the stack
pointer, is live and untouched through every loop, so "carried" counts it in both kernels.
"""
import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernel_registers import FLAGS

from splitkv_tune import codegen


@dataclass
class Instruction:
    address: int
    text: str
    live: frozenset     # general registers live at this instruction
    touched: frozenset  # those of them it reads or writes (wide operands in full)


@dataclass
class Function:
    name: str
    instructions: list  # of Instruction, and of str for labels


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(candidate)
    sys.exit("kernel_liveness: nvdisasm not found: put the CUDA toolkit's bin on PATH or "
             "`pip install nvidia-cuda-nvdisasm`")


def parse(listing: str) -> list:
    """The functions of an `nvdisasm --life-range-mode wide` listing, with each instruction's
    live general registers (the columns of the header's GPR section that are not blank) and
    those it reads or writes (marked ^ written, v read, x both; ':' is live only)."""
    functions, columns, current = [], {}, None
    for line in listing.splitlines():
        header = line.find("# 0 1 2")
        if header >= 0:
            end = line.index("|", header)
            columns = {int(m.group()): header + 1 + m.end() - 1 for m in re.finditer(r"\d+", line[header + 1:end])}
            continue
        if line.startswith(".text."):
            current = Function(line[len(".text."):].split(":")[0], [])
            functions.append(current)
            continue
        if current is None:
            continue
        if line.startswith("//----"):
            current = None
            continue
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            current.instructions.append(label.group(1))
            continue
        inst = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if inst:
            marks = {r: line[col] for r, col in columns.items() if col < len(line) and line[col] != " "}
            current.instructions.append(Instruction(int(inst.group(1), 16), inst.group(2), frozenset(marks),
                                                    frozenset(r for r, mark in marks.items() if mark != ":")))
    return functions


def main_loop(function: Function):
    """(first, last) positions of the main loop: the smallest loop (a backward branch to a label)
    that holds an MMA."""
    labels = {item: k for k, item in enumerate(function.instructions) if isinstance(item, str)}
    best = None
    for k, item in enumerate(function.instructions):
        if isinstance(item, str) or "BRA" not in item.text:
            continue
        target = re.search(r"`\((\.L_x_\d+)\)", item.text)
        start = labels.get(target.group(1)) if target else None
        if start is None or start >= k or (best is not None and k - start >= best[1] - best[0]):
            continue
        if any(isinstance(i, Instruction) and "MMA" in i.text for i in function.instructions[start:k]):
            best = (start, k)
    return best


def summary(function: Function) -> dict:
    code = [i for i in function.instructions if isinstance(i, Instruction)]
    out = {"peak": max(len(i.live) for i in code)}
    loop = main_loop(function)
    if loop is not None:
        body = [i for i in function.instructions[loop[0]:loop[1] + 1] if isinstance(i, Instruction)]
        throughout = frozenset.intersection(*(i.live for i in body))
        in_loop = frozenset().union(*(i.touched for i in body))
        out.update(loop_peak=max(len(i.live) for i in body), throughout=len(throughout),
                   carried=sorted(throughout - in_loop), instructions=len(body),
                   uniform=sum(1 for i in body if re.search(r"\bUR\d+\b", i.text)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-kv", type=int, default=64)
    args = ap.parse_args()
    instance = (args.dtype, args.head_dim, args.block_m, args.block_kv)
    if instance not in codegen.split_instances():
        sys.exit(f"kernel_liveness: no split instantiation {instance}; there are {codegen.split_instances()}")
    source = codegen.INST_DIR / codegen.split_file(*instance)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "split.cubin"
        ptxas = subprocess.run(FLAGS + ["-cubin", "-o", str(cubin), str(source)], capture_output=True, text=True,
                               check=True).stderr
        listing = subprocess.run([nvdisasm(), "--life-range-mode", "wide", str(cubin)], capture_output=True,
                                 text=True, check=True).stdout
    registers = codegen.ptxas_per_kernel(ptxas, r"Used (\d+) registers")
    spills = codegen.ptxas_per_kernel(ptxas, r"(\d+) bytes spill stores")
    print(f"{source.name}")
    print("kernel                 registers  spill B  peak live | main loop: peak live  instructions"
          "  with UR operands  live throughout  carried (never read or written in it)")
    for function in parse(listing):
        if function.name not in registers:
            continue
        kind = "split_kv_live_kernel" if "split_kv_live_kernel" in function.name else "split_kv_kernel"
        s = summary(function)
        carried = " ".join(f"R{r}" for r in s.get("carried", []))
        print(f"{kind:22s} {registers[function.name]:9d} {spills.get(function.name, 0):8d} {s['peak']:10d} |"
              f" {s.get('loop_peak', 0):20d} {s.get('instructions', 0):13d} {s.get('uniform', 0):17d}"
              f" {s.get('throughout', 0):16d}  {len(s.get('carried', []))}: {carried}")


if __name__ == "__main__":
    main()
