"""tools/ncu_source_summary.py on a small source page of the shape Nsight Compute writes."""
from tool_module import load_tool

HEADER = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_long_sb","stall_wait",'
          '"stall_long_sb (Not Issued)"')
PAGE = "\n".join([
    '"File Path","/site/cutlass/include/splitkv/tiles.h"',
    '"Function Name","void splitkv::split_kv_live_kernel(SplitParams)"',
    HEADER,
    '"86","const int64_t page = __ldg(pages + n);","-","-","10","0","5","7","3","0"',
    '"","","0x10","LDG.E.CONSTANT R2, [R4]","7","0","2","7","0","7"',
    '"","","0x20","IMAD.WIDE R6, R2, R8, R10","3","0","3","0","3","0"',
    '"File Path","/site/cutlass/include/cute/stride.hpp"',
    HEADER,
    '"119","return coord * stride;","-","-","7","0","6","0","7","0"',
    '"","","0x20","IMAD.WIDE R6, R2, R8, R10","3","0","3","0","3","0"',
    '"","","0x30","IMAD R12, R13, R14, RZ","4","0","3","0","4","0"',
    '"247","asm volatile(""f"(c0)","-","-","1","0","1","0","1","0","extra"',
])


def _tool():
    return load_tool("ncu_source_summary")


def test_each_instruction_counts_once_under_the_projects_line(tmp_path):
    tool = _tool()
    page = tmp_path / "source.csv"
    page.write_text(PAGE)
    by_address = tool.read_source_page(str(page))
    assert sorted(by_address) == ["0x10", "0x20", "0x30"]
    # 0x20 is listed under both lines of its inline chain; it is charged to the project's.
    assert by_address["0x20"][0][:2] == ("splitkv/tiles.h", 86)
    assert by_address["0x30"][0][:2] == ("cute/stride.hpp", 119)
    report = tool.summarize(by_address, top=5)
    assert report.splitlines()[0] == "3 instructions, 14 samples, 8 warp instructions executed"
    assert "stall reasons: long_sb 7, wait 7" in report
    assert "by file: splitkv/tiles.h 10, cute/stride.hpp 4" in report
    assert "     10  71.4%  splitkv/tiles.h:86  const int64_t page = __ldg(pages + n);" in report
