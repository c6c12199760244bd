// qatc_attention.cuh: causal attention over [B, NH, T, hs] in fp32, tiled so the T x T scores
// never reach device memory. One thread owns one query row (or, in the key/value gradient, one
// key row) and keeps it in registers; a block of threads streams the other side through shared
// memory in tiles. The softmax is online (a running max m and sum l per row, rescaling the
// accumulator when m grows); the backward recomputes the probabilities from the forward's
// log-sum-exp, FlashAttention-2 style, with no atomics: every output row has one owner.
//
// Semantics are those of the unfused graph: P = softmax(scale * q k^T) with keys j > i masked,
// out = P v; dS = scale * P * (dout v^T - delta), delta_i = sum_j P_ij (dout_i . v_j);
// dq = dS k, dk = dS^T q, dv = P^T dout.
//
// The views may hold f32 or the 16-bit compute type (`--precision`, where the lowering hands the
// kernels the stored values, `LowerOptions::attention_reads_stored`): each is read through its
// element type (`AttnElems`), widened to f32 exactly, and each result rounded to its view's type
// once, at its store; the math is f32 either way.
#pragma once

namespace qatc {

// Where element (b, h, t, d) of one operand lives: off + b*sb + h*sh + t*st + d.
struct AttnView {
    long long off, sb, sh, st;
    __device__ __forceinline__ long long row(int b, int h, int t) const { return off + b * sb + h * sh + (long long)t * st; }
};

struct AttnShape {
    int nh, t;
    float scale;
};

// The element types of a kernel's [B, NH, T, hs] views by role (the Elem* tags of
// qatc_common.cuh; ElemF32 where the part has no such view): q, k, v and dout are read; o (out,
// dq, dk, or the dv of attention_backward_v) and o2 (the dv of attention_backward_kv) written.
// lse and delta are f32 rows. The kernels take a value of it as their first argument (a tag: the
// types are deduced from it, the call's template arguments staying the tile sizes).
template <typename Q, typename K, typename V, typename D, typename O, typename O2>
struct AttnElems {
    typedef Q q;
    typedef K k;
    typedef V v;
    typedef D dout;
    typedef O o;
    typedef O2 o2;
};

// Loads rows [j0, j0 + R) of one (b, h) into a shared tile, zero past T.
template <int HS, int R, int THREADS, typename X>
__device__ __forceinline__ void load_tile(float (*tile)[HS], const typename X::T* x, AttnView xv, int b, int h, int j0, int T) {
    for (int e = threadIdx.x; e < R * HS; e += THREADS) {
        const int r = e / HS, d = e % HS, j = j0 + r;
        tile[r][d] = j < T ? X::load(x[xv.row(b, h, j) + d]) : 0.0f;
    }
}

template <int HS>
__device__ __forceinline__ float dot(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll
    for (int d = 0; d < HS; ++d) s += a[d] * b[d];
    return s;
}

// grid (ceil(T / BQ), B * NH), block BQ. out = softmax(scale q k^T, causal) v; lse [B*NH, T].
template <int HS, int BQ, int BK, typename E>
__device__ void attention_forward(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v, AttnView vv,
                                  typename E::o::T* out, AttnView ov, float* lse) {
    __shared__ float ks[BK][HS];
    __shared__ float vs[BK][HS];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int i = blockIdx.x * BQ + threadIdx.x;
    const int last = min((int)(blockIdx.x + 1) * BQ, s.t) - 1;  // the block's last query row
    float qr[HS], acc[HS];
    float m = -INFINITY, l = 0.0f;
#pragma unroll
    for (int d = 0; d < HS; ++d) {
        qr[d] = i < s.t ? E::q::load(q[qv.row(b, h, i) + d]) : 0.0f;
        acc[d] = 0.0f;
    }
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        load_tile<HS, BK, BQ, typename E::k>(ks, k, kv, b, h, j0, s.t);
        load_tile<HS, BK, BQ, typename E::v>(vs, v, vv, b, h, j0, s.t);
        __syncthreads();
        const int n = min(BK, i - j0 + 1);  // causal: keys j0 .. i of this tile
        for (int r = 0; r < n; ++r) {
            const float x = s.scale * dot<HS>(qr, ks[r]);
            if (x > m) {
                const float c = expf(m - x);
                l *= c;
#pragma unroll
                for (int d = 0; d < HS; ++d) acc[d] *= c;
                m = x;
            }
            const float p = expf(x - m);
            l += p;
#pragma unroll
            for (int d = 0; d < HS; ++d) acc[d] += p * vs[r][d];
        }
    }
    if (i < s.t) {
#pragma unroll
        for (int d = 0; d < HS; ++d) out[ov.row(b, h, i) + d] = E::o::store(acc[d] / l);
        lse[(long long)bh * s.t + i] = m + logf(l);
    }
}

