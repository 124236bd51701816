"""Reading a kernel's SASS (``cuobjdump -sass``) for ``bench compile``: its loops and what they do.

Loops are found on the control-flow graph, not by scanning for backward branches: a loop is the
natural loop of a back edge (a branch to a block that dominates it). Out-of-line code that
jumps back into a loop (the retry of an mbarrier wait, placed after the kernel's exit) then
belongs to the loop it serves instead of making a "loop" of half the kernel; it is not counted
in the loop's instructions, since an iteration runs it only when the wait fails.

A key loop is an innermost loop holding MMA instructions (no inner loop holding MMAs). It is
*masked* when it selects ``-inf`` into scores (the per-key mask of a partial or causal tile);
the *hot* loop is the unmasked one, which runs the whole tiles. A *producer* loop issues loads
and no MMAs: the load partition of a warp-specialized kernel. Per hot-loop iteration it also
counts barriers (``BAR``: every warp of the block waits at each, so the two warpgroups of a
tile cannot overlap one's softmax with the other's MMAs), shared-memory stores (``STS``: a
tile converted or transposed in registers goes back through shared memory before an MMA),
shuffles (``SHFL``: the row maxima's and sums' butterflies, plus any values moved between
threads' registers, such as probabilities converted to an 8-bit MMA's operand layout) and
warpgroup MMAs whose A operand is registers (P of ``P V``; an operand computed before the loop,
such as rounded query rows, stays one too and is read back from shared memory every iteration),
and the instructions it issues while no warpgroup MMA is in flight (``serial_instructions``: the
softmax between a tile's ``Q K^T`` and its ``P V``, unless the next tile's scores run under it).
It counts the exponentials (``MUFU.EX2``, on the 16-lane special-function pipe) and the
int-to-float conversions (``I2F``, ``I2FP``: the 8-bit formats' int32 scores, unless taken by
their bits), whose pipe may be the same: what bounds an 8-bit loop whose MMAs run twice as fast.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")
# MMA instruction families: warpgroup MMAs on 16-bit (HGMMA), FP8 (QGMMA), int8 (IGMMA) or
# 1-bit (BGMMA) operands; warp-level MMAs (HMMA, IMMA).
MMA_PREFIXES = ("HGMMA", "QGMMA", "IGMMA", "BGMMA", "HMMA", "IMMA")
# A run-time integer division or modulo starts the reciprocal with a round-to-+inf conversion.
_DIVISION = re.compile(r"^I2F(\.[A-Z0-9]+)*\.RP$")
# Integer opcodes that take part in 64-bit arithmetic (with their uniform-datapath forms).
_INTEGER = re.compile(r"^U?(IADD3|IMAD|LEA|SHF|IADD|IMNMX|ISETP|LOP3|SEL|MOV)(\.|$)")
_WIDE_MODIFIERS = {"X", "EX", "WIDE", "64", "U64", "S64"}
# ``SHF.R.S32.HI r, RZ, 0x1f, x``: the high word of a sign-extended int32.
_SIGN_EXTEND = re.compile(r"^U?SHF\.R\.S32\.HI$")
_CARRY_OUT = re.compile(r"^\s*U?R\w+\s*,\s*!?U?P[0-6]\s*,")
_LOADS = {"LDG", "LDGSTS", "UTMALDG"}
_LOCAL_WIDTHS = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One SASS instruction: address, guard predicate (``""``, ``"@P0"``, ``"@!UP1"``...)."""

    address: int
    guard: str
    opcode: str
    operands: str


def parse_sass(text: str) -> list[Instruction]:
    """Every instruction of one kernel's ``cuobjdump -sass`` listing, in address order."""
    functions = re.findall(r"^\s*Function : (\S+)", text, flags=re.MULTILINE)
    if len(functions) > 1:
        raise ValueError(f"SASS holds {len(functions)} functions ({', '.join(functions)}), not one")
    return [
        Instruction(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip())
        for m in map(_LINE.search, text.splitlines())
        if m
    ]


def is_mma(opcode: str) -> bool:
    return opcode.startswith(MMA_PREFIXES)


def register_a(instruction: Instruction) -> bool:
    """A warpgroup MMA reading its A operand from registers (``R24, R104, gdesc[UR12], ...``),
    not from shared memory (``R24, gdesc[UR16], ...``: one descriptor pair for A and B)."""
    if not instruction.opcode.startswith(("HGMMA", "QGMMA", "IGMMA", "BGMMA")):
        return False
    operands = [operand.strip() for operand in instruction.operands.split(",")]
    return len(operands) > 1 and re.fullmatch(r"R\d+", operands[1]) is not None


