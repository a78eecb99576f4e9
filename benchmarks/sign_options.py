"""Signs of the bucket sketch without a per-element cache: cost, launches, memory and statistics.

Each option computes what ddphooks.sketch computes for one fp32 bucket laid out like transformer
layers: per-parameter squared norms and the CountSketch s[c] = sum_{i mod p = c} sigma_i g_i
(p = 251 for sketch_dim 256). One thread; "x read" is the median [IQR] over interleaved rounds of
the ratio to one read pass (torch.dot(buf, buf)) timed in the same round.
  shipped   BucketStatsKernel + SignTable: sigma_x = T[x mod 2^23] v[(x div p) mod 65521] (what ddphooks runs)
  hash64    sigma from a hash of (key, position) per chunk (today's chunks), int64 torch ops
  hash32    the same bits in int32 torch ops (masked shifts); sign applied by xor on the sign bit
  compiled  torch.compile (Inductor CPU, dynamic=False) of one whole-bucket function, hash inline
  tables    sigma_i = T1[i mod 1009] T2[i mod 1013] T3[i mod 1019], fp32 tables tiled so that a
            chunk's signs are three slices
  native    the shipped signs in one fused AVX-512 loop (C with intrinsics, gcc -O3 -march=native,
            loaded with ctypes): each gradient element read once, 16 at a time, its bin updated and
            its square summed; needs a C compiler at run time, which pip cannot install, and an
            x86-64 CPU with AVX-512
Hash (murmur3 fmix32 of a Weyl sequence): h = (i * 0x9E3779B9 + key) mod 2^32; h ^= h >> 16;
h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35 (mod 2^32); sigma_i = -1 if bit 31 of h else +1.

    python benchmarks/sign_options.py 2>/dev/null          # 25 MB/40 and 100 MB/160 parameters
    python benchmarks/sign_options.py --quick 2>/dev/null  # 4 MB/8 parameters, 5 rounds, 10 seeds
(stderr carries the profiler's start/stop lines; compile times are cold, in a fresh Inductor cache.)
"""

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())  # cold compiles: no cache from earlier runs
import numpy as np
import torch
import torch._dynamo.utils
import torch._inductor.config

from ddphooks.sketch import CPU_CHUNK_ELEMS, BucketPlan, BucketStatsKernel, SignTable, sketch_bins
from hook_cost import launches  # the op counter hook_cost.py reports with (this folder is on sys.path)

M32, GOLDEN, C1, C2 = 0xFFFFFFFF, 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
MODULI = (1009, 1013, 1019)  # pairwise coprime and coprime with 251; product 1.04e9 elements
BLOCK = 16  # compiled: rows of 16 p elements (whole AVX-512 vectors), reduced 16 rows at a time
torch._inductor.config.cpp.enable_kernel_profile = True  # compiled kernels appear in the profiler


def s32(x):  # a 32-bit pattern as a signed int32 value
    x &= M32
    return x - (1 << 32) if x >> 31 else x


def fmix32_np(h):  # numpy uint32 arithmetic wraps by definition: the reference implementation
    h = h.astype(np.uint32)
    h ^= h >> np.uint32(16); h *= np.uint32(C1); h ^= h >> np.uint32(13); h *= np.uint32(C2)
    return h


def key_of(seed):
    return int(fmix32_np(np.array([seed * 2 + 1], dtype=np.uint64) & M32)[0])


def hash_bits(pos, key):
    """Bit 31 of the hash (0 or 1) of int32 positions, functional (for Inductor); key: int32 tensor.
    int32 products wrap mod 2^32 and shifts are arithmetic, so the bits they shift in are masked."""
    h = pos * s32(GOLDEN) + key
    h = h ^ ((h >> 16) & 0xFFFF); h = h * s32(C1)
    h = h ^ ((h >> 13) & 0x7FFFF); h = h * s32(C2)
    return (h >> 31) & 1


