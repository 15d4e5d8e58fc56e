// Lathe's fused CUDA kernels: the device backend's RMSNorm, RoPE, SwiGLU, causal
// softmax and output log-softmax, forward and backward, and the AdamW step with its
// gradient norm, in f32 on contiguous row-major tensors. Each computes what the candle composite of `model/ops.rs` computes, in fewer
// passes over memory; `server/tests/cuda_kernels.rs` holds each to its composite on a GPU.
//
// Row kernels run one block of ROW_THREADS threads per row and reduce in shared memory;
// elementwise kernels run a grid-stride loop. Sizes arrive as 64-bit integers (a row
// count times a width can pass 2^31 on a large GPU).

#include <stdint.h>

#define ROW_THREADS 256

// Sum of `v` over the block; every thread gets the result. `scratch` holds one value
// per warp.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// Maximum of `v` over the block; every thread gets the result.
__device__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// 1 / sqrt(mean(x^2) + eps) of the block's row.
__device__ float row_rstd(const float* x, int64_t d, float eps, float* scratch) {
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += x[j] * x[j];
    ss = block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)d + eps);
}

// RMSNorm forward: y = x * rstd * w, and rstd per row.
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* y, float* rstd,
                                        int64_t d, float eps) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * d;
    const float r = row_rstd(xr, d, eps, scratch);
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) y[row * d + j] = xr[j] * r * w[j];
    if (threadIdx.x == 0) rstd[row] = r;
}

// RMSNorm input gradient: dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w,
// xhat = x * rstd.
extern "C" __global__ void rms_norm_backward_f32(const float* dy, const float* x, const float* w,
                                                 const float* rstd, float* dx, int64_t d) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float r = rstd[row];
    const float* xr = x + row * d;
    const float* dyr = dy + row * d;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dot += dyr[j] * w[j] * xr[j] * r;
    const float mean = block_sum(dot, scratch) / (float)d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
        dx[row * d + j] = r * (dyr[j] * w[j] - xr[j] * r * mean);
}

// Rotate-half RoPE of x (n, heads, hd) by cos/sin (n, hd/2); sign -1 rotates back
// (the backward pass).
extern "C" __global__ void rope_f32(const float* x, const float* cos_t, const float* sin_t,
                                    float* y, int64_t n, int64_t heads, int64_t hd, float sign) {
    const int64_t half = hd / 2;
    const int64_t total = n * heads * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t f = i % half;
        const int64_t row = i / half;  // token * heads + head
        const int64_t tok = row / heads;
        const float c = cos_t[tok * half + f], s = sign * sin_t[tok * half + f];
        const float x1 = x[row * hd + f], x2 = x[row * hd + half + f];
        y[row * hd + f] = x1 * c - x2 * s;
        y[row * hd + half + f] = x2 * c + x1 * s;
    }
}

// SwiGLU forward of the stacked gate_up (n, 2f): y = silu(gate) * up, (n, f).
extern "C" __global__ void swiglu_f32(const float* gu, float* y, int64_t n, int64_t f) {
    const int64_t total = n * f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / f, j = i % f;
        const float g = gu[row * 2 * f + j], u = gu[row * 2 * f + f + j];
        y[i] = g / (1.0f + expf(-g)) * u;
    }
}

// SwiGLU backward: [dgate | dup] (n, 2f) of dy (n, f).
extern "C" __global__ void swiglu_backward_f32(const float* dy, const float* gu, float* dgu,
                                               int64_t n, int64_t f) {
    const int64_t total = n * f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / f, j = i % f;
        const float g = gu[row * 2 * f + j], u = gu[row * 2 * f + f + j];
        const float sig = 1.0f / (1.0f + expf(-g));
        dgu[row * 2 * f + j] = dy[i] * u * sig * (1.0f + g * (1.0f - sig));
        dgu[row * 2 * f + f + j] = dy[i] * g * sig;
    }
}

// Causal softmax of unscaled scores (rows, tk), rows = heads-in-group * tq stacked:
// row r is query r % tq at position tk - tq + r % tq and sees keys up to it;
// p = softmax(scale * s) over those keys, 0 beyond.
extern "C" __global__ void causal_softmax_f32(const float* s, float* p, int64_t tq, int64_t tk,
                                              float scale) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const int64_t visible = tk - tq + row % tq + 1;
    const float* sr = s + row * tk;
    float* pr = p + row * tk;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) m = fmaxf(m, sr[j] * scale);
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) sum += expf(sr[j] * scale - m);
    sum = block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (int64_t j = threadIdx.x; j < tk; j += blockDim.x)
        pr[j] = j < visible ? expf(sr[j] * scale - m) * inv : 0.0f;
}

