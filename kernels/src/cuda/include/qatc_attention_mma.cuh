// qatc_attention_mma.cuh: causal attention forward and backward on tensor cores (sm_80+),
// FlashAttention-2's scheme, for operands whose values are 16-bit (`--precision bf16|fp16`;
// `kir::Attention::values`): the views are read in their own element types (`AttnElems`, as the
// fp32 templates do): a view stored in the operands' 16-bit type goes to the tiles as it is, an
// f32 one (the lowering's widened copy) is rounded back, which loses nothing. Each result is
// rounded to its view's type once, at its store.
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
// The backward recomputes P from the saved log-sum-exp, as the fp32 templates do, with the same
// blocks: delta and dq per block of 64 query rows streaming the keys (S = q k^T and dP = dout v^T
// on tensor cores; delta_i = sum_j P_ij dP_ij, or dq += dS k), dk and dv per block of 64 key rows
// streaming the query rows from the block's first key on (S^T = k q^T, dP^T = v dout^T, then
// dv += P^T dout and dk += dS^T q). dS = scale P (dP - delta) is rounded to the 16-bit type only as
// an mma operand; no atomics, no scratch.
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
// with fp32 accumulation, c += a b. (QATC_CPU_SHIM: compiled for the CPU by the test harness,
// tests/cxx/cuda_on_cpu.h, which emulates the warp-wide instruction; NVRTC never defines it.)
struct MmaBf16 {
    static __device__ __forceinline__ unsigned short from(float x) { return float_to_bf16(x); }
    static __device__ __forceinline__ void mma(float c[4], const unsigned a[4], const unsigned b[2]) {
#ifdef QATC_CPU_SHIM
        qatc_cpu::mma_m16n8k16_bf16(c, a, b);
#else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
    }
};

struct MmaF16 {
    static __device__ __forceinline__ unsigned short from(float x) { return float_to_f16(x); }
    static __device__ __forceinline__ void mma(float c[4], const unsigned a[4], const unsigned b[2]) {
#ifdef QATC_CPU_SHIM
        qatc_cpu::mma_m16n8k16_f16(c, a, b);
#else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
    }
};

// An element of a view of element type X (an Elem* tag) as the mma operand type H: its f32 value
// rounded, or, where X is H's own type, its bits (the round trip gives them back, but for a
// signalling NaN's quiet bit).
template <typename H, typename X>
struct ToMma {
    static __device__ __forceinline__ unsigned short of(typename X::T x) { return H::from(X::load(x)); }
};
template <>
struct ToMma<MmaBf16, ElemBf16> {
    static __device__ __forceinline__ unsigned short of(bf16_t x) { return x; }
};
template <>
struct ToMma<MmaF16, ElemF16> {
    static __device__ __forceinline__ unsigned short of(f16_t x) { return x; }
};

// A 32-bit read of two neighbouring 16-bit elements of shared memory (at an even column).
__device__ __forceinline__ unsigned lds_pair(const unsigned short* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Rows [r0, r0 + R) of one (b, h) of x into tile[r][d] (pitch P) as H, zero past T.
template <int HS, int R, int P, typename H, typename X>
__device__ __forceinline__ void load_tile_h(unsigned short* tile, const typename X::T* x, AttnView xv, int b, int h, int r0, int T) {
    for (int e = threadIdx.x; e < R * HS; e += 64) {
        const int r = e / HS, d = e % HS, j = r0 + r;
        tile[r * P + d] = j < T ? ToMma<H, X>::of(x[xv.row(b, h, j) + d]) : (unsigned short)0;  // +0 in f16 and bf16
    }
}

// The same rows stored transposed, tile[d][r] (pitch P).
template <int HS, int R, int P, typename H, typename X>
__device__ __forceinline__ void load_tile_h_t(unsigned short* tile, const typename X::T* x, AttnView xv, int b, int h, int r0, int T) {
    for (int e = threadIdx.x; e < R * HS; e += 64) {
        const int r = e / HS, d = e % HS, j = r0 + r;
        tile[d * P + r] = j < T ? ToMma<H, X>::of(x[xv.row(b, h, j) + d]) : (unsigned short)0;  // +0 in f16 and bf16
    }
}

// grid (ceil(T / 64), B * NH), block 64. With OUT, out = softmax(scale q k^T, causal) v and the
// row log-sum-exp lse [B*NH, T]; without, lse alone (v, out unread). HS a multiple of 16, at most
// 64 (the tiles' shared memory stays under the static 48 KB).
template <int HS, typename H, typename E, bool OUT>
__device__ void attention_rows_forward_mma(AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v,
                                           AttnView vv, typename E::o::T* out, AttnView ov, float* lse) {
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
    __shared__ __align__(16) unsigned short vt[OUT ? HS * VP : 2];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int i0 = blockIdx.x * BQ;
    const int last = min(i0 + BQ, s.t) - 1;  // the block's last query row
    load_tile_h<HS, BQ, QP, H, typename E::q>(qs, q, qv, b, h, i0, s.t);
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
        load_tile_h<HS, BK, QP, H, typename E::k>(ks, k, kv, b, h, j0, s.t);
        if (OUT) load_tile_h_t<HS, BK, VP, H, typename E::v>(vt, v, vv, b, h, j0, s.t);
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
            if (OUT) {
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
                if (OUT) {
                    typename E::o::T* dst = out + ov.row(b, h, i) + 2 * tq;
#pragma unroll
                    for (int n = 0; n < NO; ++n) {
                        dst[n * 8] = E::o::store(o[mt][n][2 * r] / sum);
                        dst[n * 8 + 1] = E::o::store(o[mt][n][2 * r + 1] / sum);
                    }
                }
                if (tq == 0) lse[(long long)bh * s.t + i] = m[mt][r] + logf(sum);
            }
        }
    }
}

