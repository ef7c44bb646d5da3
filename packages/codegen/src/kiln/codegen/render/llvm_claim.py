"""The entry points of a CPU kernel beside its own: a split kernel's claim loop, which each thread runs (docs/architecture.md,
"The thread split"), and every kernel's task entry, which the runtime's native code calls (the pool's workers, a plan's
sequence runner). LLVM IR text, like the rest of the renderer."""
from __future__ import annotations


def claim_loop(name: str, params: list[str], chunks: int, finish: bool = False, slot_bytes: int = 0, scratch: bool = False) -> list[str]:
  """The entry of a kernel split into `chunks` chunks: `void NAME(params..., i32 slot, ptr claim[, ptr scratch])`, where
  `params` are the chunk body's own buffer and variable parameters. Each thread the runtime runs calls it with its own
  slot; it takes chunk after chunk from the shared counter at `claim` (an atomic add: whoever is free takes the next)
  until none is left, handing each to NAME.chunk (with its slot's `slot_bytes` of the scratch when those are per
  thread). slot -1 is the finishing call (`finish`): chunk == chunks folds a split reduction's partials."""
  args = _passed(params)
  def call(chunk: str, scr: str) -> str:
    return f"  call void @{name}.chunk({', '.join([*args, f'i32 {chunk}', *([f'ptr {scr}'] if scratch else [])])})"
  entry_params = [*params, "i32 %slot", "ptr %claim", *(["ptr noalias %scratch"] if scratch else [])]
  lines = [f"define void @{name}({', '.join(entry_params)}) #0 {{", "entry:", "  %fin = icmp slt i32 %slot, 0",
           "  br i1 %fin, label %finish, label %start", "finish:", *([call(str(chunks), "%scratch")] if finish else []),
           "  ret void", "start:"]
  mine = "%scratch"
  if slot_bytes and scratch:  # PACK panels and KEEP rows: each slot's own
    lines += ["  %slot64 = sext i32 %slot to i64", f"  %off = mul i64 %slot64, {slot_bytes}", "  %mine = getelementptr i8, ptr %scratch, i64 %off"]
    mine = "%mine"
  lines += ["  br label %next", "next:", "  %c = atomicrmw add ptr %claim, i32 1 monotonic",
            f"  %more = icmp slt i32 %c, {chunks}", "  br i1 %more, label %run, label %done", "run:", call("%c", mine),
            "  br label %next", "done:", "  ret void", "}"]
  return lines + task_entry(name, entry_params)


def task_entry(name: str, params: list[str]) -> list[str]:
  """`void NAME.task(ptr args, i32 slot)`: the entry's parameters `params` from an int64 block (every one but the slot,
  in order), for the runtime's native code, which calls any kernel through this one signature. An unsplit kernel takes
  no slot: its task ignores it."""
  args = _passed(params)
  lines = [f"define void @{name}.task(ptr %args, i32 %slot) #0 {{", "entry:"]
  for i, a in enumerate(x for x in args if x != "i32 %slot"):
    ty, reg = a.split()
    lines += [f"  %a{i}.p = getelementptr i64, ptr %args, i64 {i}", f"  %a{i} = load i64, ptr %a{i}.p, align 8",
              f"  {reg} = {'inttoptr' if ty == 'ptr' else 'trunc'} i64 %a{i} to {ty}"]
  return [*lines, f"  call void @{name}({', '.join(args)})", "  ret void", "}"]


def _passed(params: list[str]) -> list[str]:
  """Parameters as a call passes them: "ptr noalias align 4 %data0" is "ptr %data0"."""
  return [f"{p.split()[0]} {p.split()[-1]}" for p in params]