// Softmax backward through the scale: ds = scale * p * (dp - sum(dp * p)), per row.
extern "C" __global__ void softmax_backward_f32(const float* p, const float* dp, float* ds,
                                                int64_t cols, float scale) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float* prow = p + row * cols;
    const float* dprow = dp + row * cols;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) dot += prow[j] * dprow[j];
    dot = block_sum(dot, scratch);
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
        ds[row * cols + j] = scale * prow[j] * (dprow[j] - dot);
}

// Log-probabilities of k targets per row under logits (n, V): lp (n, k) and lse (n).
extern "C" __global__ void logprobs_at_f32(const float* logits, const uint32_t* targets,
                                           float* lp, float* lse, int64_t v, int64_t k) {
    __shared__ float scratch[32];
    __shared__ float row_lse;
    const int64_t row = blockIdx.x;
    const float* lr = logits + row * v;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, lr[j]);
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) sum += expf(lr[j] - m);
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        row_lse = logf(sum) + m;
        lse[row] = row_lse;
    }
    __syncthreads();
    for (int64_t t = threadIdx.x; t < k; t += blockDim.x) {
        const uint32_t target = targets[row * k + t];
        lp[row * k + t] = target < v ? lr[target] - row_lse : NAN;
    }
}

// Gradient of logprobs_at w.r.t. the logits: scatter(d at targets) - softmax * sum_k d.
extern "C" __global__ void logprobs_at_backward_f32(const float* logits, const float* lse,
                                                    const uint32_t* targets, const float* d,
                                                    float* dl, int64_t v, int64_t k) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    float dsum = 0.0f;
    for (int64_t t = threadIdx.x; t < k; t += blockDim.x) dsum += d[row * k + t];
    dsum = block_sum(dsum, scratch);
    const float l = lse[row];
    const float* lr = logits + row * v;
    float* out = dl + row * v;
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) out[j] = -expf(lr[j] - l) * dsum;
    __syncthreads();
    // One thread adds the targets' terms, so repeated targets in a row add up in order.
    if (threadIdx.x == 0)
        for (int64_t t = 0; t < k; ++t) {
            const uint32_t target = targets[row * k + t];
            if (target < v) out[target] += d[row * k + t];
        }
}

// Element i of one AdamW step, in torch's order of operations, in f32.
__device__ __forceinline__ void adamw_at(int64_t i, const float* p, const float* g,
                                         const float* m, const float* v, float* p_out,
                                         float* m_out, float* v_out, float grad_scale,
                                         float decay, float beta1, float beta2,
                                         float bc2_sqrt, float eps, float step_size) {
    const float gi = g[i] * grad_scale;
    const float mi = m[i] * beta1 + gi * (1.0f - beta1);
    const float vi = v[i] * beta2 + gi * gi * (1.0f - beta2);
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p_out[i] = p[i] * decay - mi / denom * step_size;
    m_out[i] = mi;
    v_out[i] = vi;
}

// One AdamW step of one parameter, in torch's order of operations, in f32, into fresh
// outputs: parameters are shared with sampler snapshots, so they are never written in
// place. Unlike the CPU backend's loop, 1 - beta is taken in f32 from the rounded betas
// (for beta2 = 0.999 that term differs by about 1e-5 relative; the GPU test against
// PyTorch's goldens holds the result to 1e-5).
extern "C" __global__ void adamw_f32(const float* p, const float* g, const float* m,
                                     const float* v, float* p_out, float* m_out, float* v_out,
                                     int64_t n, float grad_scale, float decay, float beta1,
                                     float beta2, float bc2_sqrt, float eps, float step_size) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        adamw_at(i, p, g, m, v, p_out, m_out, v_out, grad_scale, decay, beta1, beta2,
                 bc2_sqrt, eps, step_size);
}

// sum(x^2) of many f32 tensors in one launch, accumulated in double: block t sums
// tensor t (its pointer in ptrs[t], its length in lens[t]) into out[t].
extern "C" __global__ void sum_squares_many_f32(const uint64_t* ptrs, const int64_t* lens,
                                                double* out) {
    __shared__ double scratch[32];
    const int64_t t = blockIdx.x;
    const float* g = (const float*)ptrs[t];
    const int64_t n = lens[t];
    double acc = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const double x = g[i];
        acc += x * x;
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[t] = acc;
}