// grid (ceil(T / 64), B * NH), block 64. out = softmax(scale q k^T, causal) v; lse [B*NH, T].
template <int HS, typename H, typename E>
__device__ void attention_forward_mma(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v,
                                      AttnView vv, typename E::o::T* out, AttnView ov, float* lse) {
    attention_rows_forward_mma<HS, H, E, true>(s, q, qv, k, kv, v, vv, out, ov, lse);
}

// grid (ceil(T / 64), B * NH), block 64: lse_i = log sum_{j <= i} exp(scale q_i . k_j), for a
// backward whose forward's was not kept.
template <int HS, typename H, typename E>
__device__ void attention_lse_mma(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, float* lse) {
    attention_rows_forward_mma<HS, H, E, false>(s, q, qv, k, kv, nullptr, qv, nullptr, qv, lse);
}

// grid (ceil(T / 64), B * NH), block 64: per query row i, with DQ dq_i = sum_j dS_ij k_j (reading
// delta), else delta_i = sum_j P_ij dP_ij (writing it). P = exp(scale q k^T - lse), dP = dout v^T.
template <int HS, typename H, typename E, bool DQ>
__device__ void attention_backward_rows_mma(AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v,
                                            AttnView vv, const typename E::dout::T* dout, AttnView dv_, const float* lse, const float* delta_in,
                                            float* delta_out, typename E::o::T* dq, AttnView dqv) {
    static_assert(HS % 16 == 0 && HS <= 64, "hs: a multiple of 16, at most 64");
    constexpr int BQ = 64, BK = 64, KS = HS / 16, NS = BK / 8, KP = BK / 16, NO = HS / 8;
    constexpr int QP = HS + 8, TP = BK + 8;
    __shared__ __align__(16) unsigned short stage[BQ * QP];  // q, then dout: read once into fragments
    __shared__ __align__(16) unsigned short ks[BK * QP];
    __shared__ __align__(16) unsigned short vs[BK * QP];
    __shared__ __align__(16) unsigned short kt[DQ ? HS * TP : 2];  // k transposed, for dS k
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int i0 = blockIdx.x * BQ;
    const int last = min(i0 + BQ, s.t) - 1;
    unsigned qa[2][KS][4], da[2][KS][4];
    load_tile_h<HS, BQ, QP, H, typename E::q>(stage, q, qv, b, h, i0, s.t);
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int ks_ = 0; ks_ < KS; ++ks_) {
            const unsigned short* p = stage + (warp * 32 + mt * 16 + g) * QP + ks_ * 16 + 2 * tq;
            qa[mt][ks_][0] = lds_pair(p);
            qa[mt][ks_][1] = lds_pair(p + 8 * QP);
            qa[mt][ks_][2] = lds_pair(p + 8);
            qa[mt][ks_][3] = lds_pair(p + 8 * QP + 8);
        }
    }
    __syncthreads();
    load_tile_h<HS, BQ, QP, H, typename E::dout>(stage, dout, dv_, b, h, i0, s.t);
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int ks_ = 0; ks_ < KS; ++ks_) {
            const unsigned short* p = stage + (warp * 32 + mt * 16 + g) * QP + ks_ * 16 + 2 * tq;
            da[mt][ks_][0] = lds_pair(p);
            da[mt][ks_][1] = lds_pair(p + 8 * QP);
            da[mt][ks_][2] = lds_pair(p + 8);
            da[mt][ks_][3] = lds_pair(p + 8 * QP + 8);
        }
    }
    float li[2][2], di[2][2], acc[2][NO][4], dsum[2][2];  // acc: dq (unused for delta)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = i0 + warp * 32 + mt * 16 + g + r * 8;
            const long long at = (long long)bh * s.t + i;
            li[mt][r] = i < s.t ? lse[at] : 0.0f;
            di[mt][r] = DQ && i < s.t ? delta_in[at] : 0.0f;
            dsum[mt][r] = 0.0f;
        }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int n = 0; n < NO; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;
    }
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        load_tile_h<HS, BK, QP, H, typename E::k>(ks, k, kv, b, h, j0, s.t);
        load_tile_h<HS, BK, QP, H, typename E::v>(vs, v, vv, b, h, j0, s.t);
        if (DQ) load_tile_h_t<HS, BK, TP, H, typename E::k>(kt, k, kv, b, h, j0, s.t);
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int row = i0 + warp * 32 + mt * 16 + g;
            if (j0 > row - g + 15) continue;  // uniform in the warp
            float sc[NS][4], dp[NS][4];
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
                dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
