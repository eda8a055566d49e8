"""Train the traces' LLaMA three ways on a GPU: PyTorch default, expandable_segments, vmstoolkit.

    python experiments/train_llama_gpu.py --out DIR [--variants full,ckpt,lora,offload]
        [--modes default,expandable,vms] [--rounds 3] [--steps-per-round 6] [--repeats 1] [--cpus N]
        [--snapshots DIR] [--gc-between-steps]
    python experiments/train_llama_gpu.py --out DIR --summary-of DIR/train.jsonl [--variants ...] [--modes ...]
    python experiments/train_llama_gpu.py --model llama3-1b --plan [--rounds 3] [--steps-per-round 6]

``--model`` (``MODELS`` below) picks what trains; ``llama``, the default, is the traces' model.
``llama3-1b`` is a LLaMA-3-style decoder with a large vocabulary (128256; hidden 2048, 16 layers,
32 heads, 8 KV heads, FFN 8192, untied head: 1.5 B parameters), weights in bf16, full fine-tuning
with AdamW, batch from {4, 6, 8} and any sequence length from 200 to 2048 per step: every step's
sizes differ, the workload of issue 34's "no cost when shapes change" (its held-out Qwen2-style
decoder is deliberately not this one). ``resnet50`` (channels-last) and ``vit-b16`` train at
224x224 under bf16 autocast with AdamW, batch from 64 to 192 per step; they are built with
torchvision if the machine has it, else timm, else transformers (``model_impl`` in each row says
which). These three draw every step of the run afresh (``llama`` repeats its round). Every row
carries ``model`` and ``shapes``; ``--plan`` prints a model's description and its steps' shapes
per round as JSON and runs nothing (no torch needed). The rest of this text is about ``llama``.

The model and workloads are those of ``vmstoolkit/data/traces``: a LLaMA-architecture causal LM
(hidden 2048, 12 layers, 16 heads, FFN 5504, vocab 32000), random weights (seed 0), AdamW,
bf16 autocast, SDPA attention; each step draws batch from {4, 6, 8} and sequence length from
256..2048 (seeded), the same shapes in every mode. Variants: ``full``; ``ckpt`` (gradient
checkpointing); ``lora`` (peft r=16 on every projection + checkpointing); ``offload``
(activations saved to pinned CPU memory). Each (mode, variant) runs in its own process, since
allocator settings are fixed at a process's first CUDA allocation. A mode naming a vmstoolkit
allocator runs it with its options, in the library's one syntax (``vms:max_cached_stitched=1024``,
``paged:aliases=true,slack_pages=64``; commas inside a mode do not split ``--modes``, and the old
``+`` between options is still read): ``paged`` through its compiled hook, ``vms`` through Python
callbacks. Reference modes, to see where a hooked allocator's time goes: ``async`` (PyTorch's
``backend:cudaMallocAsync``, the driver's stream-ordered pool, no hook) and ``hook-async`` /
``hook-async-gil`` (that pool behind PyTorch's hook, without and with the GIL the ``paged`` hook
takes: "Reference hooks" below).

Per run: losses of every step, step times (median of the rounds after the first: steady
state), the host's share of each step (``enqueue_times``: until the host has queued the whole
step, before it waits for the GPU; ``cpu_times``: CPU seconds of the process, every thread),
peak allocated and peak reserved (PyTorch's counters; for vmstoolkit the allocator's, which are
what its driver holds; for the reference hooks the driver pool's high-water marks), and
utilization. Output: ``DIR/train.jsonl`` and a summary (``DIR/summary.json``; ``--summary-of``
makes it again from a ``train.jsonl``, on any machine).
``--repeats N`` runs the modes N times, interleaved, and the summary compares the medians of
all the repeats' steady steps together: LoRA's step time moves by up to ±10% from one process
to the next (``experiments/results/train-h200/`` runs 15-20; ``pool_runs.py`` pools several
calls, with an interval).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from common import PYTORCH_MODES, allocator_mode, same_mode, split_modes, train_shapes
from vmstoolkit.errors import ConfigError

HIDDEN, LAYERS, HEADS, FFN, VOCAB = 2048, 12, 16, 5504, 32000

# -- Models: what trains (--model) ---------------------------------------------------------------------

LLAMA3_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=2048, rope_theta=500000.0,
                 tie_word_embeddings=False)
"""``llama3-1b``: LLaMA-3.2-1B's shape with its head untied (transformers' ``LlamaConfig`` keywords)."""
SEQ_RANGE = (200, 2048)  # llama3-1b: any sequence length in this range, inclusive, per step
QWEN2_HELDOUT = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=12, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=2048, rope_theta=1000000.0,
                     tie_word_embeddings=True)
"""``qwen2-heldout``: issue 34's held-out decoder (12 layers, 1536 wide, 2 KV heads, a 152k vocabulary;
Qwen2-1.5B's widths and tied head, transformers' ``Qwen2Config`` keywords). It was never tuned on:
it runs only with settings chosen on ``llama3-1b`` and the vision models."""
QWEN2_SEQ_RANGE = (317, 2048)  # qwen2-heldout: the sequence lengths, inclusive, per step
IMAGE_BATCH_RANGE = (64, 192)  # resnet50, vit-b16: any batch in this range, inclusive, per step
IMAGE_SIZE, IMAGE_CLASSES = 224, 1000
DEVICE = "cuda"

MODELS = {
    "llama": {"variants": ("full", "ckpt", "lora", "offload"),
              "about": f"the traces' LLaMA: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, FFN {FFN}, vocab {VOCAB}; "
                       "fp32 weights, bf16 autocast, AdamW; batch {4, 6, 8}, sequence 256..2048 step 128"},
    "llama3-1b": {"variants": ("full", "ckpt"),
                  "about": "LLaMA-3-style decoder: " + ", ".join(f"{k} {v}" for k, v in LLAMA3_1B.items())
                           + f"; bf16 weights, AdamW; batch {{4, 6, 8}}, sequence {SEQ_RANGE[0]}..{SEQ_RANGE[1]}"},
    "qwen2-heldout": {"variants": ("full",),
                      "about": "Qwen2-style decoder (held out): " + ", ".join(f"{k} {v}" for k, v in QWEN2_HELDOUT.items())
                               + f"; bf16 weights, AdamW; batch {{4, 6, 8}}, sequence {QWEN2_SEQ_RANGE[0]}..{QWEN2_SEQ_RANGE[1]}"},
    "resnet50": {"variants": ("full",),
                 "about": f"ResNet-50, channels-last, bf16 autocast, AdamW; {IMAGE_SIZE}x{IMAGE_SIZE}, "
                          f"batch {IMAGE_BATCH_RANGE[0]}..{IMAGE_BATCH_RANGE[1]}"},
    "vit-b16": {"variants": ("full",),
                "about": f"ViT-B/16, bf16 autocast, AdamW; {IMAGE_SIZE}x{IMAGE_SIZE}, "
                         f"batch {IMAGE_BATCH_RANGE[0]}..{IMAGE_BATCH_RANGE[1]}"},
}


def model_shapes(model: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """The plan of ``model``: (batch, sequence length) of each of ``n`` steps for the decoders,
    (batch, image side) for the vision models; seeded, so every mode trains the same shapes."""
    if model == "llama":
        return train_shapes(n, seed)
    rng = random.Random(seed)
    if model in ("llama3-1b", "qwen2-heldout"):
        lo_hi = SEQ_RANGE if model == "llama3-1b" else QWEN2_SEQ_RANGE
        return [(rng.choice([4, 6, 8]), rng.randint(*lo_hi)) for _ in range(n)]
    return [(rng.randint(*IMAGE_BATCH_RANGE), IMAGE_SIZE) for _ in range(n)]


def run_plan(model: str, rounds: int, steps_per_round: int) -> list[list[tuple[int, int]]]:
    """The shapes of every round: ``llama`` trains the same round again (the traces' runs);
    the other models draw every step of the run afresh, so no two rounds repeat their sizes."""
    if model == "llama":
        return [model_shapes(model, steps_per_round)] * rounds
    steps = model_shapes(model, rounds * steps_per_round)
    return [steps[r * steps_per_round:(r + 1) * steps_per_round] for r in range(rounds)]


def check_model(model: str, variants: list[str]) -> None:
    """Raises ValueError naming the model or the variant it does not train."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: not one of {', '.join(MODELS)}")
    bad = [v for v in variants if v not in MODELS[model]["variants"]]
    if bad:
        raise ValueError(f"--model {model}: no variant {bad[0]!r} (it trains {', '.join(MODELS[model]['variants'])})")