def is_64bit_integer(instruction: Instruction) -> bool:
    """An instruction of 64-bit integer arithmetic: a wide multiply (``IMAD.WIDE``), the high
    half of a 64-bit add, shift or compare (``.X``, ``.U64``, ``.EX``...), the low half of an add
    that writes a carry predicate (``IADD3 R0, P0, ...``), or the high word of a sign extension.
    """
    if not _INTEGER.match(instruction.opcode):
        return False
    modifiers = set(instruction.opcode.split(".")[1:])
    if modifiers & _WIDE_MODIFIERS or _CARRY_OUT.match(instruction.operands):
        return True
    return bool(_SIGN_EXTEND.match(instruction.opcode)) and "0x1f" in instruction.operands


def local_bytes(instruction: Instruction) -> int:
    """Bytes an ``STL``/``LDL`` moves (register spills: Triton's kernels have no local arrays),
    or an ``STG``/``LDG``: its width modifier, else 4."""
    widths = [_LOCAL_WIDTHS[m] for m in instruction.opcode.split(".")[1:] if m in _LOCAL_WIDTHS]
    return widths[0] if widths else 4


def global_access_bytes(instructions: Sequence[Instruction]) -> str:
    """The widths in bytes of the plain global stores and loads (``STG``, ``LDG``; not the
    ``cp.async`` or TMA copies), each widest first: ``"16/16+8"`` is 16-byte stores, and loads
    of 16 and 8 bytes (``-`` where there are none). A copy kernel at copy speed moves its data
    in 16-byte accesses: a narrower store or load there is an alignment or layout the compiler
    could not prove."""

    def widths(opcode: str) -> str:
        found = {local_bytes(i) for i in instructions if i.opcode.split(".")[0] == opcode}
        return "+".join(str(w) for w in sorted(found, reverse=True)) or "-"

    return f"{widths('STG')}/{widths('LDG')}"


def spill_bytes(instructions: Sequence[Instruction]) -> tuple[int, int]:
    """(spill store bytes, spill load bytes): the static sums ``ptxas -v`` reports."""
    stores = sum(local_bytes(i) for i in instructions if i.opcode.split(".")[0] == "STL")
    loads = sum(local_bytes(i) for i in instructions if i.opcode.split(".")[0] == "LDL")
    return stores, loads


# ---------------------------------------------------------------- control flow


def _branch_target(instruction: Instruction) -> int | None:
    if not instruction.opcode.startswith("BRA"):
        return None
    match = _TARGET.search(instruction.operands)
    if match is None:
        raise ValueError(f"branch without a target address at {instruction.address:#x}")
    return int(match.group(1), 16)


def _always(instruction: Instruction) -> bool:
    """Unguarded (or ``@PT``) and with no predicate operand: control never falls through.

    ``BRA !P0, 0x..`` and ``BRA.DIV UR4, 0x..`` are conditional through an operand."""
    if instruction.guard not in ("", "@PT"):
        return False
    if instruction.opcode.startswith("BRA"):
        return re.fullmatch(r"0x[0-9a-f]+", instruction.operands) is not None
    return True


@dataclasses.dataclass
class _Block:
    start: int  # index of the first instruction
    end: int  # one past the last
    successors: list[int]


def _call_target(instruction: Instruction) -> int | None:
    if not instruction.opcode.startswith("CALL"):
        return None
    match = _TARGET.search(instruction.operands)
    if match is None:
        raise ValueError(f"{instruction.opcode} at {instruction.address:#x}: no target address")
    return int(match.group(1), 16)


def _blocks(instructions: Sequence[Instruction]) -> list[_Block]:
    """Basic blocks and their successors. A call returns to the next instruction (its callee,
    a subroutine such as a division's slow path, is left out of the flow)."""
    index = {ins.address: n for n, ins in enumerate(instructions)}
    leaders = {0}
    for n, ins in enumerate(instructions):
        if ins.opcode.startswith(("BRX", "JMX", "JMP")):
            raise ValueError(f"{ins.opcode} at {ins.address:#x}: indirect flow is not followed")
        target = _branch_target(ins)
        callee = _call_target(ins)
        for address in (target, callee):
            if address is not None and address not in index:
                raise ValueError(f"{ins.opcode} at {ins.address:#x} to {address:#x}: no code")
        if callee is not None:
            leaders.add(index[callee])
        if target is not None:
            leaders.add(index[target])
        if target is not None or ins.opcode.startswith(("EXIT", "RET")):
            leaders.add(n + 1)
    starts = sorted(s for s in leaders if s < len(instructions))
    block_of = {s: b for b, s in enumerate(starts)}
    blocks = []
    for b, start in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else len(instructions)
        last = instructions[end - 1]
        successors = []
        target = _branch_target(last)
        if target is not None:
            successors.append(block_of[index[target]])
        ends_flow = target is not None or last.opcode.startswith(("EXIT", "RET"))
        if (not ends_flow or not _always(last)) and end < len(instructions):
            successors.append(b + 1)
        blocks.append(_Block(start, end, successors))
    return blocks