// adamw_f32 of many parameters in one launch: blockIdx.y picks the parameter, whose seven
// pointers (p, g, m, v, p_out, m_out, v_out) are ptrs[7 t ..], and the blocks along x
// stride over its lens[t] elements (adamw_at, as adamw_f32).
extern "C" __global__ void adamw_many_f32(const uint64_t* ptrs, const int64_t* lens,
                                          float grad_scale, float decay, float beta1,
                                          float beta2, float bc2_sqrt, float eps,
                                          float step_size) {
    const int64_t t = blockIdx.y;
    const uint64_t* q = ptrs + 7 * t;
    const float* p = (const float*)q[0];
    const float* g = (const float*)q[1];
    const float* m = (const float*)q[2];
    const float* v = (const float*)q[3];
    float* p_out = (float*)q[4];
    float* m_out = (float*)q[5];
    float* v_out = (float*)q[6];
    const int64_t n = lens[t];
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        adamw_at(i, p, g, m, v, p_out, m_out, v_out, grad_scale, decay, beta1, beta2,
                 bc2_sqrt, eps, step_size);
}

// One decode step of attention for many sequences at once, each with its own KV cache
// buffers: one block per (sequence, query head). The block writes the sequence's new key
// and value row (its KV head's part) at row len of the sequence's buffers, then attends
// its query to rows 0..=len. The blocks of one KV head write the same values to the same
// places, so their overlap is harmless. Scores live in dynamic shared memory, len + 1
// floats.
extern "C" __global__ void decode_attention_f32(const float* q, const float* k_new,
                                                const float* v_new, const uint64_t* k_bufs,
                                                const uint64_t* v_bufs, const int64_t* lens,
                                                float* out, int64_t heads, int64_t kv_heads,
                                                int64_t hd, float scale) {
    extern __shared__ float scores[];
    __shared__ float scratch[32];
    const int64_t b = blockIdx.x, h = blockIdx.y;
    const int64_t kvh = h / (heads / kv_heads);
    const int64_t kvd = kv_heads * hd;
    float* kb = reinterpret_cast<float*>(k_bufs[b]);
    float* vb = reinterpret_cast<float*>(v_bufs[b]);
    const int64_t len = lens[b];
    for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) {
        kb[len * kvd + kvh * hd + j] = k_new[b * kvd + kvh * hd + j];
        vb[len * kvd + kvh * hd + j] = v_new[b * kvd + kvh * hd + j];
    }
    __syncthreads();
    const float* qr = q + (b * heads + h) * hd;
    float m = -INFINITY;
    for (int64_t t = threadIdx.x; t <= len; t += blockDim.x) {
        const float* kr = kb + t * kvd + kvh * hd;
        float dot = 0.0f;
        for (int64_t j = 0; j < hd; ++j) dot += qr[j] * kr[j];
        scores[t] = dot * scale;
        m = fmaxf(m, scores[t]);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int64_t t = threadIdx.x; t <= len; t += blockDim.x) {
        const float e = expf(scores[t] - m);
        scores[t] = e;
        sum += e;
    }
    // block_sum's barriers also order the writes of scores before the reads below.
    sum = block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) {
        float acc = 0.0f;
        for (int64_t t = 0; t <= len; ++t) acc += scores[t] * vb[t * kvd + kvh * hd + j];
        out[(b * heads + h) * hd + j] = acc * inv;
    }
}

// The LoRA deltas of a packed multi-adapter batch, Punica/S-LoRA's SGMV in two launches
// per projection (all its parts: q/k/v or gate/up together) instead of a few per adapter
// segment and part. The output's columns are `parts` parts, part p at columns
// cols[p]..cols[p + 1]. Row i of the batch carries its segment's adapter through one
// table (one copy to the device) of 2 * parts * n + n + parts + 1 words: `table[p * n +
// i]` points at part p's A, (r, d), `table[(parts + p) * n + i]` at its B, (w_p, r), the
// low 32 bits of `table[2 * parts * n + i]` are the LoRA scale (an f32), and the last
// parts + 1 words are `cols`. A row or part without factors has null pointers.
//
// Shrink: u[i, p * r + j] = sum_k x[i, k] A_pi[j, k], (n, parts * r); zero where there
// are no factors. One block per (row, part and group of 8 ranks); each warp reduces one
// rank over d.
extern "C" __global__ void lora_shrink_f32(const float* x, const uint64_t* table, float* u,
                                           int64_t n, int64_t parts, int64_t d, int64_t r) {
    const int64_t i = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t groups = (r + (blockDim.x >> 5) - 1) / (blockDim.x >> 5);
    const int64_t p = blockIdx.y / groups;
    const int64_t j = (blockIdx.y % groups) * (blockDim.x >> 5) + warp;
    if (p >= parts || j >= r) return;
    const float* a = reinterpret_cast<const float*>(table[p * n + i]);
    float acc = 0.0f;
    if (a != nullptr) {
        const float* xr = x + i * d;
        const float* ar = a + j * d;
        for (int64_t k = lane; k < d; k += 32) acc += xr[k] * ar[k];
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    }
    if (lane == 0) u[i * parts * r + p * r + j] = acc;
}