def build_vision(model: str):
    """``(module, impl, forward)``: ``forward(module, images, labels)`` is the loss; built with
    torchvision if present, else timm, else transformers (random weights)."""
    import torch.nn.functional as F

    def logits_loss(m, x, y):
        return F.cross_entropy(m(x), y)

    try:
        import torchvision.models as tvm

        m = tvm.resnet50() if model == "resnet50" else tvm.vit_b_16()
        return m, f"torchvision {__import__('torchvision').__version__}", logits_loss
    except ImportError:
        pass
    try:
        import timm

        m = timm.create_model("resnet50" if model == "resnet50" else "vit_base_patch16_224", num_classes=IMAGE_CLASSES)
        return m, f"timm {timm.__version__}", logits_loss
    except ImportError:
        pass
    import transformers as tf

    if model == "resnet50":  # ResNetConfig's defaults are ResNet-50 (bottleneck, depths 3-4-6-3)
        m = tf.ResNetForImageClassification(tf.ResNetConfig(num_labels=IMAGE_CLASSES))
    else:  # ViTConfig's defaults are ViT-B/16 at 224
        m = tf.ViTForImageClassification(tf.ViTConfig(num_labels=IMAGE_CLASSES, image_size=IMAGE_SIZE, patch_size=16))
    return m, f"transformers {tf.__version__}", lambda m, x, y: m(pixel_values=x, labels=y).loss
