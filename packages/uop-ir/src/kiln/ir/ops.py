"""The op vocabulary of the kernel AST and of lowered programs, with the groups the rest of kiln reasons about."""
from __future__ import annotations

from enum import Enum, IntEnum, auto


class Ops(IntEnum):
  # buffers, variables and structure
  DEFINE_GLOBAL = auto(); DEFINE_VAR = auto(); BIND = auto(); CONST = auto(); SINK = auto()
  RANGE = auto(); INDEX = auto(); LOAD = auto(); STORE = auto(); REDUCE = auto()
  # appear only after lowering
  SPECIAL = auto(); DEFINE_ACC = auto(); ACC_STORE = auto(); ENDRANGE = auto(); IF = auto(); ENDIF = auto()
  VECTORIZE = auto(); GEP = auto(); DEFINE_LOCAL = auto(); BARRIER = auto()
  FMA = auto()  # fused a*b+c, one rounding: only the lowering makes it (OptOps.FMA), never a user kernel
  # unary ALU
  NEG = auto(); EXP2 = auto(); LOG2 = auto(); SIN = auto(); SQRT = auto(); RECIPROCAL = auto(); TRUNC = auto()
  ERF = auto(); TANH = auto()  # GELU's exact (erf) and tanh-approximate forms
  CAST = auto(); BITCAST = auto()
  # binary ALU
  ADD = auto(); SUB = auto(); MUL = auto(); FDIV = auto(); IDIV = auto(); MOD = auto(); MAX = auto()
  CMPLT = auto(); CMPEQ = auto(); CMPNE = auto(); AND = auto(); OR = auto(); XOR = auto(); SHL = auto(); SHR = auto()
  # ternary ALU
  WHERE = auto(); MULACC = auto()
  DOT4 = auto()  # int32 only: c + the dot product of a's four bytes, unsigned, with b's four bytes, signed (x86 vpdpbusd, PTX dp4a.u32.s32)

  def __repr__(self) -> str: return f"Ops.{self.name}"
  def __str__(self) -> str: return f"Ops.{self.name}"


class AxisType(Enum):
  LOOP = "LOOP"  # a parallel axis of the output
  REDUCE = "REDUCE"  # closed by a REDUCE
  def __repr__(self) -> str: return f"AxisType.{self.name}"


class GroupOp:
  Unary = frozenset({Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIPROCAL, Ops.TRUNC, Ops.ERF, Ops.TANH})
  Binary = frozenset({Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE,
                      Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR})
  Ternary = frozenset({Ops.WHERE, Ops.MULACC, Ops.DOT4})
  ALU = Unary | Binary | Ternary
  Comparison = frozenset({Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE})
  Commutative = frozenset({Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR})
  Associative = frozenset({Ops.ADD, Ops.MUL, Ops.AND, Ops.OR, Ops.MAX})
  FloatOnly = frozenset({Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIPROCAL, Ops.FDIV, Ops.TRUNC, Ops.ERF, Ops.TANH})
  IntOnly = frozenset({Ops.IDIV, Ops.MOD, Ops.SHL, Ops.SHR, Ops.DOT4})
  Bitwise = frozenset({Ops.AND, Ops.OR, Ops.XOR})  # ints and bools
  ReduceOps = frozenset({Ops.ADD, Ops.MUL, Ops.MAX})
  Elementwise = ALU | {Ops.CAST, Ops.BITCAST}
  Lowered = frozenset({Ops.SPECIAL, Ops.DEFINE_ACC, Ops.ACC_STORE, Ops.ENDRANGE, Ops.IF, Ops.ENDIF, Ops.VECTORIZE, Ops.GEP, Ops.FMA,
                       Ops.DEFINE_LOCAL, Ops.BARRIER})  # only the lowering makes these: never in a kernel AST
