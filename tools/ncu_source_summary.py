"""Where a kernel's warps stall, by source line, from Nsight Compute's source page.

Reads the CSV of ``ncu -i REPORT --page source --csv --print-source cuda,sass`` (a build with
-lineinfo). That page lists each source line with the SASS instructions under it, and an
inlined instruction appears under every source line of its inline chain; so the samples are
counted once per SASS address, charged to its innermost line in a file of the project
(``splitkv/``), else to the innermost line given.

    python3 tools/ncu_source_summary.py source.csv [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def _count(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(text) if text.isdigit() else 0


def read_source_page(path: str) -> dict[str, tuple[tuple[str, int, str], int, dict[str, int], int]]:
    """SASS address -> ((file, line, source text), samples, samples per stall reason, executed)."""
    by_address: dict = {}
    header, file, line = None, None, None
    with open(path, newline="") as fh:
        for row in csv.reader(fh):
            if not row:
                continue
            if row[0] == "File Path":
                file = row[1].split("/include/")[-1]
                continue
            if row[0] == "Line No":
                header = row
                continue
            if header is None or len(row) != len(header):
                continue  # the function name, or a source line whose quotes ncu did not escape
            if row[0]:
                line = (file, int(row[0]), row[1].strip()[:70])
                continue
            cells = dict(zip(header, row))
            stalls = {k[len("stall_"):]: _count(cells[k]) for k in header
                      if k.startswith("stall_") and "Not Issued" not in k}
            entry = (line, _count(cells[SAMPLES]), stalls, _count(cells["Instructions Executed"]))
            known = by_address.get(row[2])
            if known is None or (line[0].startswith("splitkv/") and not known[0][0].startswith("splitkv/")):
                by_address[row[2]] = entry
    return by_address


def summarize(by_address, top: int) -> str:
    total = sum(e[1] for e in by_address.values())
    reasons, lines, files = collections.Counter(), collections.Counter(), collections.Counter()
    for line, samples, stalls, _ in by_address.values():
        reasons.update(stalls)
        lines[line] += samples
        files[line[0]] += samples
    out = [f"{len(by_address)} instructions, {total} samples, "
           f"{sum(e[3] for e in by_address.values())} warp instructions executed",
           "stall reasons: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common(8)),
           "by file: " + ", ".join(f"{k} {v}" for k, v in files.most_common(8))]
    out += [f"{n:7d} {100 * n / max(total, 1):5.1f}%  {f}:{no}  {text}" for (f, no, text), n in lines.most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for path in args.csv:
        print(f"== {path}")
        print(summarize(read_source_page(path), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
