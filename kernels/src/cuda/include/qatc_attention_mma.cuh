// qatc_attention_mma.cuh: the causal attention forward on tensor cores (sm_80+), FlashAttention-2's
// scheme, for operands whose values are 16-bit (`--precision bf16|fp16`: the lowering widened
// them to f32 exactly, so rounding them back loses nothing; `kir::Attention::values`).
//
// A block of 64 threads (2 warps) owns 64 query rows of one (b, h), the same grid and block as
// the scalar template in qatc_attention.cuh, so either can be launched for the same kernel IR.
// Each warp keeps its 32 query rows in registers as mma A fragments; the block streams the keys
// and values through shared memory in tiles of 64 (converted to the 16-bit type there; V
// transposed so that its B fragments are single 32-bit reads), skipping the tiles past the
// block's last row (causal). S = q k^T and O += P v are `mma.sync.m16n8k16` with fp32
// accumulation; the softmax is online in fp32 (max and sum per row, rescaling O when the max
// grows), P is rounded to the 16-bit type only as the A operand of P v. The row log-sum-exp is
// written for the backward. Deterministic: every output has one owner and a fixed order.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, .row.col), g = lane / 4, q = lane % 4:
//   A (16 x 16): a0 = (g, 2q..2q+1), a1 = (g+8, 2q..), a2 = (g, 2q+8..), a3 = (g+8, 2q+8..)
//   B (16 x 8):  b0 = (k 2q..2q+1, n g), b1 = (k 2q+8..2q+9, n g)
//   C (16 x 8):  c0, c1 = (g, 2q..2q+1), c2, c3 = (g+8, 2q..2q+1)
// so the C fragments of two neighbouring n-tiles of S are the A fragment of P for 16 keys.
#pragma once

