"""What a Numba CUDA kernel becomes on the H200, without a GPU: registers, spills, shared memory,
and the instruction mix of its loops in SASS (sm_90).

    python scripts/sass_report.py gemm                      # every GEMM candidate, forward layout
    python scripts/sass_report.py gemm --layout nt tt       # the backward layouts
    python scripts/sass_report.py gemm --tiles 128x128x16/8x16w64x64 --variant 3 --dump
    python scripts/sass_report.py flash-bf16                # the bf16 flash forward, D 64 and 128
    python scripts/sass_report.py flash-bf16-backward       # its backward's kernels, fused ones too
    python scripts/sass_report.py gemm-tf32 --layout nn nt tt  # the tf32 / 3xtf32 tensor-core GEMM

Pipeline: ``numba.cuda.compile_ptx`` (NVVM) -> ``ptxas -arch=sm_90 -v`` (with the kernel's register
cap) -> ``cuobjdump -sass``. Loops are found from backward branches; for each loop the report gives
its static instruction count (every path, cold bounds-checked ones too: ncu's executed count is
the truth; at 4096^3 the 8x16/w64x64 candidate executes 1.157 instructions per FFMA, cuBLAS 1.139)
and the densest inner loop, its FFMAs, shared and global loads, and instructions per FFMA: at one warp
instruction per cycle per scheduler, a loop of ``n`` instructions per FFMA runs the FMA units at
most ``1/n`` of their peak. "LDS -> first use" counts, for each shared load of that loop, the
instructions a warp issues before it reads what the load brought (through the back edge): under
~30 (the LDS latency) the warp stalls unless another warp of its scheduler has work.

Needs, besides numba-cuda: NVVM (a CUDA toolkit, or the ``nvidia-cuda-nvcc`` wheel), ``ptxas``,
and ``cuobjdump`` with ``nvdisasm`` (``pip install -e .[sass]`` brings those two and the
``nvidia-cuda-nvrtc`` that numba-cuda asks for). A missing tool is named in one line.
This is a developer's tool: the package never imports it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere in a checkout
    sys.path.insert(0, str(ROOT))

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)([.A-Z0-9_]*)\s*([^;]*);")
TARGET = re.compile(r"0x([0-9a-f]+)")


class ToolMissing(SystemExit):
    pass


def _tool(name: str) -> str:
    """Path of ``name`` on PATH, or in the ``nvidia/cu13/bin`` folder of a pip-installed wheel."""
    found = shutil.which(name)
    if found:
        return found
    site = Path(sysconfig.get_paths()["purelib"])
    for sub in ("cu13", "cu12", "cuda_nvcc", "cuda_cuobjdump"):
        cand = site / "nvidia" / sub / "bin" / name
        if cand.exists():
            return str(cand)
    raise ToolMissing(f"sass_report: '{name}' not found on PATH or in site-packages/nvidia/*/bin; "
                      f"pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (ptxas: a CUDA toolkit)")


@dataclass
class Loop:
    start: int  # address of the loop's first instruction
    end: int  # address of its backward branch
    ops: Counter = field(default_factory=Counter)

    @property
    def n(self) -> int:
        return sum(self.ops.values())

    def per_ffma(self) -> float:
        return self.n / self.ops["FFMA"] if self.ops["FFMA"] else float("inf")


@dataclass
class Report:
    name: str
    regs: int
    spill_stores: int
    spill_loads: int
    smem: int
    stack: int
    total: int
    ops: Counter
    loops: list[Loop]
    sass: str
    instrs: list = field(default_factory=list)  # (address, opcode, operands)
    extra: str = ""  # appended to line()

    def load_use(self, lp: Loop, op: str = "LDS") -> list[int]:
        """For each ``op`` load in loop ``lp``: how many instructions issue between it and the
        first instruction reading a register it writes, following the loop's back edge (a load
        whose value is first used ``d`` instructions later hides at most ``d`` issue cycles of its
        latency within the warp; ~30 cycles for LDS on sm_90)."""
        body = [(o, a) for addr, o, a in self.instrs if lp.start <= addr <= lp.end]
        out = []
        for i, (o, args) in enumerate(body):
            if o != op:
                continue
            m = re.match(r"R(\d+)", args)
            if not m:
                continue
            width = 4 if ".128" in self._mods(lp, i) else 2 if ".64" in self._mods(lp, i) else 1
            regs = {f"R{int(m.group(1)) + w}" for w in range(width)}
            for d in range(1, len(body) + 1):
                o2, a2 = body[(i + d) % len(body)]
                srcs = set(re.findall(r"(?<![A-Z])R\d+", a2.split(",", 1)[1] if "," in a2 else ""))
                if o2 in ("STS", "STG", "ST", "BAR"):  # stores read their first operand too
                    srcs |= set(re.findall(r"(?<![A-Z])R\d+", a2))
                if regs & srcs:
                    out.append(d - 1)
                    break
        return out

    def _mods(self, lp: Loop, i: int) -> str:
        return [m for addr, m in self._mod_list if lp.start <= addr <= lp.end][i]

    @property
    def _mod_list(self):
        return [(int(m.group(1), 16), m.group(4)) for m in INSTR.finditer(self.sass)]

    def bank_clashes(self, lp: Loop) -> int:
        """FFMAs of loop ``lp`` with two source registers of the same parity that are not read
        from the operand reuse cache: on Volta and later the register file has two banks
        (register number % 2), and two reads from one bank in one instruction take two cycles.
        (GEMM variants 12 and 13's first try: 633-637 of 1024 in the FMA loop against 161-192 for
        5 and 11, and 11-point slower kernels at long K.)"""
        n = 0
        for addr, op, args in self.instrs:
            if op != "FFMA" or not lp.start <= addr <= lp.end:
                continue
            srcs = [a.strip() for a in args.split(",")[1:]]
            banks = [int(a[1:]) % 2 for a in srcs if re.fullmatch(r"R\d+", a)]  # .reuse and RZ drop out
            n += len(banks) != len(set(banks))
        return n

    def main_loop(self) -> Loop | None:
        """The loop with the most FFMAs (then the most instructions): a GEMM's or attention's k loop."""
        return max(self.loops, key=lambda lp: (lp.ops["FFMA"], lp.n), default=None)

    def inner_loop(self) -> Loop | None:
        """The loop with the fewest instructions per FFMA (an FMA loop inside the k loop)."""
        fma = [lp for lp in self.loops if lp.ops["FFMA"]]
        return min(fma, key=Loop.per_ffma, default=None)

    def hot_path(self, trips) -> tuple[int, int]:
        """(instructions, FFMAs) one pass of the main loop executes when each FMA loop nested in
        it runs ``trips`` times (an int, or one count per nested loop in address order) and every
        other branch of the body is taken once: for a build without cold paths (a GEMM's
        ``edge_checks=False``), an interior tile's pair of k slices."""
        lp = self.main_loop()
        nested = sorted((x for x in self.loops if x is not lp and lp.start <= x.start and x.end <= lp.end
                         and x.ops["FFMA"]), key=lambda x: x.start)
        counts = [trips] * len(nested) if isinstance(trips, int) else list(trips)
        if len(counts) != len(nested):
            raise SystemExit(f"{self.name}: {len(nested)} FMA loops in the main loop, {len(counts)} trip counts given")
        n = lp.n + sum((c - 1) * x.n for c, x in zip(counts, nested))
        f = lp.ops["FFMA"] + sum((c - 1) * x.ops["FFMA"] for c, x in zip(counts, nested))
        return n, f

    def line(self) -> str:
        lp = self.main_loop()
        loop = "no loop"
        if lp is not None and not lp.ops["FFMA"]:  # a tensor-core loop: the report's extra says it
            loop = ""
        elif lp is not None:
            lds = lp.ops["LDS"]
            loop = (f"main loop {lp.n} instr, {lp.ops['FFMA']} FFMA, {lds} LDS, {lp.ops['LDG']} LDG, "
                    f"{lp.ops['BAR']} BAR: {lp.per_ffma():.3f} instr/FFMA (static: cold edge paths count)")
            inner = self.inner_loop()
            if inner is not lp:
                loop += f"; densest inner loop {inner.n} instr, {inner.per_ffma():.3f} instr/FFMA"
            dist = self.load_use(inner)
            if dist:
                loop += f"; LDS -> first use: min {min(dist)}, median {sorted(dist)[len(dist) // 2]} instr"
            if lp.ops["FFMA"]:
                loop += f"; FFMA bank clashes {self.bank_clashes(lp)} of {lp.ops['FFMA']}"
        spill = f"spill {self.spill_stores}/{self.spill_loads} B" if self.spill_stores or self.spill_loads else "no spill"
        if self.stack:
            spill += f", stack {self.stack} B"
        return f"{self.name:<44} {self.regs:3d} regs  {spill:<16} smem {self.smem:6d} B  {loop}{self.extra}"