ALLOC_CONF = {"expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}  # PYTORCH_CUDA_ALLOC_CONF


# -- Reference hooks: allocators behind PyTorch's pluggable hook, to split a hooked allocator's cost --
#
# PyTorch's hook (``torch._C._cuda_customAllocator``) adds its own work to every allocation and
# free (a mutex and a hash map), and vmstoolkit's ``paged`` hook
# (:mod:`vmstoolkit.integrations.native_torch`) takes the GIL around its heap. To see which costs
# what inside a training step, these hooks serve every request from the CUDA driver's own
# stream-ordered pool (``cuMemAllocAsync`` / ``cuMemFreeAsync``, the pool that PyTorch's
# ``backend:cudaMallocAsync`` uses natively), through the same hook:
#
# - ``hook-async``: the driver's pool through the hook, nothing else;
# - ``hook-async-gil``: the same, taking and releasing the GIL around each call exactly as the
#   ``paged`` hook does (a thread's first call pins its Python thread state).
#
# Against ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (the same pool, no hook),
# ``hook-async`` costs the hook; ``hook-async-gil`` against ``hook-async`` costs the GIL; ``paged``
# against ``hook-async-gil`` costs the heap (and anything the GPU minds about its mappings), as
# far as the GIL's cost does not depend on how long it is held (it does: see
# ``experiments/results/train-h200/`` run 19).
# The modes ``hook-async`` and ``hook-async-gil`` run them.
#
# The entry points are Numba ``cfunc``s that call the driver through its function addresses,
# compiled in. Every row of these modes records ``hook_errors`` and ``hook_last_error``: a failing
# hook shows in its own results (run 18 found the missing-context case that way).

RELEASE_THRESHOLD = 2**64 - 1  # keep freed memory in the pool across synchronizations, as PyTorch does
CUDA_ERROR_INVALID_CONTEXT = 201


def _compile(alloc_addr: int, free_addr: int, take_gil: bool, set_ctx_addr: int, ctx: int, errors):
    """``alloc(size, device, stream)`` and ``free(ptr, size, device, stream)`` cfuncs calling
    ``int alloc_fn(uint64_t *out, size_t size, void *stream)`` and ``int free_fn(uint64_t ptr,
    void *stream)`` at the given addresses (``cuMemAllocAsync`` and ``cuMemFreeAsync``).

    PyTorch calls in from threads that may have no current context (its autograd threads: the
    runtime binds one lazily, the driver does not): on ``CUDA_ERROR_INVALID_CONTEXT`` a call makes
    ``ctx`` current with the function at ``set_ctx_addr`` (``cuCtxSetCurrent``) and retries once.
    Any other failure is counted in ``errors`` ([failures, last error code]) and gives the null pointer."""
    import numpy as np
    from llvmlite import ir
    from numba import carray, cfunc, njit, types
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    from vmstoolkit.integrations.native_torch import _gil_release, pointer_to
    from vmstoolkit.integrations.native_torch import take_gil as enter_gil  # the paged hook's own

    gil = take_gil  # a compile-time constant in the cfuncs
    i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)

    def call_retrying(builder, addr, fnty, args):
        """``rc = fn(*args)``; on an invalid context, ``set_ctx(ctx)`` and ``rc = fn(*args)``."""
        fn = builder.inttoptr(ir.Constant(i64, addr), fnty.as_pointer())
        rc = cgutils.alloca_once(builder, i32)
        builder.store(builder.call(fn, args), rc)
        with builder.if_then(builder.icmp_signed("==", builder.load(rc), ir.Constant(i32, CUDA_ERROR_INVALID_CONTEXT)),
                             likely=False):
            set_ctx = builder.inttoptr(ir.Constant(i64, set_ctx_addr), ir.FunctionType(i32, [i8p]).as_pointer())
            builder.call(set_ctx, [builder.inttoptr(ir.Constant(i64, ctx), i8p)])
            builder.store(builder.call(fn, args), rc)
        return builder.load(rc)

    @intrinsic
    def call_alloc(typingctx, size, stream):
        """The new pointer, or minus the error code (device pointers are below 2**63)."""
        sig = types.int64(types.uint64, types.voidptr)

        def codegen(context, builder, signature, args):
            out = cgutils.alloca_once(builder, i64)
            builder.store(ir.Constant(i64, 0), out)
            rc = call_retrying(builder, alloc_addr, ir.FunctionType(i32, [i64.as_pointer(), i64, i8p]),
                               [out, args[0], args[1]])
            return builder.select(builder.icmp_signed("==", rc, ir.Constant(i32, 0)), builder.load(out),
                                  builder.neg(builder.sext(rc, i64)))

        return sig, codegen

    @intrinsic
    def call_free(typingctx, ptr, stream):
        sig = types.int32(types.uint64, types.voidptr)

        def codegen(context, builder, signature, args):
            return call_retrying(builder, free_addr, ir.FunctionType(i32, [i64, i8p]), [args[0], args[1]])

        return sig, codegen

    pointer = pointer_to(types.uint64)
    release = _gil_release
    errors_addr = errors.ctypes.data

    @njit(inline="always")
    def failed(rc):
        e = carray(pointer(errors_addr), 2)
        e[0] += 1
        e[1] = rc

    @njit(inline="always")
    def serve(size, stream):
        r = call_alloc(size, stream)
        if r < 0:
            failed(-r)
            return np.uint64(0)
        return np.uint64(r)

    @njit(inline="always")
    def give_back(ptr, stream):
        rc = call_free(ptr, stream)
        if rc != 0:
            failed(rc)

    @cfunc(types.uint64(types.uint64, types.int32, types.voidptr))
    def alloc(size, device, stream):
        if size == 0:
            return 0
        if gil:
            st = enter_gil()
            ptr = serve(size, stream)
            release(st)
            return ptr
        return serve(size, stream)

    @cfunc(types.void(types.uint64, types.uint64, types.int32, types.voidptr))
    def free(ptr, size, device, stream):
        if ptr == 0:
            return
        if gil:
            st = enter_gil()
            give_back(ptr, stream)
            release(st)
            return
        give_back(ptr, stream)

    return alloc, free