namespace qatc {

// Two 16-bit values in one register: the lower index in the low half, as the fragments want.
__device__ __forceinline__ unsigned pack_half2(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// The 16-bit operand types of the tensor-core kernels: rounding to nearest even, and the mma
// with fp32 accumulation, c += a b.
struct MmaBf16 {
    static __device__ __forceinline__ unsigned short from(float x) { return float_to_bf16(x); }
    static __device__ __forceinline__ void mma(float c[4], const unsigned a[4], const unsigned b[2]) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

struct MmaF16 {
    static __device__ __forceinline__ unsigned short from(float x) { return float_to_f16(x); }
    static __device__ __forceinline__ void mma(float c[4], const unsigned a[4], const unsigned b[2]) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

// A 32-bit read of two neighbouring 16-bit elements of shared memory (at an even column).
__device__ __forceinline__ unsigned lds_pair(const unsigned short* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Rows [r0, r0 + R) of one (b, h) of x into tile[r][d] (pitch P) as H, zero past T.
template <int HS, int R, int P, typename H>
__device__ __forceinline__ void load_tile_h(unsigned short* tile, const float* x, AttnView xv, int b, int h, int r0, int T) {
    for (int e = threadIdx.x; e < R * HS; e += 64) {
        const int r = e / HS, d = e % HS, j = r0 + r;
        tile[r * P + d] = H::from(j < T ? x[xv.row(b, h, j) + d] : 0.0f);
    }
}

// The same rows stored transposed, tile[d][r] (pitch P).
template <int HS, int R, int P, typename H>
__device__ __forceinline__ void load_tile_h_t(unsigned short* tile, const float* x, AttnView xv, int b, int h, int r0, int T) {
    for (int e = threadIdx.x; e < R * HS; e += 64) {
        const int r = e / HS, d = e % HS, j = r0 + r;
        tile[d * P + r] = H::from(j < T ? x[xv.row(b, h, j) + d] : 0.0f);
    }
}

// grid (ceil(T / 64), B * NH), block 64. out = softmax(scale q k^T, causal) v; lse [B*NH, T].
// HS a multiple of 16, at most 64 (the tiles' shared memory stays under the static 48 KB).
template <int HS, typename H>
__device__ void attention_forward_mma(AttnShape s, const float* q, AttnView qv, const float* k, AttnView kv, const float* v,
                                      AttnView vv, float* out, AttnView ov, float* lse) {
    static_assert(HS % 16 == 0 && HS <= 64, "hs: a multiple of 16, at most 64");
    constexpr int BQ = 64, BK = 64;
    constexpr int KS = HS / 16;  // k-steps of q k^T over hs
    constexpr int NS = BK / 8;   // n-tiles of S over the keys
    constexpr int KP = BK / 16;  // k-steps of P v over the keys
    constexpr int NO = HS / 8;   // n-tiles of O over hs
    constexpr int QP = HS + 8;   // row pitch of the q and k tiles (+16 bytes: conflict-free fragment reads)
    constexpr int VP = BK + 8;   // row pitch of the transposed v tile
    __shared__ __align__(16) unsigned short qs[BQ * QP];
    __shared__ __align__(16) unsigned short ks[BK * QP];
    __shared__ __align__(16) unsigned short vt[HS * VP];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int i0 = blockIdx.x * BQ;
    const int last = min(i0 + BQ, s.t) - 1;  // the block's last query row
    load_tile_h<HS, BQ, QP, H>(qs, q, qv, b, h, i0, s.t);
    __syncthreads();
    unsigned qa[2][KS][4];  // the warp's 32 query rows: two m-tiles of 16
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int ks_ = 0; ks_ < KS; ++ks_) {
            const unsigned short* p = qs + (warp * 32 + mt * 16 + g) * QP + ks_ * 16 + 2 * tq;
            qa[mt][ks_][0] = lds_pair(p);
            qa[mt][ks_][1] = lds_pair(p + 8 * QP);
            qa[mt][ks_][2] = lds_pair(p + 8);
            qa[mt][ks_][3] = lds_pair(p + 8 * QP + 8);
        }
    }
    float o[2][NO][4];
    float m[2][2], l[2][2];  // [m-tile][row g | row g + 8]: running max, this thread's part of the sum
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int n = 0; n < NO; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();  // every warp is done with the previous tile
        load_tile_h<HS, BK, QP, H>(ks, k, kv, b, h, j0, s.t);
        load_tile_h_t<HS, BK, VP, H>(vt, v, vv, b, h, j0, s.t);
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int row = i0 + warp * 32 + mt * 16 + g;  // this thread's rows: row and row + 8
            if (j0 > row - g + 15) continue;  // the m-tile's last row sees no key of this tile (uniform in the warp)
            float sc[NS][4];
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
                for (int ks_ = 0; ks_ < KS; ++ks_) {
                    const unsigned short* p = ks + (n * 8 + g) * QP + ks_ * 16 + 2 * tq;
                    const unsigned bf[2] = {lds_pair(p), lds_pair(p + 8)};
                    H::mma(sc[n], qa[mt][ks_], bf);
                }
            }
            float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
            for (int n = 0; n < NS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row + (e >> 1) * 8, j = j0 + n * 8 + 2 * tq + (e & 1);
                    const float x = (j > i || j >= s.t) ? -INFINITY : s.scale * sc[n][e];
                    sc[n][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
            }
            float c[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // the row's max over the quad of threads holding it
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                // key 0 is in the first tile and unmasked for every row: mx is finite from there on
                c[r] = expf(m[mt][r] - mx[r]);
                m[mt][r] = mx[r];
                l[mt][r] *= c[r];
            }
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                o[mt][n][0] *= c[0];
                o[mt][n][1] *= c[0];
                o[mt][n][2] *= c[1];
                o[mt][n][3] *= c[1];
            }
            unsigned pa[KP][4];  // P as A fragments, 16 keys per k-step
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                const float p0 = expf(sc[n][0] - mx[0]), p1 = expf(sc[n][1] - mx[0]);
                const float p2 = expf(sc[n][2] - mx[1]), p3 = expf(sc[n][3] - mx[1]);
                l[mt][0] += p0 + p1;
                l[mt][1] += p2 + p3;
                pa[n >> 1][(n & 1) * 2 + 0] = pack_half2(H::from(p0), H::from(p1));
                pa[n >> 1][(n & 1) * 2 + 1] = pack_half2(H::from(p2), H::from(p3));
            }
#pragma unroll
            for (int n = 0; n < NO; ++n) {
#pragma unroll
                for (int kp = 0; kp < KP; ++kp) {
                    const unsigned short* p = vt + (n * 8 + g) * VP + kp * 16 + 2 * tq;
                    const unsigned bf[2] = {lds_pair(p), lds_pair(p + 8)};
                    H::mma(o[mt][n], pa[kp], bf);
                }
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int i = i0 + warp * 32 + mt * 16 + g + r * 8;
            if (i < s.t) {
                float* dst = out + ov.row(b, h, i) + 2 * tq;
#pragma unroll
                for (int n = 0; n < NO; ++n) {
                    dst[n * 8] = o[mt][n][2 * r] / sum;
                    dst[n * 8 + 1] = o[mt][n][2 * r + 1] / sum;
                }
                if (tq == 0) lse[(long long)bh * s.t + i] = m[mt][r] + logf(sum);
            }
        }
    }
}

}  // namespace qatc