def _parse_ptxas(text: str) -> dict:
    def grab(pat, default=0):
        m = re.search(pat, text)
        return int(m.group(1)) if m else default
    return {"regs": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "smem": grab(r"(\d+) bytes smem"),
            "stack": grab(r"(\d+) bytes stack frame")}


def _parse_sass(sass: str) -> tuple[list[tuple[int, str, str]], list[Loop]]:
    """Instructions as (address, opcode, operands) and the loops closed by backward branches."""
    instrs = []
    for m in INSTR.finditer(sass):
        instrs.append((int(m.group(1), 16), m.group(3), m.group(5)))
    loops = []
    for addr, op, args in instrs:
        if op in ("BRA", "JMP"):
            t = TARGET.search(args)
            if t and int(t.group(1), 16) < addr:
                start = int(t.group(1), 16)
                loops.append(Loop(start, addr, Counter(o for a, o, _ in instrs if start <= a <= addr)))
    # keep innermost-or-largest distinct loops: drop a loop that equals another's range
    seen, out = set(), []
    for lp in loops:
        if (lp.start, lp.end) not in seen:
            seen.add((lp.start, lp.end))
            out.append(lp)
    return instrs, out


def compile_report(name: str, py_func, sig, max_registers: int | None = None, cc=(9, 0)) -> Report:
    """Compile ``py_func`` for ``sig`` to sm_90 SASS and measure it (module docstring)."""
    from numba import cuda

    ptx, _ = cuda.compile_ptx(py_func, sig, cc=cc)
    arch = f"sm_{cc[0]}{cc[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        p, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(p).write_text(ptx)
        cmd = [_tool("ptxas"), f"-arch={arch}", "-v", p, "-o", cubin]
        if max_registers:
            cmd.insert(1, f"-maxrregcount={max_registers}")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"sass_report: ptxas failed for {name}: {r.stderr.strip()[-500:]}")
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(_tool("nvdisasm")) + os.pathsep + env.get("PATH", "")
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, env=env).stdout
    info = _parse_ptxas(r.stderr)
    instrs, loops = _parse_sass(sass)
    return Report(name=name, total=len(instrs), ops=Counter(o for _, o, _ in instrs), loops=loops, sass=sass,
                  instrs=instrs, **info)


