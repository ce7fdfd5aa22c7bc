"""The collectives of a compiled program, read from its optimised HLO text
(`jax.jit(f).lower(...).compile().as_text()`): what runs, how often per call, how many bytes, and
which collectives move a parameter of the program.

- Per call: a collective inside a `while` body runs once per trip; the compiler records known
  trip counts (`known_trip_count`) and they multiply through nested loops. Both branches of a
  conditional are counted as taken, so conditional counts are upper bounds. A `while` without a
  known trip count counts once and is reported (`unknown_trip_counts`).
- Bytes: the size of the collective's result on one device (for an all-gather, the gathered
  array; for an all-reduce, the reduced array). That is what one device receives or combines,
  not a wire-level figure.
- Moves a parameter: the partitioner names the program argument a collective's operand was
  taken from in its `op_name` (e.g. `params['lead'][1]['mlp']['routed_expert_down_proj'].value`
  for a gathered weight shard). A collective of a weight every step is the silent-replication
  failure; its count should be zero.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute", "collective-broadcast")

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e8m0fnu": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$")
_COLLECTIVE = re.compile(r"=\s(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")
_WHILE = re.compile(r"\swhile\(.*?body=%([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEES = re.compile(r"(?:condition|body|to_apply|calls|true_computation|false_computation)"
                      r"=%([\w.\-]+)|branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    result: str  # the result type, e.g. "f32[7168,3584]"
    bytes: int  # the result's bytes on one device
    per_call: int  # executions per call of the program (trip counts of enclosing loops)
    op_name: str  # jax's op_name metadata: where in the program it comes from
    moves_parameter: bool  # its operand is taken from a parameter of the program


@dataclasses.dataclass(frozen=True)
class Report:
    collectives: tuple[Collective, ...]
    unknown_trip_counts: int  # while loops whose trip count the compiler did not record

    @property
    def count(self) -> int:
        return sum(c.per_call for c in self.collectives)

    @property
    def bytes(self) -> int:
        return sum(c.bytes * c.per_call for c in self.collectives)

    def count_by_kind(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for c in self.collectives:
            counts[c.kind] += c.per_call
        return dict(counts)

    def moving_parameters(self) -> list[Collective]:
        return [c for c in self.collectives if c.moves_parameter]



def result_bytes(result: str) -> int:
    """Bytes of an HLO result type: an array `f32[8,128]{1,0}` or a tuple of arrays."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype]
               for dtype, dims in _ARRAY.findall(result) if dtype in _ITEMSIZE)