#pragma unroll
                for (int ks_ = 0; ks_ < KS; ++ks_) {
                    const int at = (n * 8 + g) * QP + ks_ * 16 + 2 * tq;
                    const unsigned bk[2] = {lds_pair(ks + at), lds_pair(ks + at + 8)};
                    H::mma(sc[n], qa[mt][ks_], bk);
                    const unsigned bv[2] = {lds_pair(vs + at), lds_pair(vs + at + 8)};
                    H::mma(dp[n], da[mt][ks_], bv);
                }
            }
#pragma unroll
            for (int n = 0; n < NS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row + (e >> 1) * 8, j = j0 + n * 8 + 2 * tq + (e & 1);
                    const float p = (j > i || j >= s.t || i >= s.t) ? 0.0f : expf(s.scale * sc[n][e] - li[mt][e >> 1]);
                    if (DQ) {
                        sc[n][e] = s.scale * p * (dp[n][e] - di[mt][e >> 1]);
                    } else {
                        dsum[mt][e >> 1] += p * dp[n][e];
                    }
                }
            }
            if (DQ) {
                unsigned dsa[KP][4];
#pragma unroll
                for (int n = 0; n < NS; ++n) {
                    dsa[n >> 1][(n & 1) * 2 + 0] = pack_half2(H::from(sc[n][0]), H::from(sc[n][1]));
                    dsa[n >> 1][(n & 1) * 2 + 1] = pack_half2(H::from(sc[n][2]), H::from(sc[n][3]));
                }
#pragma unroll
                for (int n = 0; n < NO; ++n) {
#pragma unroll
                    for (int kp = 0; kp < KP; ++kp) {
                        const unsigned short* p = kt + (n * 8 + g) * TP + kp * 16 + 2 * tq;
                        const unsigned bf[2] = {lds_pair(p), lds_pair(p + 8)};
                        H::mma(acc[mt][n], dsa[kp], bf);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = i0 + warp * 32 + mt * 16 + g + r * 8;
            if (DQ) {
                if (i < s.t) {
                    typename E::o::T* dst = dq + dqv.row(b, h, i) + 2 * tq;
#pragma unroll
                    for (int n = 0; n < NO; ++n) {
                        dst[n * 8] = E::o::store(acc[mt][n][2 * r]);
                        dst[n * 8 + 1] = E::o::store(acc[mt][n][2 * r + 1]);
                    }
                }
            } else {
                float sum = dsum[mt][r];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                if (tq == 0 && i < s.t) delta_out[(long long)bh * s.t + i] = sum;
            }
        }
    }
}

// grid (ceil(T / 64), B * NH), block 64: delta_i = sum_j P_ij (dout_i . v_j).
template <int HS, typename H, typename E>
__device__ void attention_backward_delta_mma(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v,
                                             AttnView vv, const typename E::dout::T* dout, AttnView dv_, const float* lse, float* delta) {
    attention_backward_rows_mma<HS, H, E, false>(s, q, qv, k, kv, v, vv, dout, dv_, lse, nullptr, delta, nullptr, qv);
}