def _dispatcher_report(name: str, kernel, sig) -> Report:
    opts = getattr(kernel, "targetoptions", {}) or {}
    return compile_report(name, kernel.py_func, sig, opts.get("max_registers"))


# ---- what to compile ---------------------------------------------------------------------------

def parse_tiles(text: str):
    """``128x128x16/8x16`` or ``128x128x16/8x16w64x64`` -> GemmTiles."""
    from vmstoolkit.kernels.gemm import GemmTiles

    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)/(\d+)x(\d+)(?:w(\d+)x(\d+))?", text.strip())
    if not m:
        raise SystemExit(f"sass_report: tiles {text!r} is not BMxBNxBK/TMxTN[wWMxWN]")
    g = [int(x) if x else 0 for x in m.groups()]
    return GemmTiles(*g)


def gemm_reports(args) -> list[Report]:
    from numba import int64, types

    from vmstoolkit.kernels import gemm as G

    arr = types.Array(types.float32, 2, "C")
    sig = (arr, arr, arr, arr, int64)
    if args.tiles:
        cands = [(args.variant, parse_tiles(t)) for t in args.tiles]
    else:
        cands = [(3, G.SMALL_TILES)] + [(G.PROPOSED_VARIANT, t) for t in G.V5_TILES]  # what the launch rules run
        cands += [(G.SKINNY_VARIANT, G.SKINNY_N_TILES), (G.SKINNY_VARIANT, G.SKINNY_M_TILES)]
    out = []
    for layout in args.layout:
        for v, t in dict.fromkeys(cands):
            k = G.get_kernel(v, t, layout)
            out.append(_dispatcher_report(f"gemm v{v} {t.label()} {layout}", k, sig))
            if args.hot:  # the interior-only build: its main loop is the hot path
                hot = _dispatcher_report("", G.get_kernel(v, t, layout, edge_checks=False), sig)
                n, f = hot.hot_path(_fma_trips(G, v, t))
                out[-1].extra = (f"; hot path (interior tile, 2 k slices, {hot.regs} regs): {n} instr, "
                                 f"{f} FFMA, {n / f:.3f} instr/FFMA")
    return out