// Expand: y[i, c] = base[i, c] + scale_i * sum_j u[i, p * r + j] B_pi[c - cols[p], j]
// for column c of part p, (n, cols[parts]); base alone where there are no factors. One
// block per (row, ROW_THREADS columns); the row of u is staged in shared memory
// (parts * r floats).
extern "C" __global__ void lora_expand_f32(const float* base, const float* u,
                                           const uint64_t* table, float* y, int64_t n,
                                           int64_t parts, int64_t r) {
    extern __shared__ float ur[];
    const int64_t i = blockIdx.x;
    const uint64_t* cols = table + 2 * parts * n + n;
    const int64_t w = (int64_t)cols[parts];
    const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    for (int64_t j = threadIdx.x; j < parts * r; j += blockDim.x) ur[j] = u[i * parts * r + j];
    __syncthreads();
    if (c >= w) return;
    int64_t p = 0;
    while (p + 1 < parts && c >= (int64_t)cols[p + 1]) ++p;
    const float* b = reinterpret_cast<const float*>(table[(parts + p) * n + i]);
    float v = base[i * w + c];
    if (b != nullptr) {
        const float scale = __uint_as_float((uint32_t)table[2 * parts * n + i]);
        const float* br = b + (c - (int64_t)cols[p]) * r;
        const float* up = ur + p * r;
        float acc = 0.0f;
        for (int64_t j = 0; j < r; ++j) acc += up[j] * br[j];
        v += scale * acc;
    }
    y[i * w + c] = v;
}

// Token choice on the device: one block of PICK_THREADS per row of `logits` (n, vocab),
// copying back only each row's token and its log-probability. `params` holds four
// doubles per row: the inverse temperature (0: the most likely token, lowest id on
// ties), top-k (0: none; at most PICK_MAX_K), top-p, and a uniform draw u in [0, 1).
// `out` gets two doubles per row: the token and log_softmax(logits)[token].
//
// The pick is the host picker's (`sample::logits::Picker::pick`): without top-k, the
// cumulative weight exp((l - max) / T) walked in id order to u times the total; with
// top-k, the k most likely tokens (by logit, lower id first on ties) in that order,
// truncated to the nucleus that first reaches top-p of their mass, walked to u times
// the nucleus's mass. Up to rounding at the boundaries the two give the same token.
#define PICK_THREADS 1024
#define PICK_MAX_K 64

// A logit's place in IEEE 754's total order as an int, as Rust's `f32::total_cmp`
// orders them (the host's ranking): -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN.
__device__ __forceinline__ int pick_key(float x) {
    int b = __float_as_int(x);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}

// The better of two candidates by key (`pick_key` for ranking; a plain `>` on logits,
// as the host's argmax, for the greedy pick): the higher, the lower id on ties; id -1
// loses.
template <typename K>
__device__ __forceinline__ bool pick_better(K lv, int64_t li, K rv, int64_t ri) {
    if (ri < 0) return li >= 0;
    if (li < 0) return false;
    return lv > rv || (lv == rv && li < ri);
}