// grid (ceil(T / 64), B * NH), block 64: dq_i = sum_j dS_ij k_j.
template <int HS, typename H, typename E>
__device__ void attention_backward_q_mma(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v,
                                         AttnView vv, const typename E::dout::T* dout, AttnView dv_, const float* lse, const float* delta, typename E::o::T* dq,
                                         AttnView dqv) {
    attention_backward_rows_mma<HS, H, E, true>(s, q, qv, k, kv, v, vv, dout, dv_, lse, delta, nullptr, dq, dqv);
}

// grid (ceil(T / 64), B * NH), block 64: the block's 64 key rows j (32 per warp), the query rows
// i >= j streamed in tiles of 32: dv_j = sum_i P_ij dout_i, and with DK dk_j = sum_i dS_ij q_i
// (without, v, delta and dk are unread).
template <int HS, typename H, typename E, typename DV, bool DK>
__device__ void attention_backward_keys_mma(AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v,
                                            AttnView vv, const typename E::dout::T* dout, AttnView dv_, const float* lse, const float* delta, typename E::o::T* dk,
                                            AttnView dkv, typename DV::T* dv, AttnView dvv) {
    static_assert(HS % 16 == 0 && HS <= 64, "hs: a multiple of 16, at most 64");
    constexpr int BKEY = 64, BQ = 32, KS = HS / 16, NQ = BQ / 8, KQ = BQ / 16, NO = HS / 8;
    constexpr int QP = HS + 8, TP = BQ + 8;
    __shared__ __align__(16) unsigned short ks[BKEY * QP];
    __shared__ __align__(16) unsigned short vs[DK ? BKEY * QP : 2];
    __shared__ __align__(16) unsigned short qs[BQ * QP];
    __shared__ __align__(16) unsigned short dos[DK ? BQ * QP : 2];
    __shared__ __align__(16) unsigned short qt[DK ? HS * TP : 2];
    __shared__ __align__(16) unsigned short dot_[HS * TP];
    __shared__ float ls[BQ], dl[DK ? BQ : 1];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int j0 = blockIdx.x * BKEY;
    load_tile_h<HS, BKEY, QP, H, typename E::k>(ks, k, kv, b, h, j0, s.t);
    if (DK) load_tile_h<HS, BKEY, QP, H, typename E::v>(vs, v, vv, b, h, j0, s.t);
    float dka[2][NO][4], dva[2][NO][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int n = 0; n < NO; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dka[mt][n][e] = dva[mt][n][e] = 0.0f;
        }
    }
    for (int qi0 = j0; qi0 < s.t; qi0 += BQ) {  // query rows before the block see none of its keys
        __syncthreads();
        load_tile_h<HS, BQ, QP, H, typename E::q>(qs, q, qv, b, h, qi0, s.t);
        if (DK) load_tile_h<HS, BQ, QP, H, typename E::dout>(dos, dout, dv_, b, h, qi0, s.t);
        if (DK) load_tile_h_t<HS, BQ, TP, H, typename E::q>(qt, q, qv, b, h, qi0, s.t);
        load_tile_h_t<HS, BQ, TP, H, typename E::dout>(dot_, dout, dv_, b, h, qi0, s.t);
        for (int r = threadIdx.x; r < BQ; r += 64) {
            const long long at = (long long)bh * s.t + qi0 + r;
            ls[r] = qi0 + r < s.t ? lse[at] : 0.0f;
            if (DK) dl[DK ? r : 0] = qi0 + r < s.t ? delta[at] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int kb = j0 + warp * 32 + mt * 16;  // the m-tile's first key
            if (qi0 + BQ - 1 < kb) continue;          // every query of the tile precedes every key (uniform in the warp)
            unsigned ka[KS][4], va[KS][4];
#pragma unroll
            for (int ks_ = 0; ks_ < KS; ++ks_) {
                const int at = (warp * 32 + mt * 16 + g) * QP + ks_ * 16 + 2 * tq;
                ka[ks_][0] = lds_pair(ks + at);
                ka[ks_][1] = lds_pair(ks + at + 8 * QP);
                ka[ks_][2] = lds_pair(ks + at + 8);
                ka[ks_][3] = lds_pair(ks + at + 8 * QP + 8);
                if (DK) {
                    va[ks_][0] = lds_pair(vs + at);
                    va[ks_][1] = lds_pair(vs + at + 8 * QP);
                    va[ks_][2] = lds_pair(vs + at + 8);
                    va[ks_][3] = lds_pair(vs + at + 8 * QP + 8);
                }
            }
            float st[NQ][4], dpt[NQ][4];  // S^T and dP^T: 16 keys x 32 queries
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.0f;
                dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.0f;
#pragma unroll
                for (int ks_ = 0; ks_ < KS; ++ks_) {
                    const int at = (n * 8 + g) * QP + ks_ * 16 + 2 * tq;
                    const unsigned bq[2] = {lds_pair(qs + at), lds_pair(qs + at + 8)};
                    H::mma(st[n], ka[ks_], bq);
                    if (DK) {
                        const unsigned bd[2] = {lds_pair(dos + at), lds_pair(dos + at + 8)};
                        H::mma(dpt[n], va[ks_], bd);
                    }
                }
            }
            unsigned pa[KQ][4], dsa[KQ][4];
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                float p[4], ds[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = kb + g + (e >> 1) * 8, r = n * 8 + 2 * tq + (e & 1), i = qi0 + r;
                    p[e] = (i < j || i >= s.t) ? 0.0f : expf(s.scale * st[n][e] - ls[r]);
                    ds[e] = DK ? s.scale * p[e] * (dpt[n][e] - dl[DK ? r : 0]) : 0.0f;
                }
                pa[n >> 1][(n & 1) * 2 + 0] = pack_half2(H::from(p[0]), H::from(p[1]));
                pa[n >> 1][(n & 1) * 2 + 1] = pack_half2(H::from(p[2]), H::from(p[3]));
                dsa[n >> 1][(n & 1) * 2 + 0] = pack_half2(H::from(ds[0]), H::from(ds[1]));
                dsa[n >> 1][(n & 1) * 2 + 1] = pack_half2(H::from(ds[2]), H::from(ds[3]));
            }
