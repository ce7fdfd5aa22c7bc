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
- Dtypes: XLA:CPU widens bf16 collectives to f32 after partitioning (`all-reduce-promotion`,
  float normalisation), so the compiled CPU program overstates what a TPU compile moves. Given
  the module as the SPMD partitioner left it (`partitioned_module`), each collective is also
  priced at the dtype the partitioner gave it (`partitioned_bytes`).
- Moves a parameter: the partitioner names the program argument a collective's operand was
  taken from in its `op_name` (e.g. `params['lead'][1]['mlp']['routed_expert_down_proj'].value`
  for a gathered weight shard). A collective of a weight every step is the silent-replication
  failure; its count should be zero.
- Source: the Python line that made it and its caller in another file, from the module's
  stack-frame table (frames in the sharding helpers, which only pin what their caller
  computed, are skipped).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

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
    source: str = ""  # "layers/linears.py:21 matmul <- layers/moe.py:412 MoE.__call__"
    partitioned_bytes: int = 0  # `bytes` at the dtypes the SPMD partitioner gave it


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

    @property
    def partitioned_bytes(self) -> int:
        return sum(c.partitioned_bytes * c.per_call for c in self.collectives)

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


def _section(hlo: str, title: str) -> list[str]:
    """The lines of one of the module's trailing tables (`FileNames`, `StackFrames`, ...)."""
    m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", hlo, re.S | re.M)
    return m[1].splitlines() if m else []


def _sources(hlo: str, skip: Sequence[str] = ("k3text/sharding.py",)) -> dict[int, str]:
    """{stack_frame_id: "path:line function"} from the module's stack-frame tables: the
    innermost frame whose file does not end with one of `skip`, the path from the package."""
    def table(title: str) -> dict[int, str]:
        return {int(n): rest for n, rest in
                (line.strip().split(None, 1) for line in _section(hlo, title) if line.strip())}

    files = {k: v.strip('"') for k, v in table("FileNames").items()}
    functions = {k: v.strip('"') for k, v in table("FunctionNames").items()}
    locations = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in table("FileLocations").items()}
    # parent_frame_id is printed one above the parent's id; 1 is the root's "no parent".
    frames = {k: (int(f["file_location_id"]), int(f["parent_frame_id"]) - 1)
              for k, f in ((k, dict(re.findall(r"(\w+)=(\d+)", v)))
                           for k, v in table("StackFrames").items())}

    def describe(frame: int) -> str:
        """The innermost kept frame and its nearest caller in another file ("a <- b")."""
        seen, kept = set(), []
        while frame in frames and frame not in seen and len(kept) < 2:
            seen.add(frame)
            location, parent = frames[frame]
            loc = locations.get(location, {})
            path = files.get(int(loc.get("file_name_id", 0)), "")
            short = path.split("k3text/", 1)[-1] if "k3text/" in path else path
            if not path.endswith(tuple(skip)) and (not kept or kept[-1][0] != short):
                function = functions.get(int(loc.get("function_name_id", 0)), "")
                kept.append((short, f"{short}:{loc.get('line', '?')} {function}".strip()))
            frame = parent
        return " <- ".join(text for _, text in kept)

    return {frame: describe(frame) for frame in frames}


def _partitioned_dtypes(module: str) -> dict[tuple[str, str], set[str]]:
    """{(kind, dims): dtypes} of the collectives in the module as the partitioner emitted it."""
    dtypes: dict[tuple[str, str], set[str]] = {}
    for match in _COLLECTIVE.finditer(module):
        for dtype, dims in _ARRAY.findall(match[1]):
            dtypes.setdefault((match[2], dims), set()).add(dtype)
    return dtypes


def _repriced(result: str, kind: str, dtypes: dict[tuple[str, str], set[str]]) -> int:
    """Bytes of `result` with each array at the partitioner's dtype where that is unambiguous."""
    total = 0
    for dtype, dims in _ARRAY.findall(result):
        if dtype not in _ITEMSIZE:
            continue
        found = dtypes.get((kind, dims), set())
        if len(found) == 1 and next(iter(found)) in _ITEMSIZE:
            dtype = next(iter(found))
        total += math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype]
    return total


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


