"""tools/kernel_liveness.py on a small listing of the shape `nvdisasm --life-range-mode wide` writes."""
from tool_module import load_tool

# Where the listing puts each register's mark after "// |": under the last digit of its number in
# the header "   # 0 1 2 3 4 5 6 7 8 9 10 11 |".
COLUMN = {r: 5 + 2 * r for r in range(10)} | {10: 26, 11: 29}
HEADER = "   # 0 1 2 3 4 5 6 7 8 9 10 11 | # 0 1 |"


def line(address: int, text: str, marks: dict) -> str:
    cells = [" "] * 32
    count = str(len(marks))
    cells[4 - len(count):4] = count
    for r, mark in marks.items():
        cells[COLUMN[r]] = mark
    return f"        /*{address:04x}*/ {text} ;".ljust(60) + "// |" + "".join(cells) + "|     |"


def live(regs, touched=(), mark="v"):
    return {r: (mark if r in touched else ":") for r in regs}


LISTING = "\n".join([
    ".headerflags    @\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\"",
    " " * 60 + "// |" + HEADER,
    ".text._Z6kernelv:" + " " * 43 + "// |" + " " * 36,
    line(0x00, "MOV R1, c[0x0][0x28]", {1: "^"}),
    line(0x10, "MOV R3, R1", {1: "v", 3: "^"}),
    ".L_x_0:",
    line(0x20, "LDS R2, [R1]", live({1, 3}, {1}) | {2: "^"}),
    line(0x30, "HMMA.16816.F32 R4, R8, R10, R4", live(set(range(1, 12)), set(range(4, 12)), "x")),
    line(0x40, "IADD3 R2, R2, UR4, RZ", live({1, 2, 3}, {2}, "x")),
    line(0x50, "@P0 BRA `(.L_x_1)", live({1, 2, 3})),
    line(0x60, "BRA `(.L_x_0)", live({1, 2, 3})),
    ".L_x_1:",
    line(0x70, "IADD3 R3, R3, 0x1, RZ", live({1, 3}, {3}, "x")),
    line(0x80, "BRA `(.L_x_1)", live({1, 3})),
    line(0x90, "EXIT", {}),
    "//--------------------- .nv.constant0._Z6kernelv --------------------------",
    line(0xa0, "MOV R9, R9", {9: "x"}),
])


def _tool():
    return load_tool("kernel_liveness")


def test_the_listing_parses_into_each_instructions_live_and_touched_registers():
    tool = _tool()
    (function,) = tool.parse(LISTING)
    assert function.name == "_Z6kernelv"
    code = [i for i in function.instructions if not isinstance(i, str)]
    assert [i.address for i in code] == list(range(0, 0xa0, 0x10))  # nothing after the function's end
    hmma = code[3]
    assert hmma.text.startswith("HMMA") and hmma.live == frozenset(range(1, 12))
    assert hmma.touched == frozenset(range(4, 12))
    assert code[2].live == {1, 2, 3} and code[2].touched == {1, 2}
    assert function.instructions[2] == ".L_x_0"


def test_the_main_loop_is_the_smallest_loop_with_an_mma_and_its_carried_registers_are_never_touched():
    tool = _tool()
    (function,) = tool.parse(LISTING)
    s = tool.summary(function)
    # The loop at .L_x_1 is smaller but has no MMA; the forward branch at 0x50 is no loop.
    assert s["instructions"] == 5 and s["loop_peak"] == 11 and s["peak"] == 11
    assert s["throughout"] == 3  # R1, R2 and R3 are live at every instruction of the loop
    assert s["carried"] == [3]   # R3 is live through it, but no instruction of it reads or writes it
    assert s["uniform"] == 1