// grid (ceil(T / BQ), B * NH), block BQ: delta_i = sum_j P_ij (dout_i . v_j) (= dout_i . out_i).
template <int HS, int BQ, int BK, typename E>
__device__ void attention_backward_delta(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v, AttnView vv,
                                         const typename E::dout::T* dout, AttnView dv_, const float* lse, float* delta) {
    __shared__ float ks[BK][HS];
    __shared__ float vs[BK][HS];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int i = blockIdx.x * BQ + threadIdx.x;
    const int last = min((int)(blockIdx.x + 1) * BQ, s.t) - 1;
    float qr[HS], dor[HS];
#pragma unroll
    for (int d = 0; d < HS; ++d) {
        qr[d] = i < s.t ? E::q::load(q[qv.row(b, h, i) + d]) : 0.0f;
        dor[d] = i < s.t ? E::dout::load(dout[dv_.row(b, h, i) + d]) : 0.0f;
    }
    const float li = i < s.t ? lse[(long long)bh * s.t + i] : 0.0f;
    float acc = 0.0f;
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        load_tile<HS, BK, BQ, typename E::k>(ks, k, kv, b, h, j0, s.t);
        load_tile<HS, BK, BQ, typename E::v>(vs, v, vv, b, h, j0, s.t);
        __syncthreads();
        const int n = min(BK, i - j0 + 1);
        for (int r = 0; r < n; ++r) {
            const float p = expf(s.scale * dot<HS>(qr, ks[r]) - li);
            acc += p * dot<HS>(dor, vs[r]);
        }
    }
    if (i < s.t) delta[(long long)bh * s.t + i] = acc;
}

// grid (ceil(T / BQ), B * NH), block BQ: dq_i = sum_j dS_ij k_j.
template <int HS, int BQ, int BK, typename E>
__device__ void attention_backward_q(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v, AttnView vv,
                                     const typename E::dout::T* dout, AttnView dv_, const float* lse, const float* delta, typename E::o::T* dq, AttnView dqv) {
    __shared__ float ks[BK][HS];
    __shared__ float vs[BK][HS];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int i = blockIdx.x * BQ + threadIdx.x;
    const int last = min((int)(blockIdx.x + 1) * BQ, s.t) - 1;
    float qr[HS], dor[HS], acc[HS];
#pragma unroll
    for (int d = 0; d < HS; ++d) {
        qr[d] = i < s.t ? E::q::load(q[qv.row(b, h, i) + d]) : 0.0f;
        dor[d] = i < s.t ? E::dout::load(dout[dv_.row(b, h, i) + d]) : 0.0f;
        acc[d] = 0.0f;
    }
    const long long row = (long long)bh * s.t + i;
    const float li = i < s.t ? lse[row] : 0.0f, di = i < s.t ? delta[row] : 0.0f;
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        load_tile<HS, BK, BQ, typename E::k>(ks, k, kv, b, h, j0, s.t);
        load_tile<HS, BK, BQ, typename E::v>(vs, v, vv, b, h, j0, s.t);
        __syncthreads();
        const int n = min(BK, i - j0 + 1);
        for (int r = 0; r < n; ++r) {
            const float p = expf(s.scale * dot<HS>(qr, ks[r]) - li);
            const float ds = s.scale * p * (dot<HS>(dor, vs[r]) - di);
#pragma unroll
            for (int d = 0; d < HS; ++d) acc[d] += ds * ks[r][d];
        }
    }
    if (i < s.t) {
#pragma unroll
        for (int d = 0; d < HS; ++d) dq[dqv.row(b, h, i) + d] = E::o::store(acc[d]);
    }
}

