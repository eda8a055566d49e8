"""Launch rules of the fp32 GEMM (:mod:`.gemm`) and the H200 measurements behind them: which
variant, tile shape (:class:`GemmTiles`) and k split an (m, n, k) problem gets.

- "proposed" (Note [split k against wave tails]): variant 13 on 4 warps of 64 x 64 at 128 x 128
  tiles, k split where a launch's last wave would run mostly empty; outputs too small to fill half
  the SMs even split take the small-tile path (variant 3 on 64 x 64 tiles);
- "skinny" (every layout's default): "proposed", except outputs at most SKINNY_MAX wide, which
  take the skinny tiles.

Thresholds scale with the device's SM count (:func:`._util.sm_count`: the current device's, the
H200's 132 under the simulator). Under the simulator :func:`choose` runs the rule's variant on
tiny tiles. Cost: every function here is O(1) (``proposed_splits`` tries MAX_SPLITS counts).
"""

from __future__ import annotations

from dataclasses import dataclass

from vmstoolkit.errors import KernelError

from ._util import simulating, sm_count

# layout -> (A stored transposed, B stored transposed); the forward is nn, dx nt, dw tt
LAYOUTS = {"nn": (False, False), "nt": (False, True), "tt": (True, True), "tn": (True, False)}


@dataclass(frozen=True)
class GemmTiles:
    """Tile shape of the register-blocked GEMM: ``bm x bn`` outputs per block, k slices of ``bk``,
    a ``tm x tn`` micro-tile per thread. ``wm x wn`` is the warp tile (0 = no warp tiling: the
    block's threads form one grid over the whole block tile). The launcher picks with
    :func:`choose` (measured)."""

    bm: int = 128  # rows of C per block
    bn: int = 128  # columns of C per block
    bk: int = 16  # depth of the k slice staged in shared memory
    tm: int = 8  # rows per thread
    tn: int = 8  # columns per thread
    wm: int = 0  # rows per warp tile (0: none)
    wn: int = 0  # columns per warp tile

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    @property
    def group_tile(self) -> tuple[int, int]:
        """(rows, columns) covered by one group of threads whose micro-tiles interleave: a warp
        tile, or the whole block tile without warp tiling."""
        return (self.wm, self.wn) if self.wm else (self.bm, self.bn)

    def label(self) -> str:
        warp = f" w{self.wm}x{self.wn}" if self.wm else ""
        return f"{self.bm}x{self.bn}x{self.bk}/{self.tm}x{self.tn}{warp}"

    def check(self) -> None:
        if self.bm % self.tm or self.bn % self.tn:
            raise KernelError(f"tile {self}: bm % tm and bn % tn must be 0")
        t = self.threads
        if (self.bm * self.bk) % t or (self.bn * self.bk) % t:
            raise KernelError(
                f"tile {self}: bm*bk={self.bm * self.bk} and bn*bk={self.bn * self.bk} must be "
                f"multiples of the {t} threads"
            )
        if t > 1024:
            raise KernelError(f"tile {self} needs {t} threads per block (> 1024)")
        if self.bk % 4:
            raise KernelError(f"tile {self}: bk must be a multiple of 4 (the k loop is unrolled by 4)")
        if bool(self.wm) != bool(self.wn):
            raise KernelError(f"tile {self}: give both wm and wn, or neither")
        if self.wm:
            if self.bm % self.wm or self.bn % self.wn or self.wm % self.tm or self.wn % self.tn:
                raise KernelError(f"tile {self}: the warp tile must divide the block tile and be a "
                                 f"multiple of the micro-tile")
            if (self.wm // self.tm) * (self.wn // self.tn) != 32:
                raise KernelError(f"tile {self}: a {self.wm}x{self.wn} warp tile of {self.tm}x{self.tn} "
                                 f"micro-tiles needs {(self.wm // self.tm) * (self.wn // self.tn)} threads, "
                                 f"not a warp of 32")


# Tiny tiles for the CPU simulator: 16 threads, each a 2 x 2 micro-tile (same code path).
SIM_TILES = GemmTiles(bm=8, bn=8, bk=4, tm=2, tn=2)


@dataclass(frozen=True)
class GemmLaunch:
    """What the launcher runs: a variant, its tile shape, and how many k splits."""

    variant: int
    tiles: GemmTiles
    splits: int = 1




def split_target_blocks() -> int:
    """Split k up to this many blocks: two per SM of the current device (the simulator: the H200's 132)."""
    return 2 * sm_count()


# The small-tile path, for outputs under half an SM's worth of 128 x 128 tiles split MAX_SPLITS
# ways (16 tiles on the H200's 132 SMs): variant 3 on 64 x 64
# tiles (96 registers), k split until about split_target_blocks() blocks, each split at least
# MIN_SMALL_SLICES slices deep; partial tiles are added atomically into a zeroed y. H200
# (experiments/results/gemm-h200/, 1024 x 512 x 2048): 44-47% of cuBLAS unsplit, 50.0% split 2
# (two blocks per SM; rounding the split count down measured best: 3 splits left 384 blocks).
SMALL_TILES = GemmTiles(bm=64, bn=64, bk=16, tm=4, tn=4)
MIN_SMALL_SLICES = 8

# Variant 5's tiles (offline, sm_90, ptxas 13.0): 4 warps of 64x64, 8x16 outputs per thread:
# 128 FMAs per 24 operands loaded, 246 / 236 / 223 registers in the nn / nt / tt layouts (no
# spill, two 128-thread blocks per SM), 1.086 SASS instructions per FFMA in the FMA loop (the
# 2-step loop's 64-bit counter: 10 instructions per 256 FFMA besides the 12 LDS), every LDS read
# >= 33 instructions after it issues. The H200 also timed (runs 4 and 5, all slower at every
# shape, removed): this shape at bk 8; 8 warps of 32x64 / 8x8 per thread at bk 8 and 16; 4 warps
# of 64x32 over 128x64 tiles; 128x128x8/8x8 and 128x128x16/8x8 without warp tiles (the old rule's).
V5_TILES = (GemmTiles(bm=128, bn=128, bk=16, tm=8, tn=16, wm=64, wn=64),)


def _blocks(m: int, n: int, t: GemmTiles) -> int:
    return -(-m // t.bm) * -(-n // t.bn)


# The proposed rule, every layout's: variant 13 (variant 5 with 16-byte global loads and staged
# 16-byte stores; variant 11 on an output or accumulator that is not 16-byte aligned, 5 on operands
# that are not) on 4 warps of 64x64 (8x16 outputs per thread) at 128x128 tiles, two blocks per SM,
# k split in ``proposed_splits`` ways; outputs that even MAX_SPLITS splits of these tiles would
# leave under half the SMs take the small-tile path.
# H200, experiments/gemm_sweep.py, 2026-12-02 (experiments/results/gemm-h200/run8/v13/), % of
# cuBLAS fp32 (TF32 off), the GPU's time alone ("held": best of 7 batches of 5 launches queued
# behind a spin), the 7B block at 2048 tokens (GQA8: 8 kv heads), variant 13 (variant 11, the
# rule's before, beside it in the same run):
#                4096^3        q/o 2048x4096x4096   k/v GQA8 2048x1024x4096   gate/up 2048x11008x4096   down 2048x4096x11008
#   forward   92.2 (90.7)      92.6 (90.6)          90.2 (89.0), split 2       92.7 (95.1)               91.1 (90.2)
#   dx (nt)   93.0 (92.1)      91.9 (90.9)          92.8 (85.1)                93.8 (93.8)               86.3 (85.5)
#   dw (tt)   93.7 (93.1)      91.6 (90.0)          92.0 (87.8)                92.2 (91.2)               92.5 (90.9)
# (Sweep 7, run7/, timed the first launch's host cost too: variant 11 at 83.0-93.6.)
# The rule before variant 5 ("measured": variant 3 at 128x128x8/8x8 for several waves, variant 4
# at 128x128x16/8x8 for one to three) reached 60.8-70.7% forward, 63.0-84.4% backward in run 5.
PROPOSED_TILES = V5_TILES[0]
PROPOSED_VARIANT = 13
MIN_SPLIT_SLICES = 16
RULES = ("proposed", "skinny")
# every layout runs "skinny" by default: "proposed", except on outputs at most SKINNY_MAX wide (below)
DEFAULT_RULE = "skinny"

# Note [split k against wave tails]
# ---------------------------------
# A launch of B blocks runs in ceil(B / T) waves (two blocks per SM); split k
# in s ways and each block does 1/s of the work in ceil(B s / T) waves, at the
# price of zeroing the output and adding s partial tiles atomically: cost(s) = ceil(B s / T) / s
# x (1 + SPLIT_COST (s - 1)), T = split_target_blocks() (2 per SM). The rule takes the cheapest s up to
# MAX_SPLITS (each split at least MIN_SPLIT_SLICES slices deep) if it saves more than SPLIT_GAIN
# of cost(1), else launches whole tiles (deterministic sums, no atomics).
# H200, forward, variant 5 on PROPOSED_TILES split 1 / 2 / 3 / 4 ways, % of cuBLAS fp32, and the
# rule's launch (experiments/results/gemm-h200/run6/1b-splits/: the 1B widths at 1024 tokens):
#   gate/up 1024x5632x2048 (352 tiles)   57.7 / 69.3 / 73.4 / 64.3   rule 3: 73.4 (cost 2, 1.56, 1.44, 1.68)
#   k/v GQA4 1024x512x2048 (32 tiles)    24.2 / 42.0 / 56.0 / 67.0   rule 4: 65.6 (the old small-tile path: 40-50)
#   down 1024x2048x5632 (128 tiles)      72.8 / 79.4 / 58.9 / 75.9   rule 2: 79.4 (cost 1, 0.52, 0.72, 0.56)
#   q/o 1024x2048x2048 (128 tiles)       73.1 / 73.2 / 55.3 / 67.0   rule 2: 72.8
#   4096^3 (1024 tiles)                  82.5 / 78.9 / 77.1 / 75.7   rule 1: 82.5
# and at the 7B widths (run7/splits/, variant 5 / variant 11 split 1 and 2): k/v GQA8 (128 tiles)
# 75.7 / 79.9 and 80.3 / 87.0 (the rule splits 2); gate/up (1376 tiles, 5.2 waves) 82.1 / 85.3
# and 94.8 / 93.2: the model's best there, split 2, saves 4.7% of the waves, under SPLIT_GAIN, and
# the rule keeps it whole, which with variant 11's faster slices is also the faster launch;
# 4096^3, q/o and down (512-1024 tiles) lose 1.5-5 points split 2 and stay whole.
SPLIT_COST = 0.04
SPLIT_GAIN = 0.10
MAX_SPLITS = 4


def split_cost(blocks: int, splits: int) -> float:
    """Relative time of ``blocks`` tiles with k split ``splits`` ways (Note [split k against wave tails])."""
    target = split_target_blocks()
    return -(-blocks * splits // target) / splits * (1 + SPLIT_COST * (splits - 1))


def proposed_splits(blocks: int, k_steps: int) -> int:
    """The proposed rule's k splits for ``blocks`` big tiles ``k_steps`` slices deep."""
    top = max(1, min(MAX_SPLITS, k_steps // MIN_SPLIT_SLICES))
    best = min(range(1, top + 1), key=lambda s: (split_cost(blocks, s), s))
    return best if split_cost(blocks, best) < (1 - SPLIT_GAIN) * split_cost(blocks, 1) else 1


def _choose_proposed(m: int, n: int, k: int, splits: int | None) -> GemmLaunch:
    t = PROPOSED_TILES
    blocks = _blocks(m, n, t)
    if blocks * MAX_SPLITS < sm_count() // 2:
        return _choose_small(m, n, k, splits)
    if splits is None:
        splits = proposed_splits(blocks, -(-k // t.bk))
    return GemmLaunch(PROPOSED_VARIANT, t, splits)


# The "skinny" rule, every layout's since H200 sweep 6: "proposed", except for outputs at most SKINNY_MAX
# columns (rows) wide, e.g. LoRA's rank-16 GEMMs at 2048 tokens and 4096 features: x A^T (2048 x 16,
# K = 4096), its dx's dy B (2048 x 16, K = 4096), dw's dy^T x (16 x 4096, K = 2048) and (4096 x 16,
# K = 2048). "proposed" runs those on 64 x 64 tiles (3/4 of every FMA on padding)
# with k split 4-8 ways: ~1.07 GFLOP issued for 0.27 useful. Their lower bound is reading the
# 32 MiB operand (~8 us on the H200); at the small tiles' ~45% of cuBLAS (~22 TFLOP/s) they take
# ~50 us. The skinny tiles (128 x 16 or 16 x 128, 4 x 4 per thread, 128 threads) waste nothing
# on a 16-wide output, read the wide operand once, and split k until about SKINNY_BLOCKS_PER_SM
# blocks (4 of 128 threads per SM: these are memory-bound), each split at least MIN_SKINNY_SLICES
# slices deep. The K = 16 GEMMs (h B^T: 2048 x 4096 x 16, dx of x A^T) keep "proposed" (512
# tiles of 128 x 128, one k slice each; bound by writing the 32 MiB output).
# H200, sweep 6 (experiments/results/gemm-h200/run6/lora/), % of cuBLAS fp32, "proposed" / "skinny":
# x A^T 39.2 / 43.1, dw of x A^T 37.4 / 41.7, dw of h B^T 24.9 / 44.1, dx of h B^T (dy B) 26.2 / 26.1.
# Each is 20-120 us; the skinny tiles halving their splits (gemm_sweep's third candidate) moved
# them by -0.9 to +1.1 points.
SKINNY_MAX = 32
SKINNY_N_TILES = GemmTiles(bm=128, bn=16, bk=16, tm=4, tn=4)  # 32 x 4 threads, each 4 x 4
SKINNY_M_TILES = GemmTiles(bm=16, bn=128, bk=16, tm=4, tn=4)  # 4 x 32 threads
# Variant 5, not 11: on these tiles only the wide operand fits 16-byte loads, and H200 sweep 7
# (experiments/results/gemm-h200/run7/lora/) timed variant 11 4-7 points under 5 at all four
# 16-wide LoRA GEMMs (e.g. x A^T: 39.1 against 46.8% of cuBLAS).
SKINNY_VARIANT = 5
SKINNY_BLOCKS_PER_SM = 4  # split k until about this many skinny blocks per SM
MIN_SKINNY_SLICES = 8


def _choose_skinny(m: int, n: int, k: int, splits: int | None) -> GemmLaunch:
    if min(m, n) > SKINNY_MAX:
        return _choose_proposed(m, n, k, splits)
    t = SKINNY_N_TILES if n <= m else SKINNY_M_TILES
    if splits is None:
        k_steps = -(-k // t.bk)
        splits = max(1, min(SKINNY_BLOCKS_PER_SM * sm_count() // _blocks(m, n, t), k_steps // MIN_SKINNY_SLICES))
    return GemmLaunch(SKINNY_VARIANT, t, splits)


def choose(m: int, n: int, k: int, splits: int | None = None, rule: str | None = None,
           layout: str = "nn") -> GemmLaunch:
    """The launch for an (m, n, k) problem of ``layout`` by ``rule`` (default :data:`DEFAULT_RULE`,
    every layout's; the rules and their measurements are above). Under the simulator: the
    rule's variant on the tiny tiles. ``splits`` forces that many k splits."""
    launch = rule_launch(m, n, k, splits, rule, layout)
    if simulating():  # the rule's variant on the tiny tiles: the simulator runs the GPU's code path
        return GemmLaunch(launch.variant, SIM_TILES, splits or 1)
    return launch


def rule_launch(m: int, n: int, k: int, splits: int | None = None, rule: str | None = None,
                layout: str = "nn") -> GemmLaunch:
    """What ``rule`` (default :data:`DEFAULT_RULE`) launches on a GPU for an
    (m, n, k) problem, also under the simulator (where :func:`choose` runs tiny tiles instead)."""
    if layout not in LAYOUTS:
        raise KernelError(f"unknown GEMM layout {layout!r}; known: {', '.join(LAYOUTS)}")
    rule = rule or DEFAULT_RULE
    if rule not in RULES:
        raise KernelError(f"unknown GEMM launch rule {rule!r}; known: {', '.join(RULES)}")
    if rule == "proposed":
        return _choose_proposed(m, n, k, splits)
    return _choose_skinny(m, n, k, splits)


def _choose_small(m: int, n: int, k: int, splits: int | None) -> GemmLaunch:
    if splits is None:
        k_steps = -(-k // SMALL_TILES.bk)
        splits = max(1, min(split_target_blocks() // _blocks(m, n, SMALL_TILES), k_steps // MIN_SMALL_SLICES))
    return GemmLaunch(3, SMALL_TILES, splits)