class DriverPool:
    """The driver's default memory pool of ``device``: its high-water marks; with ``keep``, it
    keeps freed memory across synchronizations (as PyTorch's ``cudaMallocAsync`` backend sets it)."""

    def __init__(self, device: int = 0, keep: bool = False) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        (err,) = cu.cuInit(0)
        self._check(err, "cuInit")
        err, self.dev = cu.cuDeviceGet(device)
        self._check(err, "cuDeviceGet")
        err, self.pool = cu.cuDeviceGetDefaultMemPool(self.dev)
        self._check(err, "cuDeviceGetDefaultMemPool")
        if keep:
            (err,) = cu.cuMemPoolSetAttribute(self.pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                              cu.cuuint64_t(RELEASE_THRESHOLD))
            self._check(err, "cuMemPoolSetAttribute")

    def _check(self, err, what: str) -> None:
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {err}")

    def _attr(self, name: str) -> int:
        err, v = self._cu.cuMemPoolGetAttribute(self.pool, getattr(self._cu.CUmemPool_attribute, name))
        self._check(err, "cuMemPoolGetAttribute")
        return int(v)

    def max_memory_allocated(self) -> int:
        return self._attr("CU_MEMPOOL_ATTR_USED_MEM_HIGH")

    def max_memory_reserved(self) -> int:
        return self._attr("CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH")