// grid (ceil(T / BK), B * NH), block BK; one thread per key row j, query rows i >= j streamed:
// dk_j = sum_i dS_ij q_i, dv_j = sum_i P_ij dout_i.
template <int HS, int BK, int BQ, typename E>
__device__ void attention_backward_kv(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::v::T* v, AttnView vv,
                                      const typename E::dout::T* dout, AttnView dv_, const float* lse, const float* delta,
                                      typename E::o::T* dk, AttnView dkv, typename E::o2::T* dv, AttnView dvv) {
    __shared__ float qs[BQ][HS];
    __shared__ float ds_[BQ][HS];
    __shared__ float ls[BQ], dl[BQ];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int j = blockIdx.x * BK + threadIdx.x;
    float kr[HS], vr[HS], dka[HS], dva[HS];
#pragma unroll
    for (int d = 0; d < HS; ++d) {
        kr[d] = j < s.t ? E::k::load(k[kv.row(b, h, j) + d]) : 0.0f;
        vr[d] = j < s.t ? E::v::load(v[vv.row(b, h, j) + d]) : 0.0f;
        dka[d] = 0.0f;
        dva[d] = 0.0f;
    }
    for (int i0 = blockIdx.x * BK; i0 < s.t; i0 += BQ) {  // query rows before the block see none of its keys
        __syncthreads();
        load_tile<HS, BQ, BK, typename E::q>(qs, q, qv, b, h, i0, s.t);
        load_tile<HS, BQ, BK, typename E::dout>(ds_, dout, dv_, b, h, i0, s.t);
        for (int r = threadIdx.x; r < BQ; r += BK) {
            const long long row = (long long)bh * s.t + i0 + r;
            ls[r] = i0 + r < s.t ? lse[row] : 0.0f;
            dl[r] = i0 + r < s.t ? delta[row] : 0.0f;
        }
        __syncthreads();
        if (j >= s.t) continue;
        for (int r = max(0, j - i0); r < BQ && i0 + r < s.t; ++r) {  // causal: i >= j
            const float p = expf(s.scale * dot<HS>(qs[r], kr) - ls[r]);
            const float ds = s.scale * p * (dot<HS>(ds_[r], vr) - dl[r]);
#pragma unroll
            for (int d = 0; d < HS; ++d) {
                dva[d] += p * ds_[r][d];
                dka[d] += ds * qs[r][d];
            }
        }
    }
    if (j < s.t) {
#pragma unroll
        for (int d = 0; d < HS; ++d) {
            dk[dkv.row(b, h, j) + d] = E::o::store(dka[d]);
            dv[dvv.row(b, h, j) + d] = E::o2::store(dva[d]);
        }
    }
}

// grid (ceil(T / BQ), B * NH), block BQ: lse_i = log sum_{j <= i} exp(scale q_i . k_j), for a
// backward pass whose forward output was not kept.
template <int HS, int BQ, int BK, typename E>
__device__ void attention_lse(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, float* lse) {
    __shared__ float ks[BK][HS];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int i = blockIdx.x * BQ + threadIdx.x;
    const int last = min((int)(blockIdx.x + 1) * BQ, s.t) - 1;
    float qr[HS];
#pragma unroll
    for (int d = 0; d < HS; ++d) qr[d] = i < s.t ? E::q::load(q[qv.row(b, h, i) + d]) : 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        load_tile<HS, BK, BQ, typename E::k>(ks, k, kv, b, h, j0, s.t);
        __syncthreads();
        const int n = min(BK, i - j0 + 1);
        for (int r = 0; r < n; ++r) {
            const float x = s.scale * dot<HS>(qr, ks[r]);
            if (x > m) {
                l *= expf(m - x);
                m = x;
            }
            l += expf(x - m);
        }
    }
    if (i < s.t) lse[(long long)bh * s.t + i] = m + logf(l);
}

// grid (ceil(T / BK), B * NH), block BK; one thread per key row j: dv_j = sum_{i >= j} P_ij dout_i.
template <int HS, int BK, int BQ, typename E>
__device__ void attention_backward_v(E, AttnShape s, const typename E::q::T* q, AttnView qv, const typename E::k::T* k, AttnView kv, const typename E::dout::T* dout, AttnView dv_,
                                     const float* lse, typename E::o::T* dv, AttnView dvv) {
    __shared__ float qs[BQ][HS];
    __shared__ float ds_[BQ][HS];
    __shared__ float ls[BQ];
    const int bh = blockIdx.y, b = bh / s.nh, h = bh % s.nh;
    const int j = blockIdx.x * BK + threadIdx.x;
    float kr[HS], dva[HS];
#pragma unroll
    for (int d = 0; d < HS; ++d) {
        kr[d] = j < s.t ? E::k::load(k[kv.row(b, h, j) + d]) : 0.0f;
        dva[d] = 0.0f;
    }
    for (int i0 = blockIdx.x * BK; i0 < s.t; i0 += BQ) {
        __syncthreads();
        load_tile<HS, BQ, BK, typename E::q>(qs, q, qv, b, h, i0, s.t);
        load_tile<HS, BQ, BK, typename E::dout>(ds_, dout, dv_, b, h, i0, s.t);
        for (int r = threadIdx.x; r < BQ; r += BK) ls[r] = i0 + r < s.t ? lse[(long long)bh * s.t + i0 + r] : 0.0f;
        __syncthreads();
        if (j >= s.t) continue;
        for (int r = max(0, j - i0); r < BQ && i0 + r < s.t; ++r) {
            const float p = expf(s.scale * dot<HS>(qs[r], kr) - ls[r]);
#pragma unroll
            for (int d = 0; d < HS; ++d) dva[d] += p * ds_[r][d];
        }
    }
    if (j < s.t) {
#pragma unroll
        for (int d = 0; d < HS; ++d) dv[dvv.row(b, h, j) + d] = E::o::store(dva[d]);
    }
}

}  // namespace qatc