def read(hlo: str, argument_names: Sequence[str] = ("params",),
         partitioned_module: str | None = None) -> Report:
    """The collectives of an optimised HLO module's text. A collective whose operand is taken
    (copied, sliced, converted, reshaped) from an entry parameter whose op_name starts with one
    of `argument_names` (the program's weight arguments) moves a parameter.
    `partitioned_module`: the same program's HLO right after SPMD partitioning (see
    `partitioned_hlo`), to price each collective at the partitioner's dtypes."""
    computations = _computations(hlo)
    runs, unknown = _multipliers(computations)
    origins = _Origins(computations)
    made_at = _sources(hlo)
    dtypes = _partitioned_dtypes(partitioned_module) if partitioned_module else {}
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
            frame = re.search(r"stack_frame_id=(\d+)", inst.line)
            found.append(Collective(
                match[2], re.sub(r"\{[^}]*\}", "", match[1]), result_bytes(match[1]), runs[name],
                moved[0] if moved else inst.op_name, bool(moved),
                made_at.get(int(frame[1]), "") if frame else "",
                _repriced(match[1], match[2], dtypes) if dtypes else result_bytes(match[1])))
    return Report(tuple(found), unknown)


def partitioned_hlo(lowered: Any) -> tuple[Any, str]:
    """Compile a `jax.jit(...).lower(...)` result; return (compiled, the module's text as the
    SPMD partitioner left it, before the backend's own passes)."""
    with tempfile.TemporaryDirectory(prefix="k3text-hlo-") as tmp:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        dumps = sorted(pathlib.Path(tmp).glob("*after_spmd-partitioning*.txt"))
        return compiled, dumps[-1].read_text() if dumps else ""


def describe(report: Report, indent: str = "", layers: int = 0) -> Iterable[str]:
    """Lines for a program's report: totals by kind, bytes, parameter moves, the largest.
    `layers`: the model's depth, for a per-layer figure."""
    by_kind = ", ".join(f"{n:,} {k}" for k, n in sorted(report.count_by_kind().items()))
    per_layer = f" = {report.count / layers:.2f} per layer" if layers else ""
    yield (f"{indent}collectives per call: {report.count:,}{per_layer}"
           + (f" ({by_kind})" if by_kind else "")
           + f", {report.bytes / 1e6:,.3f} MB per device as compiled"
           + (f" ({report.partitioned_bytes / 1e6:,.3f} MB at the partitioner's dtypes, which "
              f"XLA:CPU widens)" if report.partitioned_bytes != report.bytes else "")
           + (f"; {report.unknown_trip_counts} loops of unknown trip count counted once"
              if report.unknown_trip_counts else ""))
    moving = report.moving_parameters()
    if moving:
        total = sum(c.bytes * c.per_call for c in moving)
        yield (f"{indent}!! {sum(c.per_call for c in moving):,} collectives move parameters "
               f"({total / 1e6:,.1f} MB per call), e.g. {moving[0].kind} {moving[0].result} of "
               f"{moving[0].op_name}")
    groups: dict[tuple[str, str, bool, str], list[Collective]] = {}
    for c in report.collectives:
        where = c.op_name if c.moves_parameter else c.source or c.op_name
        groups.setdefault((c.kind, c.result, c.moves_parameter, where), []).append(c)
    ranked = sorted(groups.items(), key=lambda kv: (kv[1][0].bytes,
                                                    sum(c.per_call for c in kv[1])),
                    reverse=True)
    if ranked:
        yield (f"{indent}  {'per call':>8s}   {'kind':14s} {'result (compiled)':32s} "
               f"{'MB each':>9s} {'partitioned':>11s}  source")
    for (_, _, _, where), group in ranked[:10]:  # the ten largest, like ones counted together
        c, per_call = group[0], sum(c.per_call for c in group)
        flag = "  <- parameter" if c.moves_parameter else ""
        yield (f"{indent}  {per_call:>8,} x {c.kind:14s} {c.result:32s} {c.bytes / 1e6:9.4f} "
               f"{c.partitioned_bytes / 1e6:11.4f}  {where[:96]}{flag}")