// The block's best candidate by key; every thread gets it. `sv` holds one key per warp.
template <typename K>
__device__ void pick_block_best(K& v, int64_t& id, K* sv, int64_t* si) {
    for (int o = 16; o > 0; o >>= 1) {
        const K ov = __shfl_xor_sync(0xffffffff, v, o);
        const int64_t oi = __shfl_xor_sync(0xffffffff, id, o);
        if (pick_better(ov, oi, v, id)) { v = ov; id = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = id; }
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? sv[lane] : sv[0];
    id = lane < warps ? si[lane] : -1;
    for (int o = 16; o > 0; o >>= 1) {
        const K ov = __shfl_xor_sync(0xffffffff, v, o);
        const int64_t oi = __shfl_xor_sync(0xffffffff, id, o);
        if (pick_better(ov, oi, v, id)) { v = ov; id = oi; }
    }
}

extern "C" __global__ void __launch_bounds__(PICK_THREADS)
pick_tokens_f32(const float* logits, const double* params, double* out, int64_t vocab) {
    __shared__ float sv[32];
    __shared__ int sk[32];
    __shared__ int64_t si[32];
    __shared__ double sd[PICK_THREADS];
    __shared__ int64_t top[PICK_MAX_K];
    __shared__ int64_t chosen;
    const int64_t row = blockIdx.x;
    const float* l = logits + row * vocab;
    const double inv_t = params[4 * row], top_p = params[4 * row + 2], u = params[4 * row + 3];
    const int64_t k = (int64_t)params[4 * row + 1];
    const int tid = threadIdx.x;

    // The most likely token (lowest id on ties; NaN never wins, and a row of NaN gives
    // id 0, as the host's argmax) and the log-softmax normaliser.
    float bv = -INFINITY;
    int64_t bi = -1;
    for (int64_t i = tid; i < vocab; i += blockDim.x) {
        if (pick_better(l[i], i, bv, bi)) { bv = l[i]; bi = i; }
    }
    pick_block_best(bv, bi, sv, si);
    if (bi < 0) bi = 0;
    const float max = l[bi];
    float se = 0.0f;
    for (int64_t i = tid; i < vocab; i += blockDim.x) se += expf(l[i] - max);
    const float lse = logf(block_sum(se, sv));
    if (tid == 0) chosen = bi;
    __syncthreads();

    if (inv_t > 0.0 && k == 0) {
        // Walk the whole vocabulary in id order: each thread owns a contiguous chunk,
        // an exclusive scan of the chunks' sums finds the chunk holding u * total.
        const float it = (float)inv_t;
        const int64_t chunk = (vocab + blockDim.x - 1) / blockDim.x;
        const int64_t lo = min(vocab, tid * chunk), hi = min(vocab, lo + chunk);
        double mine = 0.0;
        for (int64_t i = lo; i < hi; ++i) mine += (double)expf((l[i] - max) * it);
        sd[tid] = mine;
        __syncthreads();
        // Inclusive scan (Hillis-Steele) over the block's chunk sums.
        for (int o = 1; o < (int)blockDim.x; o <<= 1) {
            const double add = tid >= o ? sd[tid - o] : 0.0;
            __syncthreads();
            sd[tid] += add;
            __syncthreads();
        }
        const double total = sd[blockDim.x - 1];
        const double before = tid > 0 ? sd[tid - 1] : 0.0;
        double target = u * total;
        if (tid == 0) chosen = vocab - 1;  // rounding past every weight: the last id
        __syncthreads();
        if (target >= before && target < sd[tid]) {
            target -= before;
            // Rounding may walk past the chunk's end: then its last token with weight.
            int64_t pick = -1, last = lo;
            for (int64_t i = lo; i < hi; ++i) {
                const double w = (double)expf((l[i] - max) * it);
                if (w > 0.0) last = i;
                if (target < w) { pick = i; break; }
                target -= w;
            }
            chosen = pick >= 0 ? pick : last;
        }
        __syncthreads();
    } else if (inv_t > 0.0) {
        // The k most likely tokens in rank order (the host's `total_cmp` order, lower id
        // first on ties): each round takes the best token ranked after the previous
        // round's. k < vocab, so every round finds one.
        int pv = 0;
        int64_t pi = -1;
        for (int64_t r = 0; r < k; ++r) {
            int cv = 0;
            int64_t ci = -1;
            for (int64_t i = tid; i < vocab; i += blockDim.x) {
                const int key = pick_key(l[i]);
                const bool after = pi < 0 || key < pv || (key == pv && i > pi);
                if (after && pick_better(key, i, cv, ci)) { cv = key; ci = i; }
            }
            pick_block_best(cv, ci, sk, si);
            if (tid == 0) top[r] = ci < 0 ? 0 : ci;
            pv = cv;
            pi = ci;
        }
        __syncthreads();
        if (tid == 0) {
            const float it = (float)inv_t, top_max = l[top[0]];
            float w[PICK_MAX_K];
            float total = 0.0f;
            for (int64_t r = 0; r < k; ++r) {
                w[r] = expf((l[top[r]] - top_max) * it);
                total += w[r];
            }
            int64_t keep = k;
            if (top_p < 1.0) {
                double mass = 0.0;
                for (int64_t r = 0; r < k; ++r) {
                    mass += (double)w[r] / (double)total;
                    if (mass >= top_p) { keep = r + 1; break; }
                }
            }
            double mass = 0.0;
            for (int64_t r = 0; r < keep; ++r) mass += (double)w[r];
            double target = u * mass;
            chosen = top[keep - 1];
            for (int64_t r = 0; r < keep; ++r) {
                if (target < (double)w[r]) { chosen = top[r]; break; }
                target -= (double)w[r];
            }
        }
        __syncthreads();
    }
    if (tid == 0) {
        out[2 * row] = (double)chosen;
        out[2 * row + 1] = (double)(l[chosen] - max - lse);
    }
}
