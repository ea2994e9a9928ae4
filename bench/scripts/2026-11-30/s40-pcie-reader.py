# Zero-copy (SM reads of mapped host memory) and copy-engine H2D read bandwidth, alone or in a loop.
import sys, time, cupy as cp
mode = sys.argv[1]; secs = float(sys.argv[2]) if len(sys.argv) > 2 else 0
N = 1 << 31
hp = cp.cuda.runtime.hostAlloc(N, 2)  # cudaHostAllocMapped
dp = hp  # UVA: a mapped host allocation has the same address on the device
mem = cp.cuda.UnownedMemory(dp, N, None)
src = cp.ndarray((N // 16, 4), dtype=cp.uint32, memptr=cp.cuda.MemoryPointer(mem, 0))
dst = cp.empty(N, dtype=cp.uint8)
k = cp.RawKernel(r'''
extern "C" __global__ void rd(const uint4* __restrict__ p, unsigned long long n, unsigned* out) {
  unsigned acc = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
    uint4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x12345678u) out[0] = acc;
}''', 'rd')
out = cp.zeros(1, dtype=cp.uint32)
def zc(blocks):
    k((blocks,), (256,), (src, cp.uint64(N // 16), out))
def ce():
    cp.cuda.runtime.memcpyAsync(dst.data.ptr, hp, N, 1, cp.cuda.get_current_stream().ptr)
def timed(f, reps=3):
    f(); cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(reps): f()
    cp.cuda.Device().synchronize()
    return reps * N / (time.perf_counter() - t) / 1e9
if mode == 'solo':
    for b in (132, 264, 528, 1056, 2112):
        print(f"zero-copy read, {b} blocks x 256: {timed(lambda: zc(b)):.1f} GB/s", flush=True)
    print(f"copy engine H2D: {timed(ce):.1f} GB/s", flush=True)
else:
    f = (lambda: zc(1056)) if mode == 'zc' else ce
    t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < secs:
        f(); cp.cuda.Device().synchronize(); n += 1
    print(f"background {mode}: {n * N / (time.perf_counter() - t0) / 1e9:.1f} GB/s over {time.perf_counter() - t0:.1f} s", flush=True)