def _fma_trips(G, v: int, t) -> int:
    """Trips of the FMA loop per k slice: variant 3 takes 4 k steps per trip, the
    double-buffered variant 2 (the rest of the slice unrolled)."""
    return (t.bk - 1) // 2 if G.VARIANTS[v].frag_db else t.bk // 4


def parse_flash_tiles(text: str):
    """``rows/heads/bkv/tr/tk/to[/blocks_per_sm][+flag...]``, e.g. ``32/4/32/4/4/4+dbuf`` -> FlashTiles
    (a flag sets that boolean field of FlashTiles)."""
    from dataclasses import fields

    from vmstoolkit.kernels.attention import FlashTiles

    shape, *flags = text.strip().split("+")
    parts = shape.split("/")
    names = {f.name for f in fields(FlashTiles) if f.type in (bool, "bool")}
    if len(parts) not in (6, 7) or not all(p.isdigit() for p in parts) or not set(flags) <= names:
        raise SystemExit(f"sass_report: flash tiles {text!r} is not rows/heads/bkv/tr/tk/to[/blocks_per_sm]"
                         f"[+flag], flags: {sorted(names)}")
    return FlashTiles(*map(int, parts), **{f: True for f in flags})


def attention_reports(args) -> list[Report]:
    """Variant 2 (``make_flash_kernel``) at hd = 128 for the bench's candidates (or ``--tiles``),
    with the row statistics (``lse``), as the training forward runs it."""
    from dataclasses import fields

    from numba import float32, int64, types

    from vmstoolkit.kernels import attention as A

    a3, a4, a5 = (types.Array(types.float32, n, "C") for n in (3, 4, 5))
    sig = (a4, a4, a4, a4, float32, a3, a5, a4, int64)
    if args.tiles:
        cands = [parse_flash_tiles(t) for t in args.tiles]
    else:
        cands = list(dict.fromkeys((A.FlashTiles(), *A.FLASH_CANDIDATES)))
    out = []
    for t in cands:
        k = A.make_flash_kernel(128, t, t.heads_for(4), True)
        flags = "".join(f"+{f.name}" for f in fields(t) if f.type in (bool, "bool") and getattr(t, f.name))
        label = f"flash {t.rows}r/{t.heads}h/{t.bkv}k {t.tr}x{t.tk}/{t.to} {t.threads}thr {t.blocks_per_sm}blk/SM{flags}"
        out.append(_dispatcher_report(label, k, sig))
    return out