#pragma unroll
            for (int n = 0; n < NO; ++n) {
#pragma unroll
                for (int kq = 0; kq < KQ; ++kq) {
                    const int at = (n * 8 + g) * TP + kq * 16 + 2 * tq;
                    const unsigned bd[2] = {lds_pair(dot_ + at), lds_pair(dot_ + at + 8)};
                    H::mma(dva[mt][n], pa[kq], bd);
                    if (DK) {
                        const unsigned bq[2] = {lds_pair(qt + at), lds_pair(qt + at + 8)};
                        H::mma(dka[mt][n], dsa[kq], bq);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = j0 + warp * 32 + mt * 16 + g + r * 8;
            if (j < s.t) {
                typename DV::T* dvr = dv + dvv.row(b, h, j) + 2 * tq;
#pragma unroll
                for (int n = 0; n < NO; ++n) {
                    if (DK) {
                        typename E::o::T* dkr = dk + dkv.row(b, h, j) + 2 * tq;
                        dkr[n * 8] = E::o::store(dka[mt][n][2 * r]);
                        dkr[n * 8 + 1] = E::o::store(dka[mt][n][2 * r + 1]);
                    }
                    dvr[n * 8] = DV::store(dva[mt][n][2 * r]);
                    dvr[n * 8 + 1] = DV::store(dva[mt][n][2 * r + 1]);
                }
            }
        }
    }
}

// grid (ceil(T / 64), B * NH), block 64: dk_j = sum_i dS_ij q_i, dv_j = sum_i P_ij dout_i.
template <int HS, typename H, typename E>
__device__ void attention_backward_kv_mma(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v,
                                          AttnView vv, const typename E::dout::T* dout, AttnView dv_, const float* lse, const float* delta, typename E::o::T* dk,
                                          AttnView dkv, typename E::o2::T* dv, AttnView dvv) {
    attention_backward_keys_mma<HS, H, E, typename E::o2, true>(s, q, qv, k, kv, v, vv, dout, dv_, lse, delta, dk, dkv, dv, dvv);
}

// grid (ceil(T / 64), B * NH), block 64: dv_j = sum_{i >= j} P_ij dout_i.
template <int HS, typename H, typename E>
__device__ void attention_backward_v_mma(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::dout::T* dout,
                                         AttnView dv_, const float* lse, typename E::o::T* dv, AttnView dvv) {
    attention_backward_keys_mma<HS, H, E, typename E::o, false>(s, q, qv, k, kv, nullptr, qv, dout, dv_, lse, nullptr, nullptr, qv, dv, dvv);
}

}  // namespace qatc