class AsyncPoolHook(DriverPool):
    """The driver's default pool of ``device`` behind PyTorch's hook (:meth:`install` before the
    first CUDA allocation)."""

    def __init__(self, take_gil: bool, device: int = 0) -> None:
        super().__init__(device, keep=True)
        err, self.ctx = self._cu.cuDevicePrimaryCtxRetain(self.dev)  # PyTorch's context; held for the process
        self._check(err, "cuDevicePrimaryCtxRetain")
        import numpy as np

        lib = ctypes.CDLL("libcuda.so.1")
        addr = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
        self.errors = np.zeros(2, np.uint64)  # [failed calls, last error code]
        self.alloc_cfunc, self.free_cfunc = _compile(addr("cuMemAllocAsync"), addr("cuMemFreeAsync"), take_gil,
                                                     addr("cuCtxSetCurrent"), int(self.ctx), self.errors)

    def install(self) -> "AsyncPoolHook":
        import torch

        self._torch_allocator = torch._C._cuda_customAllocator(self.alloc_cfunc.address, self.free_cfunc.address)
        torch._C._cuda_changeCurrentAllocator(self._torch_allocator)
        return self


def pick_cpus(n: int, allowed: set[int], core_of: dict[int, tuple[int, int]], local: set[int]) -> list[int]:
    """``n`` CPUs for every run, one per physical core (``core_of[cpu]``: (package, core)),
    the GPU's own (``local``) first: the same CPUs in every mode, no two sharing a core."""
    if n < 1:
        raise ValueError(f"--cpus must be at least 1, got {n}")
    seen, picked = set(), []
    for cpu in sorted(allowed, key=lambda c: (c not in local, c)):
        core = core_of.get(cpu, (cpu, cpu))
        if core not in seen:
            seen.add(core)
            picked.append(cpu)
    if len(picked) < n:
        raise ValueError(f"--cpus {n}: only {len(picked)} physical cores are available ({sorted(allowed)})")
    return sorted(picked[:n])


def this_machines_cpus(n: int) -> list[int]:
    """:func:`pick_cpus` on this machine (sysfs topology; the local CPUs of GPU 0 from nvidia-smi)."""
    allowed = os.sched_getaffinity(0)
    core_of, local = {}, set()
    for cpu in allowed:
        t = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core_of[cpu] = (int((t / "physical_package_id").read_text()), int((t / "core_id").read_text()))
        except (OSError, ValueError):
            pass
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip().lower()
        for part in Path(f"/sys/bus/pci/devices/{bus[-12:]}/local_cpulist").read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            local |= set(range(int(lo), int(hi or lo) + 1))
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return pick_cpus(n, allowed, core_of, local)