def attention_backward_reports(args) -> list[Report]:
    """The attention backward's dq and dkv kernels at hd = 128, GQA group 4: variant 1
    (``BackwardTiles``, the default) and variant 2 (``FlashBackwardTiles``, or ``--tiles``)."""
    from numba import float32, types

    from vmstoolkit.kernels import attention_backward as AB

    a3, a4 = (types.Array(types.float32, n, "C") for n in (3, 4))
    sig_dq = (a4, a4, a4, a4, a3, a4, a4, float32)
    sig_dkv = (a4, a4, a4, a4, a3, a4, a4, a4, float32)
    out = []
    if not args.tiles:
        t = AB.BackwardTiles()
        k_dq, k_dkv = AB.make_backward_kernels(128, t)
        out.append(_dispatcher_report(f"bwd v1 dq {t.bq}q/{t.bkv}k", k_dq, sig_dq))
        out.append(_dispatcher_report(f"bwd v1 dkv {t.bkv}k/{t.bq_dkv}q", k_dkv, sig_dkv))
    cands = [AB.FlashBackwardTiles.parse(x) for x in args.tiles] if args.tiles else [
        AB.FlashBackwardTiles(), *AB.FLASH_BACKWARD_CANDIDATES]
    for t in cands:
        k_dq, k_dkv = AB.make_flash_backward_kernels(128, t, t.heads_for(4))
        out.append(_dispatcher_report(f"bwd v2 dq {t.rows}r/{t.heads}h/{t.bkv}k {t.tr}x{t.tk}/{t.to} "
                                      f"{t.dq_threads}thr", k_dq, sig_dq))
        out.append(_dispatcher_report(f"bwd v2 dkv {t.keys}k/{t.bq}q {t.tkk}x{t.tq}/{t.tko} "
                                      f"{t.dkv_threads}thr", k_dkv, sig_dkv))
    return out


def flash_bf16_reports(args) -> list[Report]:
    """The bf16 flash-attention forward (``kernels/flash_bf16.py``) at head dims 64 and 128, with
    lse, cp.async fetches, for the bench's tile shapes (``--tiles`` as ``warps/bkv``)."""
    from numba import float32, int64, types

    from vmstoolkit.kernels import flash_bf16 as FB

    u4, f3 = types.Array(types.uint16, 4, "A"), types.Array(types.float32, 3, "A")
    sig = (u4, u4, u4, u4, f3, float32, int64)
    cands = ([FB.FlashBf16Tiles(*map(int, t.split("/"))) for t in args.tiles] if args.tiles
             else [FB.GPU_TILES, FB.FlashBf16Tiles(4, 32), FB.FlashBf16Tiles(8, 64)])
    return [compile_report(f"flash_bf16 d{d} {t.label()}", FB.python_kernel(d, t), sig, 255)
            for d in (64, 128) for t in cands]


def flash_bf16_backward_reports(args) -> list[Report]:
    """The bf16 flash backward's kernels (``kernels/flash_bf16.py``) at head dims 64 and 128: the dQ
    and dK/dV kernels, and the fused one with a block per GQA group and per query head, on the
    default tiles (or ``--tiles`` as ``warps/bkv``). ``extra``: the main loop's HMMA, LDS, LDG (a
    global load inside the walk is a stall the loop waits on) and atomics."""
    from numba import float32, int64, types

    from vmstoolkit.kernels import flash_bf16 as FB

    u4, f3, f4 = (types.Array(types.uint16, 4, "A"), types.Array(types.float32, 3, "A"),
                  types.Array(types.float32, 4, "C"))
    sc = (float32, float32, int64)
    cands = [FB.FlashBf16Tiles(*map(int, t.split("/"))) for t in args.tiles] if args.tiles else [FB.GPU_TILES]
    out = []
    for d in (64, 128):
        for t in cands:
            k_dq, k_dkv = FB.python_backward_kernels(d, t)
            kernels = [(f"dq d{d} {t.label()}", k_dq, (u4,) * 4 + (f3, f3, u4) + sc),
                       (f"dkv d{d} {t.label()}", k_dkv, (u4,) * 4 + (f3, f3, u4, u4) + sc)]
            for split in (False, True):
                fn = FB._build(FB._dkvq_source(d, t, True, split), "<fused>")
                kernels.append((f"fused{' split' if split else ''} d{d} {t.label()}", fn,
                                (u4,) * 4 + (f3, f3, u4, u4, f4, f4, f4) + sc))
            for label, fn, sig in kernels:
                rep = compile_report(f"flash_bf16 bwd {label}", fn, sig, 255)
                lp = rep.main_loop()
                if lp is not None:
                    rep.extra = (f"main loop {lp.n} instr, {lp.ops['HMMA']} HMMA, {lp.ops['LDS'] + lp.ops['LDSM']} "
                                 f"LDS/LDSM, {lp.ops['LDG']} LDG, {lp.ops['RED']} RED")
                out.append(rep)
    return out


