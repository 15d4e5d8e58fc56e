//! The per-row loops of the fused kernels ([`super::kernels`], [`super::attention`]),
//! each compiled for AVX-512 and AVX2 too and picked at run time.
//!
//! A build for the default x86-64 target may use SSE2 alone, so a loop the compiler
//! vectorises runs four lanes wide; these run sixteen (AVX-512) or eight (AVX2) wide
//! where the CPU has them. Each is elementwise, with no reduction, so every version
//! computes the same floats. Each writes every element of its output and panics when its
//! inputs' lengths disagree with it (the callers write outputs that were never zeroed).

use std::mem::MaybeUninit;

use multiversion::multiversion;

use super::kernels::Real;

#[inline(always)]
fn sigmoid<T: Real>(v: T) -> T {
    T::one() / (T::one() + (-v).fast_exp())
}

/// `out = a + b`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn add<T: Real>(out: &mut [MaybeUninit<T>], a: &[T], b: &[T]) {
    assert!(
        a.len() == out.len() && b.len() == out.len(),
        "add: lengths differ"
    );
    for ((o, &x), &z) in out.iter_mut().zip(a).zip(b) {
        o.write(x + z);
    }
}

/// RMSNorm's output row: `out = x r w`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn norm_scale<T: Real>(out: &mut [MaybeUninit<T>], x: &[T], w: &[T], r: T) {
    assert!(
        x.len() == out.len() && w.len() == out.len(),
        "norm_scale: lengths differ"
    );
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        o.write(v * r * g);
    }
}

/// RMSNorm's input gradient row: `out = r (dy w - x r m)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn norm_grad<T: Real>(out: &mut [MaybeUninit<T>], dy: &[T], x: &[T], w: &[T], r: T, m: T) {
    let n = out.len();
    assert!(
        dy.len() == n && x.len() == n && w.len() == n,
        "norm_grad: lengths differ"
    );
    for (((o, &d), &v), &g) in out.iter_mut().zip(dy).zip(x).zip(w) {
        o.write(r * (d * g - v * r * m));
    }
}

/// SwiGLU's output row: `out = silu(g) u`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn swiglu<T: Real>(out: &mut [MaybeUninit<T>], g: &[T], u: &[T]) {
    assert!(
        g.len() == out.len() && u.len() == out.len(),
        "swiglu: lengths differ"
    );
    for ((o, &gv), &uv) in out.iter_mut().zip(g).zip(u) {
        o.write(gv * sigmoid(gv) * uv);
    }
}

/// SwiGLU's gradient row: `dg` and `du` of `dy` through `silu(g) u`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn swiglu_grad<T: Real>(
    dg: &mut [MaybeUninit<T>],
    du: &mut [MaybeUninit<T>],
    g: &[T],
    u: &[T],
    dy: &[T],
) {
    let n = dg.len();
    let same = du.len() == n && g.len() == n && u.len() == n && dy.len() == n;
    assert!(same, "swiglu_grad: lengths differ");
    for i in 0..n {
        let s = sigmoid(g[i]);
        du[i].write(dy[i] * g[i] * s);
        dg[i].write(dy[i] * u[i] * s * (T::one() + g[i] * (T::one() - s)));
    }
}

/// Rotate-half RoPE of one head: `out[i] = x1 c - x2 s`, `out[i + half] = x2 c + x1 s`
/// with `s` times `sign`, `half` being `c.len()`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn rope<T: Real>(out: &mut [MaybeUninit<T>], x: &[T], c: &[T], s: &[T], sign: T) {
    let half = c.len();
    let same = out.len() == 2 * half && x.len() == 2 * half && s.len() == half;
    assert!(same, "rope: lengths differ");
    let (lo, hi) = out.split_at_mut(half);
    let (x1, x2) = x.split_at(half);
    for i in 0..half {
        let sn = s[i] * sign;
        lo[i].write(x1[i] * c[i] - x2[i] * sn);
        hi[i].write(x2[i] * c[i] + x1[i] * sn);
    }
}

/// The log-softmax gradient's dense part: `out = -e^(x - lse) total`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn neg_softmax_times<T: Real>(out: &mut [MaybeUninit<T>], x: &[T], lse: T, total: T) {
    assert_eq!(x.len(), out.len(), "neg_softmax_times: lengths differ");
    for (o, &v) in out.iter_mut().zip(x) {
        o.write(-(v - lse).fast_exp() * total);
    }
}

/// `row *= k`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn scale(row: &mut [f32], k: f32) {
    row.iter_mut().for_each(|v| *v *= k);
}

/// The softmax gradient in place: `d = scale p (d - dot)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn softmax_grad(d: &mut [f32], p: &[f32], dot: f32, scale: f32) {
    for (v, &pv) in d.iter_mut().zip(p) {
        *v = scale * pv * (*v - dot);
    }
}