def worker(mode: str, variant: str, rounds: int, steps_per_round: int, snapshot: Path | None = None,
           gc_between_steps: bool = False, model: str = "llama") -> dict:
    handle = pool_hook = None
    spec = allocator_mode(mode, PYTORCH_MODES)
    if spec is not None:
        from vmstoolkit.integrations.torch import install

        handle = install(spec.name, **spec.options)
    elif mode in ("hook-async", "hook-async-gil"):  # reference hooks: where a hooked allocator's time goes
        pool_hook = AsyncPoolHook(take_gil=mode == "hook-async-gil").install()
    import torch

    if snapshot is not None:  # PyTorch's own record of every request, for replays of this exact run
        # (no tracebacks, to disturb the run least; still, time runs without it)
        torch.cuda.memory._record_memory_history(context=None, max_entries=1_000_000)
    torch.manual_seed(0)
    vision = model in ("resnet50", "vit-b16")
    if vision:
        net, impl, forward = build_vision(model)
        net = net.to(DEVICE)
        if model == "resnet50":
            net = net.to(memory_format=torch.channels_last)
    else:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        impl = f"transformers {transformers.__version__}"
        if model == "llama":
            cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                              max_position_embeddings=2048)
            cfg._attn_implementation = "sdpa"
            net = LlamaForCausalLM(cfg).cuda()
        else:  # llama3-1b, qwen2-heldout: built on the GPU in bf16 (no fp32 copy, on the host or the device)
            cfg = LlamaConfig(**LLAMA3_1B) if model == "llama3-1b" else Qwen2Config(**QWEN2_HELDOUT)
            cfg._attn_implementation = "sdpa"
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(DEVICE):
                    net = (LlamaForCausalLM if model == "llama3-1b" else Qwen2ForCausalLM)(cfg)
            finally:
                torch.set_default_dtype(default_dtype)
        vocab = cfg.vocab_size
    if variant in ("ckpt", "lora"):
        net.gradient_checkpointing_enable()
        net.config.use_cache = False
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        net.enable_input_require_grads()
        net = get_peft_model(net, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator(device="cpu").manual_seed(1)
    if vision:
        gen = torch.Generator(device=DEVICE).manual_seed(1)
    plan = run_plan(model, rounds, steps_per_round)
    losses, times, enqueue, cpu, alloc_s, calls, searched = [], [], [], [], [], [], []
    if gc_between_steps:
        import gc

        gc.disable()  # collected between steps only (below): no collection inside a step frees tensors
    for round_shapes in plan:
        for bs, seq in round_shapes:
            if gc_between_steps:
                gc.collect()
            if vision:  # (B, 3, S, S) images and (B,) labels, made on the GPU before the step's clock
                x = torch.randn(bs, 3, seq, seq, device=DEVICE, generator=gen)
                if model == "resnet50":
                    x = x.contiguous(memory_format=torch.channels_last)
                y = torch.randint(0, IMAGE_CLASSES, (bs,), device=DEVICE, generator=gen)
            else:
                ids = torch.randint(0, vocab, (bs, seq), generator=gen).cuda()  # (B, T)
            torch.cuda.synchronize()
            if handle is not None:
                b = handle.bridge(0)
                s0, c0 = b.seconds, sum(b.allocator.driver.calls.values())
                v0 = path_counts(b.allocator).get("blocks_searched", 0)
            t0, cpu0 = time.perf_counter(), time.process_time()
            if vision:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = forward(net, x, y)
            elif model in ("llama3-1b", "qwen2-heldout"):  # bf16 weights: no autocast
                loss = net(input_ids=ids, labels=ids).loss
            else:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    if variant == "offload":
                        with torch.autograd.graph.save_on_cpu(pin_memory=True):
                            loss = net(input_ids=ids, labels=ids).loss
                    else:
                        loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            enqueue.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - cpu0)
            losses.append(float(loss))
            if handle is not None:
                alloc_s.append(b.seconds - s0)
                calls.append(sum(b.allocator.driver.calls.values()) - c0)
                searched.append(path_counts(b.allocator).get("blocks_searched", 0) - v0)
    if snapshot is not None:
        import gzip
        import pickle

        snapshot.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(snapshot, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        torch.cuda.memory._record_memory_history(enabled=None)
    if handle is not None:
        peak_alloc, peak_res = handle.max_memory_allocated(), handle.max_memory_reserved()
        extra = {"allocator_stats": handle.memory_stats(), "failed_mallocs": handle.bridge(0).failed_mallocs,
                 "allocator_seconds_per_step": alloc_s, "driver_calls_per_step": calls,
                 "blocks_searched_per_step": searched,
                 "paths": path_counts(handle.bridge(0).allocator)}
    elif pool_hook is not None:
        peak_alloc, peak_res = pool_hook.max_memory_allocated(), pool_hook.max_memory_reserved()
        extra = {"hook_errors": int(pool_hook.errors[0]), "hook_last_error": int(pool_hook.errors[1])}
    else:
        peak_alloc, peak_res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        extra = {"num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0)}
        if mode == "async":  # PyTorch's counters for this backend are its own; the pool's are what the driver holds
            pool = DriverPool()
            extra["pool_peak_allocated"], extra["pool_peak_reserved"] = pool.max_memory_allocated(), pool.max_memory_reserved()
    steady = times[steps_per_round:] if rounds > 1 else times
    return {"mode": mode, "variant": variant, "model": model, "model_impl": impl, "shapes": plan, "losses": losses,
            "step_times": times,
            "enqueue_times": enqueue, "cpu_times": cpu, "gc_between_steps": gc_between_steps,
            "median_step_s": statistics.median(steady), "peak_allocated": peak_alloc, "peak_reserved": peak_res,
            "utilization": peak_alloc / peak_res if peak_res else None, "device": torch.cuda.get_device_name(), **extra}


def path_counts(allocator) -> dict:
    """How the allocator served requests (``paged`` adds its placement searches)."""
    return allocator.path_counts()


def print_allocator_failure() -> None:
    """After a crash under a vmstoolkit allocator: its last error, with the traceback, last on
    standard error (PyTorch's own error is often only where a null pointer was first used)."""
    from vmstoolkit.integrations import torch as vt

    handle = vt.installed()
    if handle is None:
        return
    err = handle.last_error
    for dev in handle.devices_in_use():
        b = handle.bridge(dev)
        err = b.last_error or err
        print(f"vmstoolkit device {dev}: failed mallocs {b.failed_mallocs}, "
              f"counts {b.allocator.path_counts()}", file=sys.stderr)
    if err is not None:
        print("vmstoolkit's last error:\n" + "".join(traceback.format_exception(err)), file=sys.stderr)


def summarize(rows: list[dict], variants: list[str], modes: list[str], rounds: int, steps_per_round: int) -> list[dict]:
    """One line per (variant, mode) that ran: the highest peaks of its repeats, the median of all
    their steady-state steps (each repeat's median beside it), and against ``default`` the ratio of
    those medians and the largest loss difference of any repeat."""
    def steady(r):
        return r["step_times"][steps_per_round:] if rounds > 1 else r["step_times"]

    summary = []
    for variant in variants:
        runs = {m: [r for r in rows if r.get("variant") == variant and "error" not in r
                    and same_mode(r["mode"], m, PYTORCH_MODES)] for m in modes}
        median = {m: statistics.median([t for r in rs for t in steady(r)]) for m, rs in runs.items() if rs}
        base = runs.get("default")
        for mode, rs in runs.items():
            if not rs:
                continue
            top = max(rs, key=lambda r: r["peak_reserved"])
            s = {"variant": variant, "mode": mode, "repeats": len(rs), "peak_reserved_GiB": top["peak_reserved"] / 2**30,
                 "peak_allocated_GiB": max(r["peak_allocated"] for r in rs) / 2**30,
                 "utilization": top["utilization"], "median_step_s": median[mode],
                 "median_step_s_per_repeat": [r["median_step_s"] for r in rs]}
            for key, name in (("enqueue_times", "median_enqueue_s"), ("cpu_times", "median_cpu_s")):
                if all(r.get(key) for r in rs):  # runs before these were recorded have none
                    s[name] = statistics.median([t for r in rs for t in steady(dict(r, step_times=r[key]))])
            if base:
                s["step_time_vs_default"] = median[mode] / median["default"]
                s["max_loss_diff_vs_default"] = max(abs(a - b) for r in rs for a, b in zip(r["losses"], base[0]["losses"]))
            summary.append(s)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for train.jsonl and summary.json")
    ap.add_argument("--model", default="llama", help=f"what trains: {', '.join(MODELS)} (the module docstring)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated; default: every variant of the model (llama: full,ckpt,lora,offload)")
    ap.add_argument("--plan", action="store_true",
                    help="run nothing: print the model's description and its steps' shapes (JSON) and exit")
    ap.add_argument("--modes", default="default,expandable,vms")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every mode this many times, interleaved (default, expandable, ..., default, ...), and "
                         "compare the medians of the pooled steady-state steps: drift on a shared host cancels out")
    ap.add_argument("--cpus", type=int, default=0,
                    help="run every process on this many CPUs, one per physical core, the GPU's own first, the same "
                         "in every mode (a host-bound step's time depends on where it runs); 0: wherever the OS puts it")
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "VARIANT"))
    ap.add_argument("--snapshots", type=Path, default=None,
                    help="also record PyTorch's memory history of the default-mode runs: DIR/train-VARIANT.pickle.gz "
                         "(replay them with `vmstoolkit replay` or `experiments/paged_policy.py --traces`); "
                         "recording slows those runs, so compare step times from runs without it")
    ap.add_argument("--gc-between-steps", action="store_true",
                    help="Python's cyclic garbage collector off inside steps, run between them, in every mode: "
                         "tensors it frees then go at the same points whatever the allocator (for exact replays)")
    ap.add_argument("--snapshot-file", type=Path, default=None, help=argparse.SUPPRESS)  # the worker's
    ap.add_argument("--summary-of", type=Path, default=None, metavar="TRAIN_JSONL",
                    help="run nothing: make DIR/summary.json again from the rows of a train.jsonl")
    args = ap.parse_args()
    variants = args.variants.split(",") if args.variants else list(MODELS.get(args.model, {"variants": ()})["variants"])
    try:
        check_model(args.model, variants)
    except ValueError as e:
        ap.error(str(e))
    if args.plan:
        print(json.dumps({"model": args.model, "about": MODELS[args.model]["about"], "variants": variants,
                          "rounds": args.rounds, "shapes": run_plan(args.model, args.rounds, args.steps_per_round)}))
        return 0
    if args.worker:
        try:
            result = worker(*args.worker, args.rounds, args.steps_per_round, args.snapshot_file, args.gc_between_steps,
                            args.model)
        except BaseException:
            traceback.print_exc()
            print_allocator_failure()
            return 1
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    modes = split_modes(args.modes)
    try:
        for mode in modes:
            allocator_mode(mode, PYTORCH_MODES)
        cpus = this_machines_cpus(args.cpus) if args.cpus and args.summary_of is None else None
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summary_of is not None:
        rows = [json.loads(x) for x in args.summary_of.read_text().splitlines() if x.strip()]
        cpus = next((r["cpus"] for r in rows if "cpus" in r), None)
    else:
        rows = run_all(args, variants, modes, cpus, args.out / "train.jsonl")
    rows = [r for r in rows if r.get("model", "llama") == args.model]  # rows before models were named are llama's
    summary = [{"model": args.model, **s} for s in summarize(rows, variants, modes, args.rounds, args.steps_per_round)]
    (args.out / "summary.json").write_text(json.dumps({"command": " ".join(sys.argv), "cpus": cpus, "rows": summary},
                                                      indent=1))
    for s in summary:
        print(json.dumps(s))
    return 0