def _computations(hlo: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines}; the entry computation is stored as ''."""
    computations: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault("" if line.startswith("ENTRY") else header[1], [])
        elif line.strip() == "}":
            current = None
        elif current is not None:
            current.append(line)
    return computations


def _multipliers(computations: dict[str, list[str]]) -> tuple[dict[str, int], int]:
    """How many times each computation runs per call of the entry, and how many while loops
    had no known trip count."""
    edges: dict[str, list[tuple[str, int]]] = {name: [] for name in computations}
    unknown = 0
    for name, lines in computations.items():
        for line in lines:
            body = _WHILE.search(line)
            trips = _TRIP_COUNT.search(line)
            if body and not trips:
                unknown += 1
            for single, branches in _CALLEES.findall(line):
                for callee in [single] if single else re.findall(r"%([\w.\-]+)", branches):
                    n = int(trips[1]) if body and trips and callee == body[1] else 1
                    edges[name].append((callee, n))
    runs = {"": 1}
    pending = [""]
    while pending:  # call graphs are acyclic: propagate the largest count along every edge
        name = pending.pop()
        for callee, n in edges.get(name, []):
            if runs.get(callee, 0) < runs[name] * n:
                runs[callee] = runs[name] * n
                pending.append(callee)
    return runs, unknown


_MOVES_DATA = {"bitcast", "copy", "convert", "reshape", "transpose", "slice", "dynamic-slice",
               "broadcast", "get-tuple-element", "tuple", "concatenate", "pad", "parameter",
               "constant", "iota"}
_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s=\s(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    opcode: str
    operands: tuple[str, ...]
    op_name: str
    line: str


def _instructions(lines: list[str]) -> dict[str, _Instruction]:
    table = {}
    for line in lines:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, _, opcode, rest = m.groups()
        depth, end = 0, len(rest)
        for i, ch in enumerate(rest):  # the operand list ends at its closing parenthesis
            depth += ch == "("
            if ch == ")":
                if depth == 0:
                    end = i
                    break
                depth -= 1
        op = _OP_NAME.search(line)
        table[name] = _Instruction(opcode, tuple(re.findall(r"%([\w.\-]+)", rest[:end])),
                                   op[1].replace("\\'", "'") if op else "", line)
    return table


class _Origins:
    """Which program arguments a value is a copy, slice or conversion of: operands are followed
    back through data-movement instructions (and fusions of nothing else), and from a loop body's
    parameter to the value the loop was entered with."""

    def __init__(self, computations: dict[str, list[str]]):
        self.tables = {name: _instructions(lines) for name, lines in computations.items()}
        self.movement = {name for name, table in self.tables.items()
                         if all(i.opcode in _MOVES_DATA for i in table.values())}
        self.entered_with = {}  # loop body -> (caller, the while instruction's operand)
        for caller, table in self.tables.items():
            for inst in table.values():
                body = _WHILE.search(inst.line)
                if inst.opcode == "while" and body and inst.operands:
                    self.entered_with[body[1]] = (caller, inst.operands[0])

    def arguments(self, computation: str, name: str, depth: int = 0) -> set[str]:
        """op_names of the entry parameters `name` (in `computation`) is taken from."""
        inst = self.tables.get(computation, {}).get(name)
        if inst is None or depth > 64:
            return set()
        if inst.opcode == "parameter":
            if computation == "":
                return {inst.op_name}
            return set()  # a loop body's tuple parameter: resolved by get-tuple-element below
        if inst.opcode == "get-tuple-element":
            source = self.tables[computation].get(inst.operands[0])
            index = re.search(r"index=(\d+)", inst.line)
            if source and source.opcode == "parameter" and computation in self.entered_with:
                caller, entered = self.entered_with[computation]
                entry = self.tables[caller].get(entered)
                if entry and entry.opcode == "tuple" and index:
                    return self.arguments(caller, entry.operands[int(index[1])], depth + 1)
            return set()
        if inst.opcode == "fusion":
            callee = re.search(r"calls=%([\w.\-]+)", inst.line)
            if not callee or callee[1] not in self.movement:
                return set()
        elif inst.opcode not in _MOVES_DATA:
            return set()
        operands = inst.operands[:1] if inst.opcode == "dynamic-slice" else inst.operands
        return set().union(*(self.arguments(computation, o, depth + 1) for o in operands))


def read(hlo: str, argument_names: Sequence[str] = ("params",)) -> Report:
    """The collectives of an optimised HLO module's text. A collective whose operand is taken
    (copied, sliced, converted, reshaped) from an entry parameter whose op_name starts with one
    of `argument_names` (the program's weight arguments) moves a parameter."""
    computations = _computations(hlo)
    runs, unknown = _multipliers(computations)
    origins = _Origins(computations)
    prefixes = tuple(f"{a}{sep}" for a in argument_names for sep in ("[", "."))
    found = []
    for name, table in origins.tables.items():
        if runs.get(name, 0) == 0:
            continue
        for inst in table.values():
            match = _COLLECTIVE.search(inst.line)
            if not match:
                continue
            sources = set().union(*(origins.arguments(name, o) for o in inst.operands))
            moved = sorted(s for s in sources if s.startswith(prefixes))
            found.append(Collective(
                match[2], re.sub(r"\{[^}]*\}", "", match[1]), result_bytes(match[1]), runs[name],
                moved[0] if moved else inst.op_name, bool(moved)))
    return Report(tuple(found), unknown)


def describe(report: Report, indent: str = "") -> Iterable[str]:
    """Lines for a program's report: totals by kind, bytes, parameter moves, the largest."""
    by_kind = ", ".join(f"{n:,} {k}" for k, n in sorted(report.count_by_kind().items()))
    yield (f"{indent}collectives per call: {report.count:,}" + (f" ({by_kind})" if by_kind else "")
           + f", {report.bytes / 1e6:,.3f} MB per device"
           + (f"; {report.unknown_trip_counts} loops of unknown trip count counted once"
              if report.unknown_trip_counts else ""))
    moving = report.moving_parameters()
    if moving:
        total = sum(c.bytes * c.per_call for c in moving)
        yield (f"{indent}!! {sum(c.per_call for c in moving):,} collectives move parameters "
               f"({total / 1e6:,.1f} MB per call), e.g. {moving[0].kind} {moving[0].result} of "
               f"{moving[0].op_name}")
    groups: dict[tuple[str, str, bool], list[Collective]] = {}
    for c in report.collectives:
        groups.setdefault((c.kind, c.result, c.moves_parameter), []).append(c)
    ranked = sorted(groups.values(), key=lambda g: (g[0].bytes, sum(c.per_call for c in g)),
                    reverse=True)
    for group in ranked[:10]:  # the ten largest shapes, identical collectives counted together
        c, per_call = group[0], sum(c.per_call for c in group)
        flag = "  <- parameter" if c.moves_parameter else ""
        yield (f"{indent}  {per_call:>6,} x {c.kind:14s} {c.result:32s} {c.bytes / 1e6:10.3f} MB"
               f"  {c.op_name[:72]}{flag}")