def gemm_tf32_reports(args) -> list[Report]:
    """The tf32 tensor-core GEMM (``kernels/gemm_tf32.py``), both precisions, cp.async fetches,
    plain stores, on its default tiles (or ``--tiles`` as ``BMxBNxBK/wWMxWN/sSTAGES``). Its mma
    loop has no FFMA: read the HMMA count (``ops``) and instructions per HMMA from ``--dump``."""
    from numba import int64, types

    from vmstoolkit.kernels import gemm_tf32 as GT

    arr = types.Array(types.float32, 2, "A")
    sig = (arr, arr, arr, arr, int64)
    cands = [GT.GPU_TILES]
    if args.tiles:
        cands = []
        for text in args.tiles:
            m = re.fullmatch(r"(\d+)x(\d+)x(\d+)/w(\d+)x(\d+)/s(\d+)", text.strip())
            if not m:
                raise SystemExit(f"sass_report: tf32 tiles {text!r} is not BMxBNxBK/wWMxWN/sSTAGES")
            bm, bn, bk, wm, wn, st = map(int, m.groups())
            cands.append(GT.Tf32Tiles(bm=bm, bn=bn, wm=wm, wn=wn, stages=st, bk=bk))
    out = []
    for layout in args.layout:
        a_trans, b_trans = GT.LAYOUTS[layout]
        for t in cands:
            for precision in GT.PRECISIONS:
                k = GT.make_gemm_tf32(t, a_trans, b_trans, precision)
                rep = _dispatcher_report(f"gemm_tf32 {precision} {t.label()} {layout}", k, sig)
                lp = rep.main_loop()
                if lp is not None:
                    hmma = lp.ops["HMMA"]
                    rep.extra = (f"main loop {lp.n} instr, {hmma} HMMA, {lp.ops['LDS']} LDS"
                                 + (f": {lp.n / hmma:.2f} instr/HMMA" if hmma else ""))
                out.append(rep)
    return out


def _device_cc_without_a_driver(cc=(9, 0)) -> None:
    """numba-cuda compiles a kernel's ``cuda.jit(device=True)`` callees for the current device's
    compute capability, which needs a driver; without one, name ``cc`` (what compile_ptx targets)."""
    from numba.cuda import dispatcher

    try:
        dispatcher.get_current_device()
    except Exception:  # noqa: BLE001 - no driver (CudaSupportError) or no device
        class _Device:
            compute_capability = cc

        dispatcher.get_current_device = lambda: _Device()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["gemm", "attention", "attention-backward", "flash-bf16", "flash-bf16-backward",
                                     "gemm-tf32"])
    ap.add_argument("--layout", nargs="+", default=["nn"], choices=["nn", "nt", "tt"])
    ap.add_argument("--tiles", nargs="+", help="GEMM tile shapes BMxBNxBK/TMxTN[wWMxWN], or attention's "
                    "rows/heads/bkv/tr/tk/to[/blocks_per_sm], or attention-backward's "
                    "rows/heads/bkv/tr/tk/to/keys/bq/tkk/tq/tko (default: the candidates)")
    ap.add_argument("--variant", type=int, default=3,
                    help="GEMM variant for --tiles (3: capped registers, 5: 3 with double-buffered "
                         "fragments, 11: 5 with 16-byte global loads; gemm.VARIANTS)")
    ap.add_argument("--dump", action="store_true", help="print the main loop's SASS")
    ap.add_argument("--hot", action="store_true", help="GEMM: also build without the edge tiles' bounds "
                    "checks and count the instructions an interior tile executes per pair of k slices")
    args = ap.parse_args(argv)
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    _device_cc_without_a_driver()
    reports = {"gemm": gemm_reports, "attention": attention_reports,
               "attention-backward": attention_backward_reports, "flash-bf16": flash_bf16_reports,
               "flash-bf16-backward": flash_bf16_backward_reports, "gemm-tf32": gemm_tf32_reports}[args.what](args)
    for rep in reports:
        print(rep.line(), flush=True)
        if args.dump and rep.main_loop() is not None:
            lp = rep.main_loop()
            for ln in rep.sass.splitlines():
                m = INSTR.search(ln)
                if m and lp.start <= int(m.group(1), 16) <= lp.end:
                    print("   ", ln.strip().split(";")[0] + ";")
            print("    ops:", dict(lp.ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