def run_all(args, variants: list[str], modes: list[str], cpus: list[int] | None, jsonl: Path) -> list[dict]:
    """Every (variant, repeat, mode) in its own worker process, modes interleaved; one row each,
    appended to ``jsonl`` as each process ends (a call stopped by its time limit keeps every
    finished process's step times)."""
    if cpus:
        print(f"every run on CPUs {cpus}", flush=True)
    rows = []
    jsonl.write_text("")
    for variant, repeat, mode in ((v, k, m) for v in variants for k in range(args.repeats) for m in modes):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if mode in ALLOC_CONF:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[mode]
        cmd = [sys.executable, __file__, "--worker", mode, variant, "--model", args.model, "--rounds", str(args.rounds),
               "--steps-per-round", str(args.steps_per_round)]
        if args.gc_between_steps:
            cmd.append("--gc-between-steps")
        if args.snapshots is not None and mode == "default" and repeat == 0:
            cmd += ["--snapshot-file", str(args.snapshots / f"train-{variant}.pickle.gz")]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            row = {"mode": mode, "variant": variant, "model": args.model, "error": (p.stderr or p.stdout)[-6000:]}
        else:
            row = json.loads(line[len("RESULT "):])
        row["repeat"] = repeat
        if cpus:
            row["cpus"] = cpus
        rows.append(row)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "step_times", "allocator_stats", "shapes")}),
              flush=True)
    return rows

if __name__ == "__main__":
    raise SystemExit(main())