def layout(numel, n_params):
    """Transformer-like parameter sizes (8 per layer: qkv w+b, proj w+b, norm, fc w+b, fc2 w)."""
    layers = max(1, n_params // 8)
    d = int((-9 + math.sqrt(81 + 48 * numel / layers)) / 24)
    lengths = ([3 * d * d, 3 * d, d * d, d, d, 4 * d * d, 4 * d, 4 * d * d] * layers)[:n_params]
    lengths[-1] += numel - sum(lengths)
    return lengths


class Shipped:
    def __init__(self, lengths, p, seed):
        self.plan = BucketPlan(lengths, p, 0, torch.device("cpu"), CPU_CHUNK_ELEMS)
        self.kernel = BucketStatsKernel(p, torch.device("cpu"), SignTable(seed, p, torch.device("cpu")))

    def run(self, flat, sq, sk):
        sk.zero_()
        self.kernel.run(flat, self.plan, sk, sq)

    def persistent(self):  # (bytes per element, fixed bytes)
        return self.plan.persistent_bytes() / self.plan.numel, self.kernel.persistent_bytes()


class Chunked:
    """Today's chunked pass; `signed_chunk` writes sigma * g of one chunk into the fp32 scratch."""

    def __init__(self, lengths, p, chunk_elems=CPU_CHUNK_ELEMS):
        self.plan = plan = BucketPlan(lengths, 0, 0, torch.device("cpu"), chunk_elems // p * p)  # layout only
        self.p, self.prod, self.colsums = p, torch.empty(plan.chunk_elems), torch.empty(plan.n_chunks, p)
        self.partials, self.steps = torch.empty(plan.n_segments), []
        starts, seg_begin, seg_end = plan.segment_start.tolist(), plan.segment_begin.tolist(), plan.segment_end.tolist()
        for ci in range(plan.n_chunks):
            begin, end = ci * plan.chunk_elems, min((ci + 1) * plan.chunk_elems, plan.numel)
            prod = self.prod[: end - begin]
            segs = [(prod[seg_begin[k] : seg_end[k]], self.partials[k]) for k in range(starts[ci], starts[ci + 1])]
            self.steps.append((begin, end, prod, prod[: prod.numel() // p * p].view(-1, p), self.colsums[ci], segs))
        self.last = plan.numel - (plan.n_chunks - 1) * plan.chunk_elems

    def run(self, flat, sq, sk):
        for begin, end, prod, rows, colsum, segs in self.steps:
            self.signed_chunk(flat[begin:end], begin, prod)
            torch.sum(rows, 0, out=colsum)
            for part, out in segs:
                torch.dot(part, part, out=out)
        sq.zero_().index_add_(0, self.plan.segment_owner, self.partials)
        torch.sum(self.colsums, 0, out=sk)
        if self.last % self.p:  # the last chunk may end in the middle of a row
            sk[: self.last % self.p].add_(self.prod[self.last // self.p * self.p : self.last])

    def persistent(self):
        tensors = [self.prod, self.colsums, self.partials, self.plan.segment_owner] + self.kept
        return 0.0, sum(t.numel() * t.element_size() for t in tensors)


class HashTorch(Chunked):
    def __init__(self, lengths, p, seed, dtype, chunk_elems=CPU_CHUNK_ELEMS):
        super().__init__(lengths, p, chunk_elems)
        self.key, self.dtype, n = key_of(seed), dtype, self.plan.chunk_elems
        pos_g = (torch.arange(n, dtype=torch.int64) * GOLDEN) & M32  # i * golden mod 2^32
        self.pos_g = pos_g if dtype == torch.int64 else torch.where(pos_g >> 31 == 1, pos_g - (1 << 32), pos_g).to(dtype)
        self.h, self.t = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        self.kept = [self.pos_g, self.h, self.t]

    def signed_chunk(self, g, begin, out):
        h, t, offset = self.h[: g.numel()], self.t[: g.numel()], (begin * GOLDEN + self.key) & M32
        if self.dtype == torch.int64:
            torch.add(self.pos_g[: g.numel()], offset, out=h).bitwise_and_(M32)
            torch.bitwise_right_shift(h, 16, out=t); h.bitwise_xor_(t).mul_(C1).bitwise_and_(M32)
            torch.bitwise_right_shift(h, 13, out=t); h.bitwise_xor_(t).mul_(C2)
            h.bitwise_right_shift_(31).bitwise_and_(1)
            out.copy_(h)
            torch.addcmul(g, out, g, value=-2, out=out)  # g * (1 - 2 bit)
        else:
            torch.add(self.pos_g[: g.numel()], s32(offset), out=h)
            torch.bitwise_right_shift(h, 16, out=t); t.bitwise_and_(0xFFFF); h.bitwise_xor_(t).mul_(s32(C1))
            torch.bitwise_right_shift(h, 13, out=t); t.bitwise_and_(0x7FFFF); h.bitwise_xor_(t).mul_(s32(C2))
            h.bitwise_and_(-(1 << 31))  # bit 31 alone, xored into the float's sign bit
            torch.bitwise_xor(g.view(torch.int32), h, out=out.view(torch.int32))


class Tables(Chunked):
    def __init__(self, lengths, p, seed, chunk_elems=CPU_CHUNK_ELEMS):
        super().__init__(lengths, p, chunk_elems)
        gen, n, self.tables = torch.Generator().manual_seed(seed), self.plan.chunk_elems, []
        for m in MODULI:  # the table tiled to m + chunk entries: any chunk's signs are one slice
            t = torch.randint(0, 2, (m,), generator=gen).float().mul_(2).sub_(1)
            self.tables.append((m, t.repeat(-(-(n + m) // m))[: n + m].contiguous()))
        self.kept = [t for _, t in self.tables]

    def signed_chunk(self, g, begin, out):
        (m1, t1), (m2, t2), (m3, t3), n = *self.tables, g.numel()
        torch.mul(t1[begin % m1 :][:n], t2[begin % m2 :][:n], out=out)
        out.mul_(t3[begin % m3 :][:n]).mul_(g)


NATIVE_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "the native option is written for AVX-512 (x86-64 with avx512f and avx512bw)"
#endif
/* sketch[x mod p] += T[x mod page] v[(x div p) mod R] g[i] and sq[j] = |g_j|^2, x = base + i (base a
   multiple of p). Positions are taken 16 at a time (one AVX-512 vector), aligned from the bucket's
   start, so that no vector loop has a tail per row of p: a block of 16 rows (16 p elements, a
   multiple of 16) maps its element k to acc[k], and acc is folded into the p bins at the end
   (bin c = sum of acc[m p + c], m < 16). Lane j of the block's vector i belongs to row (16 i + j)
   div p, whose sign comes from the block's 16 row signs by a permutation (idx, precomputed).
   Signs are applied by xor on the sign bit; a segment's first and last vectors are masked. */
static inline void step(const float* g, const int8_t* table, int64_t x, const int32_t* idx, __m512i vbits,
                        float* acc, __mmask16 m, __m512* sqv) {
    const __m512 gv = _mm512_maskz_loadu_ps(m, g);
    const __m512i t = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(table + x)));   /* -1 or +1 */
    const __m512i sign = _mm512_xor_si512(_mm512_and_si512(t, _mm512_set1_epi32((int)0x80000000)),
                                          _mm512_permutexvar_epi32(_mm512_loadu_si512(idx), vbits));
    const __m512 sg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));
    _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), sg));
    *sqv = _mm512_fmadd_ps(gv, gv, *sqv);
}

void sketch_norms16(const float* restrict g, int64_t base, const int8_t* restrict table, int64_t page,
                    const float* restrict rows, int64_t period, int64_t p, const int64_t* restrict seg_end,
                    int64_t nseg, float* restrict sketch, double* restrict sq, int32_t* restrict idx, float* restrict acc) {
    const int64_t block = 16 * p;
    for (int64_t i = 0; i < p; ++i)
        for (int j = 0; j < 16; ++j) idx[16 * i + j] = (int32_t)((16 * i + j) / p);
    memset(acc, 0, sizeof(float) * block);
    const int64_t base_row = base / p, mask = page - 1;
    int64_t start = 0;
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t end = seg_end[s];
        __m512 sq0 = _mm512_setzero_ps(), sq1 = _mm512_setzero_ps(), sq2 = _mm512_setzero_ps(), sq3 = _mm512_setzero_ps();
        int64_t K = start & ~(int64_t)15;
        while (K < end) {
            const int64_t b = K / block;
            int32_t vb[16];
            for (int m = 0; m < 16; ++m) vb[m] = rows[(base_row + 16 * b + m) % period] < 0 ? (int32_t)0x80000000 : 0;
            const __m512i vbits = _mm512_loadu_si512(vb);
            int64_t k = K - b * block;
            int64_t stop = K + (block - k);
            if (stop > end) stop = end;
            if (K < start || K + 16 > stop) {  /* a partial first vector */
                __mmask16 m = 0xFFFF;
                if (K < start) m &= (__mmask16)(0xFFFF << (start - K));
                if (K + 16 > end) m &= (__mmask16)(0xFFFF >> (K + 16 - end));
                step(g + K, table, (base + K) & mask, idx + k, vbits, acc + k, m, &sq0);
                K += 16; k += 16;
            }
            const int64_t full = K + ((stop - K) & ~(int64_t)63);
            for (; K < full; K += 64, k += 64) {
                const int64_t x = (base + K) & mask;  /* the table is stored twice: x + 64 stays inside */
                step(g + K, table, x, idx + k, vbits, acc + k, 0xFFFF, &sq0);
                step(g + K + 16, table, x + 16, idx + k + 16, vbits, acc + k + 16, 0xFFFF, &sq1);
                step(g + K + 32, table, x + 32, idx + k + 32, vbits, acc + k + 32, 0xFFFF, &sq2);
                step(g + K + 48, table, x + 48, idx + k + 48, vbits, acc + k + 48, 0xFFFF, &sq3);
            }
            for (; K < stop; K += 16, k += 16) {
                __mmask16 m = 0xFFFF;
                if (K + 16 > end) m &= (__mmask16)(0xFFFF >> (K + 16 - end));
                step(g + K, table, (base + K) & mask, idx + k, vbits, acc + k, m, &sq0);
            }
        }
        sq[s] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sq0, sq1), _mm512_add_ps(sq2, sq3)));
        start = end;
    }
    for (int64_t c = 0; c < p; ++c) {
        float t = 0.0f;
        for (int m = 0; m < 16; ++m) t += acc[m * p + c];
        sketch[c] += t;
    }
}
"""
_native = None


def native_library():
    global _native
    if _native is None:
        folder = tempfile.mkdtemp()
        with open(os.path.join(folder, "sketch.c"), "w") as f:
            f.write(NATIVE_SOURCE)
        cmd = ["gcc", "-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-o", os.path.join(folder, "sketch.so"), os.path.join(folder, "sketch.c")]
        subprocess.run(cmd, check=True)
        _native = ctypes.CDLL(os.path.join(folder, "sketch.so"))
    return _native


class Native:
    def __init__(self, lengths, p, seed):
        self.table, self.p, self.lib = SignTable(seed, p, torch.device("cpu")), p, native_library()
        self.ends = torch.tensor(np.cumsum(lengths), dtype=torch.int64)
        self.sq64 = torch.empty(len(lengths), dtype=torch.float64)
        self.idx, self.acc = torch.empty(16 * p, dtype=torch.int32), torch.empty(16 * p)  # 16 KB each, in the L1 cache

    def run(self, flat, sq, sk):
        i64, t, ptr = ctypes.c_int64, self.table, lambda tensor: ctypes.c_void_p(tensor.data_ptr())
        sk.zero_()
        self.lib.sketch_norms16(ptr(flat), i64(0), ptr(t.values), i64(t.page), ptr(t.row_table), i64(t.row_table.numel()),
                                i64(self.p), ptr(self.ends), i64(self.ends.numel()), ptr(sk), ptr(self.sq64), ptr(self.idx), ptr(self.acc))
        sq.copy_(self.sq64)

    def persistent(self):
        return 0.0, self.table.nbytes() + self.idx.nbytes + self.acc.nbytes


class Compiled:
    """One Inductor graph per bucket layout: the sketch over rows of 16 p elements (no masked tail
    vectors) summed BLOCK rows at a time, a padded tail, and one reduction per parameter."""

    def __init__(self, lengths, p, seed):
        numel, width = sum(lengths), 16 * p
        main = numel // (width * BLOCK) * width * BLOCK
        tail, tpad = numel - main, -(-(numel - main) // p) * p

        def stats(flat, key):
            pos = torch.arange(main, dtype=torch.int32).view(main // (width * BLOCK), BLOCK, width)
            x = flat[:main].view(pos.shape)
            sk = (x * (1 - 2 * hash_bits(pos, key).float())).sum(1).sum(0).view(16, p).sum(0)
            if tail:
                xt = torch.nn.functional.pad(flat[main:], (0, tpad - tail))
                sign = 1 - 2 * hash_bits(torch.arange(main, main + tpad, dtype=torch.int32), key).float()
                sk = sk + (xt * sign).view(-1, p).sum(0)
            return torch.stack([(s * s).sum() for s in flat.split(lengths)]), sk

        self.fn, self.key = torch.compile(stats, dynamic=False), torch.tensor(s32(key_of(seed)), dtype=torch.int32)

    def run(self, flat, sq, sk):
        q, s = self.fn(flat, self.key)
        sq.copy_(q); sk.copy_(s)

    def persistent(self):
        return 0.0, 0


def make(name, lengths, p, seed, compiled):
    if name == "compiled":  # compiled once per layout; a new seed only refills the key tensor
        opt = compiled[id(lengths)] = compiled.get(id(lengths)) or Compiled(lengths, p, seed)
        opt.key.fill_(s32(key_of(seed)))
        return opt
    if name == "shipped":
        return Shipped(lengths, p, seed)
    if name == "native":
        return Native(lengths, p, seed)
    return Tables(lengths, p, seed) if name == "tables" else HashTorch(lengths, p, seed, torch.int64 if name == "hash64" else torch.int32)


def cosines(name, lengths, p, seeds, a, b, compiled, sq, sk):
    """Over seeds: mean+-std of the sketched cosine, and of <s_a, s_b> / <a, b>."""
    cos, ratio = [], []
    for seed in range(seeds):
        opt = make(name, lengths, p, seed, compiled)
        opt.run(a, sq, sk); sa = sk.double().clone()
        opt.run(b, sq, sk); sb = sk.double()
        cos.append((sa @ sb / (sa.norm() * sb.norm())).item())
        ratio.append((sa @ sb / (a.double() @ b.double())).item())
    return [f"{statistics.mean(v):.3f}+-{statistics.stdev(v):.3f}" for v in (cos, ratio)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (15; 5 with --quick)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the statistics (50; 10 with --quick)")
    parser.add_argument("--options", nargs="+", default=["shipped", "native", "hash64", "hash32", "compiled", "tables"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    begin_all, p, compiled = time.perf_counter(), sketch_bins(256), {}
    buckets = [(4, 8)] if args.quick else [(25, 40), (100, 160)]
    rounds, seeds = args.rounds or (5 if args.quick else 15), args.seeds or (10 if args.quick else 50)
    res = {name: {} for name in args.options}
    for mb, n_params in buckets:
        lengths = layout(mb * 2**20 // 4, n_params)
        flat, sq, sk = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1)), torch.empty(n_params), torch.empty(p)
        opts = {}
        for name in args.options:  # setup (compile for `compiled`), recompiles on a new key and new data, launches, memory
            graphs, t = torch._dynamo.utils.counters["stats"]["unique_graphs"], time.perf_counter()
            opts[name] = opt = make(name, lengths, p, 0, compiled)
            opt.run(flat, sq, sk)
            res[name][f"setup{mb}"] = f"{time.perf_counter() - t:.1f}"
            make(name, lengths, p, 7, compiled).run(flat * 2, sq, sk)
            opts[name] = opt = make(name, lengths, p, 0, compiled)
            res[name][f"graphs{mb}"] = str(torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs)
            res[name][f"ops{mb}"], res[name]["mem"] = str(launches(lambda: opt.run(flat, sq, sk))), opt.persistent()
        ratios = {name: [] for name in opts}
        for r in range(3 + rounds):
            t = time.perf_counter(); torch.dot(flat, flat); read = time.perf_counter() - t
            for name, opt in opts.items():
                t = time.perf_counter(); opt.run(flat, sq, sk); elapsed = time.perf_counter() - t
                ratios[name] += [elapsed / read] if r >= 3 else []
        for name, xs in ratios.items():
            q = statistics.quantiles(xs, n=4)
            res[name][f"x{mb}"] = f"{q[1]:5.2f} [{q[0]:.2f}-{q[2]:.2f}]"
        if (mb, n_params) == buckets[0]:  # statistics on the first bucket: a random pair, a pair with a large constant part
            gen = torch.Generator().manual_seed(2)
            x, y = torch.randn(sum(lengths), generator=gen), torch.randn(sum(lengths), generator=gen)
            exact, sketches = torch.stack([(s.double() ** 2).sum() for s in x.split(lengths)]), {}
            for name in args.options:  # true cosine 0.5 for both pairs
                res[name]["rand"], _ = cosines(name, lengths, p, seeds, x, 0.5 * x + 0.75**0.5 * y, compiled, sq, sk)
                res[name]["const"], res[name]["const_ip"] = cosines(name, lengths, p, seeds, 1 + x, 1 + y, compiled, sq, sk)
                make(name, lengths, p, 0, compiled).run(x, sq, sk)
                sketches[name] = sk.clone()
                res[name]["norm_err"] = f"{((sq.double() - exact).abs() / exact).max().item():.1e}"
            for name in set(sketches) & {"hash32", "compiled"} if "hash64" in sketches else ():
                # one flipped sign moves one bin by ~2|g_i|, ~1e-2 of the largest bin
                res[name]["=hash64"] = f"{((sketches[name] - sketches['hash64']).abs().max() / sketches['hash64'].abs().max()).item():.0e}"
            if {"native", "shipped"} <= set(sketches):  # the same signs, another summation order
                res["native"]["=hash64"] = f"{((sketches['native'] - sketches['shipped']).abs().max() / sketches['shipped'].abs().max()).item():.0e} (=shipped)"
    n, key = 3_000_000, key_of(0)  # chunk invariance: signs of 3 M positions with chunks of 4 sizes
    expect = 1 - 2 * torch.from_numpy((fmix32_np((np.arange(n, dtype=np.uint64) * GOLDEN + key) & M32) >> 31).astype(np.float32))
    for name in set(args.options) & {"hash64", "hash32", "tables"}:
        got = []
        for chunk in (CPU_CHUNK_ELEMS, 1 << 20, 1 << 22, 4099):
            o = Tables([n], p, 0, chunk) if name == "tables" else HashTorch([n], p, 0, torch.int64 if name == "hash64" else torch.int32, chunk)
            out, ones = torch.empty(n), torch.ones(n)
            for begin in range(0, n, o.plan.chunk_elems):
                end = min(begin + o.plan.chunk_elems, n)
                o.signed_chunk(ones[begin:end], begin, out[begin:end])
            got.append(out)
        res[name]["chunks"] = "same" if all(torch.equal(g, got[0]) for g in got) else "DIFFER"
        res[name]["chunks"] += "" if name == "tables" else ", =numpy" if torch.equal(got[0], expect) else ", !=numpy"
    print(f"p = {p}, torch {torch.__version__}, 1 thread, {rounds} rounds, {seeds} seeds, buckets (MB, params) {buckets}")
    cols = [f"x{mb}" for mb, _ in buckets] + [f"ops{mb}" for mb, _ in buckets] + ["B/elem", "fixed KB"]
    cols += [f"setup{mb}" for mb, _ in buckets] + [f"graphs{mb}" for mb, _ in buckets]
    cols += ["rand", "const", "const_ip", "norm_err", "=hash64", "chunks"]
    rows = [["option"] + cols]
    for name, r in res.items():
        r["B/elem"], r["fixed KB"] = f"{r['mem'][0]:.2f}", f"{r['mem'][1] / 1024:.0f}"
        rows.append([name] + [r.get(c, "-") for c in cols])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print("x: x read pass (median [IQR]); ops: aten ops + compiled kernels per bucket; graphs: compiled graphs "
          "after setup + a call with a new key and new data (1 = no recompile); rand/const: sketched cosine "
          f"(true 0.5) mean+-std over seeds; const_ip: <s_a,s_b>/<a,b>; =hash64: max sketch difference; total {time.perf_counter() - begin_all:.0f} s")


if __name__ == "__main__":
    main()
