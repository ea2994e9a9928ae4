#!/usr/bin/env python3
"""Golden vectors for krasis-quant's ggml dequantisers, from the `gguf` PyPI package's reference
(numpy) dequantisers: `pip install gguf numpy`, then `python3 scripts/ggml-golden.py`.

MXFP4 comes last (so the other files keep their bytes) with its E8M0 scale bytes drawn from the
subnormal ones (0, 1) and a normal range (100..160), where a code times the scale stays finite.

Writes krasis-quant/tests/data/ggml/<TYPE>.bin: u32 LE block count, u32 LE element count, the raw
blocks, then the expected f32 LE values. Blocks are random bytes (fixed seed) with every f16 scale
field replaced by a random finite half, so each bit pattern of codes, scales and mins is exercised.
"""
import os
import numpy as np
from gguf import GGMLQuantizationType as T, GGML_QUANT_SIZES
from gguf.quants import dequantize

# byte offsets of each type's f16 fields inside one block (ggml-common.h)
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
BLOCKS = 6  # enough blocks that every code and scale position is hit with several values

def finite_halves(rng, n):
    # |x| in [2^-14, 2^3): normal, finite, and small enough that sums of products stay finite
    x = rng.uniform(-8, 8, n).astype(np.float16)
    x[np.abs(x) < 2**-14] = np.float16(0.25)
    return x

def main():
    rng = np.random.default_rng(20261124)
    out_dir = os.path.join(os.path.dirname(__file__), "..", "krasis-quant", "tests", "data", "ggml")
    os.makedirs(out_dir, exist_ok=True)
    for name in ["F32", "F16", "BF16", *HALF_FIELDS, "MXFP4"]:
        ty = T[name]
        block_elems, block_bytes = GGML_QUANT_SIZES[ty]
        n_blocks = BLOCKS if block_elems > 1 else 96
        if name == "F32":
            raw = rng.standard_normal(n_blocks).astype("<f4").tobytes()
        elif name == "F16":
            raw = finite_halves(rng, n_blocks).astype("<f2").tobytes()
        elif name == "BF16":
            raw = (rng.standard_normal(n_blocks).astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        elif name == "MXFP4":
            blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
            blocks[:, 0] = np.concatenate([[0, 1], rng.integers(100, 160, n_blocks - 2)]).astype(np.uint8)
            raw = blocks.tobytes()
        else:
            blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
            for off in HALF_FIELDS[name]:
                blocks[:, off:off + 2] = finite_halves(rng, n_blocks).astype("<f2").view(np.uint8).reshape(n_blocks, 2)
            raw = blocks.tobytes()
        elements = n_blocks * block_elems
        data = np.frombuffer(raw, dtype=np.uint8).reshape(1, -1)
        values = dequantize(data, ty).astype("<f4").reshape(-1)
        assert values.size == elements, (name, values.size, elements)
        with open(os.path.join(out_dir, f"{name}.bin"), "wb") as f:
            f.write(np.array([n_blocks, elements], dtype="<u4").tobytes())
            f.write(raw)
            f.write(values.tobytes())
        print(f"{name}: {n_blocks} blocks, {elements} values")

if __name__ == "__main__":
    main()