def _dominators(blocks: Sequence[_Block]) -> list[set[int]]:
    """Dominator sets by the iterative data-flow algorithm (kernels have a few hundred blocks);
    empty for blocks the entry does not reach (a callee), which then close no loop."""
    predecessors: list[list[int]] = [[] for _ in blocks]
    for b, block in enumerate(blocks):
        for s in block.successors:
            predecessors[s].append(b)
    reached, stack = {0}, [0]
    while stack:
        for s in blocks[stack.pop()].successors:
            if s not in reached:
                reached.add(s)
                stack.append(s)
    dominators = [set(reached) if b in reached else set() for b in range(len(blocks))]
    dominators[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in sorted(reached - {0}):
            incoming = [dominators[p] for p in predecessors[b] if p in reached]
            new = set.intersection(*incoming) | {b}
            if new != dominators[b]:
                dominators[b], changed = new, True
    return dominators


@dataclasses.dataclass(frozen=True)
class Loop:
    """A natural loop: its header's address, the instructions of one iteration in address order
    (no NOPs, no out-of-line blocks) and all its blocks (nesting is decided on those)."""

    header: int
    instructions: tuple[Instruction, ...]
    blocks: frozenset[int]

    @property
    def size(self) -> int:
        return len(self.instructions)

    def count(self, *prefixes: str) -> int:
        return sum(i.opcode.startswith(prefixes) for i in self.instructions)

    @property
    def mma(self) -> int:
        return sum(is_mma(i.opcode) for i in self.instructions)

    @property
    def mask_selects(self) -> int:
        """Instructions that put ``-inf`` into a value: the per-key score mask."""
        return sum("-INF" in i.operands for i in self.instructions)

    @property
    def masked(self) -> bool:
        return self.mask_selects > 0

    @property
    def loads(self) -> int:
        """Global loads issued per iteration: plain (``LDG``), ``cp.async`` (``LDGSTS``) and
        TMA (``UTMALDG``); not the ``cp.async`` group commits (``LDGDEPBAR``)."""
        return sum(i.opcode.split(".")[0] in _LOADS for i in self.instructions)


def find_loops(instructions: Sequence[Instruction]) -> list[Loop]:
    """Every natural loop (back edges to one header merged), in header address order."""
    if not instructions:
        return []
    blocks = _blocks(instructions)
    dominators = _dominators(blocks)
    predecessors: list[list[int]] = [[] for _ in blocks]
    for b, block in enumerate(blocks):
        for s in block.successors:
            predecessors[s].append(b)
    bodies: dict[int, set[int]] = {}
    last_tail: dict[int, int] = {}
    for tail, block in enumerate(blocks):
        for header in block.successors:
            if header in dominators[tail]:
                body = bodies.setdefault(header, {header})
                last_tail[header] = max(last_tail.get(header, tail), tail)
                stack = [tail]
                while stack:
                    b = stack.pop()
                    if b not in body:
                        body.add(b)
                        stack.extend(predecessors[b])
    loops = []
    for header in sorted(bodies):
        # Blocks placed outside the header..last back edge range are out-of-line paths (an
        # mbarrier wait's retry after the kernel's exit): not what an iteration runs.
        members = sorted(b for b in bodies[header] if header <= b <= last_tail[header])
        body = tuple(
            ins
            for b in members
            for ins in instructions[blocks[b].start : blocks[b].end]
            if ins.opcode != "NOP"
        )
        loops.append(
            Loop(instructions[blocks[header].start].address, body, frozenset(bodies[header]))
        )
    return loops


def key_loops(loops: Sequence[Loop]) -> list[Loop]:
    """Innermost loops holding MMAs: no loop inside them holds an MMA."""
    with_mma = [loop for loop in loops if loop.mma]
    return [
        loop
        for loop in with_mma
        if not any(o is not loop and o.blocks < loop.blocks for o in with_mma)
    ]


def producer_loops(loops: Sequence[Loop]) -> list[Loop]:
    """Innermost loops that issue global loads and no MMA."""
    loading = [loop for loop in loops if loop.loads and not loop.mma]
    return [
        loop
        for loop in loading
        if not any(o is not loop and o.blocks < loop.blocks for o in loading)
    ]


def mma_kind(instructions: Sequence[Instruction]) -> str:
    """The MMA families used, e.g. ``HGMMA`` or ``HGMMA+QGMMA``; ``none`` without MMAs."""
    kinds = [p for p in MMA_PREFIXES if any(i.opcode.startswith(p) for i in instructions)]
    return "+".join(kinds) or "none"


def wait_depth(loop: Loop) -> int | None:
    """Deepest ``cp.async`` wait in the loop (``DEPBAR.LE SB0, n``: n groups still in flight)."""
    depths = [
        int(m.group(1), 16)
        for i in loop.instructions
        if i.opcode == "DEPBAR.LE" and (m := re.search(r"SB0,\s*0x([0-9a-f]+)", i.operands))
    ]
    return max(depths) if depths else None


# Warpgroup MMAs run asynchronously until a ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` waits for all of
# them; warp-level MMAs (HMMA, IMMA) are synchronous.
_ASYNC_MMA_PREFIXES = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")
_WAIT_ALL = re.compile(r"^\s*gsb0\s*,\s*0x0\s*$")


def serial_instructions(loop: Loop) -> int:
    """Instructions of an iteration issued while no warpgroup MMA is in flight: the work the
    warpgroup's tensor cores cannot hide. An MMA is in flight from its issue to the next wait
    for all (``WARPGROUP.DEPBAR.LE gsb0, 0x0``), across the back edge too: the loop is read in
    address order, starting in the state its end leaves (a ``P V`` issued last runs on under
    the next iteration's first instructions)."""

    def walk(in_flight: bool) -> tuple[int, bool]:
        serial = 0
        for i in loop.instructions:
            if i.opcode.startswith(_ASYNC_MMA_PREFIXES):
                in_flight = True
            elif i.opcode == "WARPGROUP.DEPBAR.LE" and _WAIT_ALL.match(i.operands):
                in_flight = False
            elif not in_flight:
                serial += 1
        return serial, in_flight

    _, at_end = walk(False)
    return walk(at_end)[0]


def setmaxnreg(instructions: Sequence[Instruction]) -> str:
    """Register reallocations of warp-specialized partitions: ``-40,+232`` (release to 40,
    grow to 232 registers per thread); empty without any."""
    values = set()
    for i in instructions:
        if i.opcode.startswith("USETMAXREG"):
            match = re.search(r"0x([0-9a-f]+)\s*$", i.operands)
            if match:
                sign = "-" if ".DEALLOC" in i.opcode else "+"
                values.add((sign, int(match.group(1), 16)))
    return ",".join(f"{s}{n}" for s, n in sorted(values, key=lambda v: (v[0] == "+", v[1])))


def analyse(text: str) -> dict[str, object]:
    """The SASS measures of one kernel (see the module docstring for the loops)."""
    instructions = parse_sass(text)
    loops = find_loops(instructions)
    keys = key_loops(loops)
    unmasked = [loop for loop in keys if not loop.masked]
    masked = [loop for loop in keys if loop.masked]
    producers = producer_loops(loops)
    stores, loads = spill_bytes(instructions)
    row: dict[str, object] = {
        "sass_instructions": sum(i.opcode != "NOP" for i in instructions),
        "spill_stores": stores,
        "spill_loads": loads,
        "mma": mma_kind(instructions),
        "tma_loads": sum(i.opcode.startswith("UTMALDG") for i in instructions),
        "global_access_bytes": global_access_bytes(instructions),
        "setmaxnreg": setmaxnreg(instructions),
        "key_loops": ",".join(f"{'m' if loop.masked else ''}{loop.size}" for loop in keys),
        "masked_loop_instructions": max((loop.size for loop in masked), default=None),
        "producer_loop_instructions": max((loop.size for loop in producers), default=None),
    }
    # The hot loop: the longest unmasked key loop (with one per consumer partition, the slowest).
    hot = max(unmasked, key=lambda loop: loop.size, default=None)
    if hot is None:
        row.update(
            loop_instructions=None,
            loop_int64_ops=None,
            loop_global_loads=None,
            loop_mbarrier_ops=None,
            loop_divisions=None,
            loop_exponentials=None,
            loop_int_to_float=None,
            loop_barriers=None,
            loop_shared_stores=None,
            loop_shuffles=None,
            loop_serial_instructions=None,
            loop_register_a_mmas=None,
            wait_depth=None,
        )
    else:
        row.update(
            loop_instructions=hot.size,
            loop_int64_ops=sum(is_64bit_integer(i) for i in hot.instructions),
            loop_global_loads=hot.loads,
            loop_mbarrier_ops=hot.count("SYNCS"),
            loop_divisions=sum(bool(_DIVISION.match(i.opcode)) for i in hot.instructions),
            loop_exponentials=hot.count("MUFU.EX2"),
            loop_int_to_float=sum(
                i.opcode.startswith("I2F") and not _DIVISION.match(i.opcode)
                for i in hot.instructions
            ),
            loop_barriers=hot.count("BAR."),
            loop_shared_stores=hot.count("STS"),
            loop_shuffles=hot.count("SHFL"),
            loop_serial_instructions=serial_instructions(hot),
            loop_register_a_mmas=sum(map(register_a, hot.instructions)),
            wait_depth=wait_depth(hot),
        )
    return row
