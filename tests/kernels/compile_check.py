"""Compiles every kernel specialisation that a CPU run launches for an NVIDIA target (sm_90 by
default), down to cubin, without a GPU: catches what Triton's interpreter accepts but its
compiler does not (constexpr rules, layouts, types).

    python tests/kernels/compile_check.py [--arch 90]

Must run without ``TRITON_INTERPRET`` (it removes it): kernel launches are recorded instead of
executed, so the pipeline runs on uninitialised buffers; only the launch arguments matter.
Prints one line per compiled specialisation with its shared memory and compile time; exits 1
when one needs more shared memory than the architecture gives a block (its launch would fail).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

os.environ.pop("TRITON_INTERPRET", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402
from kakeyaturbo import calibrate  # noqa: E402
from kakeyaturbo.kernels import calibrated, perblock  # noqa: E402
from kakeyaturbo.kernels.attention import combine as attention_combine  # noqa: E402
from kakeyaturbo.kernels.attention import split as attention_split  # noqa: E402

KERNELS = [
    (perblock.project, "_project_assign_kernel"),
    (perblock.residual, "_residual_kernel"),
    (perblock.quantize, "_quantize_kernel"),
    (perblock.pack, "_pack_kernel"),
    (perblock.decode, "_decode_kernel"),
    (calibrated.rms, "_rms_kernel"),
    (calibrated.quantize, "_quantize_kernel"),
    (calibrated.gain, "_gain_kernel"),
    (calibrated.decode, "_decode_kernel"),
    (attention_split, "_split_kernel"),
    (attention_combine, "_combine_kernel"),
]
TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.uint8: "u8",
    torch.int64: "i64",
}
Launch = Tuple[Any, Tuple[Any, ...], Dict[str, Any]]
#: Shared memory a block may use, by architecture (bytes; sm_90: 227 KB).
SHARED_LIMIT = {80: 166912, 89: 101376, 90: 232448}


class _Recorder:
    def __init__(self, fn: Any, log: List[Launch]) -> None:
        self.fn, self.log = fn, log

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append((self.fn, args, kwargs))

        return launch


def _signature(
    fn: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Dict[str, str], Dict[str, Any]]:
    sig: Dict[str, str] = {}
    consts: Dict[str, Any] = {}
    for i, param in enumerate(fn.params):
        name = param.name
        v = kwargs[name] if name in kwargs else args[i]
        if param.is_constexpr:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    return sig, consts


def record_launches() -> List[Launch]:
    """Runs encode and decode over the settings that select different specialisations."""
    log: List[Launch] = []
    for mod, name in KERNELS:
        setattr(mod, name, _Recorder(getattr(mod, name), log))
    g = np.random.default_rng(0)
    for metric, bits, thr, dtype in [
        ("mse", 3, None, torch.float32),
        ("inner_product", 1, 2.0, torch.bfloat16),
        ("linf", 4, 1.0, torch.float32),
        ("mse", 2, None, torch.bfloat16),
    ]:
        for d, n, ratio in [(128, 512, 0.5), (256, 512, 0.99), (64, 100, 0.9), (96, 300, 0.3)]:
            x = (g.standard_normal((n, d)) * 0.97 ** np.arange(d)).astype(np.float32)
            parts = [
                kt.encode_block_codes(
                    x, metric=metric, bit_width=bits, outlier_threshold=thr, variance_ratio=v, k=k
                )
                for v, k in ((ratio, 16), (0.5, 20))
            ]
            skel = K.stack_skeletons(parts)
            codes = K.encode_blocks(torch.from_numpy(np.stack([x, x])).to(dtype), skel)
            # The launches were recorded, not run: valid (zero) codes for the decode's checks.
            codes = {key: torch.zeros_like(v) for key, v in codes.items()}
            codes["outlier_ptr"] = torch.tensor([0, 1, 3])
            codes["outlier_pos"] = torch.tensor([0, 0, 1])
            codes["outlier_bits"] = torch.zeros(3, dtype=torch.int16)
            K.decode_blocks(codes, skel, out_dtype=dtype)
    # Calibrated mode: slot counts 16..256 (MP), every branch, both input and output dtypes.
    cases: List[Tuple[int, float, Dict[str, Any], torch.dtype]] = [
        (64, 1.5, dict(norm=False), torch.float32),
        (128, 4.4, dict(), torch.bfloat16),
        (128, 3.0, dict(metric="inner_product", outlier_threshold=2.5), torch.float32),
        (256, 8.0, dict(metric="linf", outlier_threshold=3.0), torch.bfloat16),
        (96, 0.5, dict(), torch.float32),
    ]
    for d, bpe, kw, dtype in cases:
        x = (g.standard_normal((300, d)) * 0.97 ** np.arange(d)).astype(np.float32)
        fit = calibrate.fit_stream(x.mean(0), np.cov(x.T), bpe, norm=kw.get("norm", True))
        batch = K.stack_calibrations([fit.codec(**kw)] * 2)
        codes = K.encode_calibrated(torch.from_numpy(np.stack([x, x])).to(dtype), batch)
        codes = {key: torch.zeros_like(v) for key, v in codes.items()}
        codes["outlier_ptr"] = torch.tensor([0, 1, 3])
        codes["outlier_pos"] = torch.tensor([0, 0, 1])
        codes["outlier_bits"] = torch.zeros(3, dtype=torch.int16)
        K.decode_calibrated(codes, batch, out_dtype=dtype, n=300)
    # Decode attention over the codes: the default model's shape and a head_dim-128 one, GQA
    # groups 1..8, n_q up to 4 (QP 16 and 32), odd D, with and without outliers and masks.
    for spec, bpe in [
        (dict(kv_heads=3, group=3, d=64), 3.0),
        (dict(kv_heads=8, group=4, d=128, n_q=4, threshold=2.5, mask=True), 4.0),
        (dict(kv_heads=1, group=8, d=256, metric="inner_product", norm=True), 4.4),
        (dict(kv_heads=2, group=1, d=48, norm=False, n_q=2), 2.5),
        # Fewer slots than the head dimension (MPV < BDV): Triton 3.6 rejected the kernel once.
        (dict(kv_heads=2, group=2, d=64), 0.75),
    ]:
        d = spec["d"]
        x = (g.standard_normal((300, d)) * 0.97 ** np.arange(d)).astype(np.float32)
        fit = calibrate.fit_stream(x.mean(0), np.cov(x.T), bpe, norm=spec.get("norm", True))
        codec = fit.codec(metric=spec.get("metric", "mse"), norm=spec.get("norm", True),
                          outlier_threshold=spec.get("threshold"))
        hkv, nq = spec["kv_heads"], spec.get("n_q", 1)
        codes = kt.LayerCodes([codec] * hkv, [codec] * hkv)
        codes.append_blocks([[codec.encode(x)] * hkv], [[codec.encode(x)] * hkv])
        layer = K.stack_layer(codes)
        q = torch.zeros((1, hkv * spec["group"], nq, d))
        tail = np.zeros((1, hkv, nq + 3, d), np.float32)
        mask = np.zeros((1, nq, 1 + 300 + nq + 3), np.float32) if spec.get("mask") else None
        K.decode_attention_triton(layer, q, tail, tail, sink_k=tail[:, :, :1], sink_v=tail[:, :, :1],
                                  mask=mask, softcap=30.0 if spec.get("mask") else None)
        # The same layer read as keys coded before RoPE (the shipped recipes): both pairings,
        # full and partial rotary, every synthesis.
        rot = d if d % 2 == 0 else d - 1
        for style, r, syn in (("half", rot, "bf16"), ("interleaved", min(rot, 32), "f32"), ("half", rot, "i16")):
            table = kt.RopeTable(np.ones((400, r // 2), np.float32), np.zeros((400, r // 2), np.float32), style)
            K.decode_attention_triton(layer, q, tail, tail, rope=table, positions=np.arange(300)[None],
                                      synthesis=syn)
    for mod, name in KERNELS:
        setattr(mod, name, getattr(mod, name).fn)
    return log


def _registers(compiled: Any) -> str:
    """``, N registers, S B stack`` per thread, read off the cubin by the ``cuobjdump`` that
    Triton carries (no GPU needed; stack is local memory: spills and dynamically indexed
    arrays, slow on the device), or nothing when either is missing."""
    cubin = compiled.asm.get("cubin")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    if not regs or not stack:
        return ""
    return f", {regs.group(1)} registers, {stack.group(1)} B stack"


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    seen = set()
    total = 0.0
    too_big = []
    for fn, a, kw in record_launches():
        sig, consts = _signature(fn, a, kw)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())))
        if key in seen:
            continue
        seen.add(key)
        opts = {k: kw[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kw}
        t0 = time.perf_counter()
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=opts)
        dt = time.perf_counter() - t0
        total += dt
        print(f"{fn.__name__} {consts} shared={c.metadata.shared} B, {dt:.1f} s{_registers(c)}",
              flush=True)
        if c.metadata.shared > SHARED_LIMIT.get(args.arch, SHARED_LIMIT[90]):
            too_big.append(f"{fn.__name__} {consts}: {c.metadata.shared} B")
    print(f"{len(seen)} specialisations compiled for sm_{args.arch} in {total:.0f} s")
    for t in too_big:
        print(f"TOO MUCH SHARED MEMORY (the launch would fail): {t}")
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
