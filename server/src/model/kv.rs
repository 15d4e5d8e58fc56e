//! KV caches and attention against them, for decoding.
//!
//! On CPU with f32 the cache is a plain growable buffer per layer and attention for all
//! sequences of a step runs in one parallel kernel: a decode step of 8 sequences is 30
//! kernel calls instead of thousands of small tensor ops. Elsewhere the cache holds
//! tensors and attention goes through [`ops::attention`], the same code training uses.

use candle_core::{Device, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;

use super::backend::Backend;
use super::cpu::kernels::dot;
use super::cpu::vector_math::exp_f32;
use super::ops;
use super::transformer::SeqSpan;

/// Keys and values of one sequence in one layer, `(tokens, kv_dim)` each.
#[derive(Debug, Clone)]
enum LayerKv {
    Tensors {
        k: Tensor,
        v: Tensor,
    },
    Host {
        k: Vec<f32>,
        v: Vec<f32>,
        kv_dim: usize,
    },
}

impl LayerKv {
    fn len(&self) -> usize {
        match self {
            LayerKv::Tensors { k, .. } => k.dims()[0],
            LayerKv::Host { k, kv_dim, .. } => k.len() / kv_dim,
        }
    }
}

/// The KV cache of one sequence: one entry per layer once it has been prefilled.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<LayerKv>,
}

impl KvCache {
    /// Tokens already cached.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Appends the new keys and values of every sequence to its cache for layer `index`
/// and returns the attention output for the new rows, `(rows, heads*hd)`.
#[allow(clippy::too_many_arguments)]
pub fn cached_attention(
    be: Backend,
    index: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[SeqSpan],
    caches: &mut [&mut KvCache],
    heads: usize,
    kv_heads: usize,
) -> candle_core::Result<Tensor> {
    if be.host_f32(q) {
        return host_attention(index, q, k, v, seqs, caches, heads);
    }
    let mut outs = Vec::with_capacity(seqs.len());
    for (s, cache) in seqs.iter().zip(caches.iter_mut()) {
        let (mut ks, mut vs) = (k.narrow(0, s.start, s.len)?, v.narrow(0, s.start, s.len)?);
        match cache.layers.get_mut(index) {
            Some(LayerKv::Tensors { k: ck, v: cv }) => {
                *ck = Tensor::cat(&[&*ck, &ks], 0)?;
                *cv = Tensor::cat(&[&*cv, &vs], 0)?;
                (ks, vs) = (ck.clone(), cv.clone());
            }
            Some(LayerKv::Host { .. }) => candle_core::bail!("KV cache built on another device"),
            None => cache.layers.push(LayerKv::Tensors {
                k: ks.clone(),
                v: vs.clone(),
            }),
        }
        let (o, _) = ops::attention(be, &q.narrow(0, s.start, s.len)?, &ks, &vs, heads, kv_heads)?;
        outs.push(o);
    }
    Tensor::cat(&outs, 0)
}

fn host_attention(
    index: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[SeqSpan],
    caches: &mut [&mut KvCache],
    heads: usize,
) -> candle_core::Result<Tensor> {
    let (rows, qd) = q.dims2()?;
    let kv_dim = k.dims()[1];
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let kv: Vec<f32> = k.flatten_all()?.to_vec1()?;
    let vv: Vec<f32> = v.flatten_all()?.to_vec1()?;
    let mut out = vec![0f32; rows * qd];
    attend_host(
        index,
        HostQkv {
            q: &qv,
            k: &kv,
            v: &vv,
            kv_dim,
        },
        seqs,
        caches,
        heads,
        &mut out,
    )?;
    Tensor::from_vec(out, (rows, qd), &Device::Cpu)
}

/// New rows' queries `(rows, heads*hd)` and keys and values `(rows, kv_dim)`, row-major.
pub struct HostQkv<'a> {
    /// Queries, after RoPE.
    pub q: &'a [f32],
    /// Keys, after RoPE.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Width of a key or value row.
    pub kv_dim: usize,
}

/// [`cached_attention`] over plain buffers on the CPU: appends each sequence's new keys
/// and values to its host cache for layer `index` and writes the attention output of
/// every new row into `out`, `(rows, heads*hd)`.
pub fn attend_host(
    index: usize,
    new: HostQkv<'_>,
    seqs: &[SeqSpan],
    caches: &mut [&mut KvCache],
    heads: usize,
    out: &mut [f32],
) -> candle_core::Result<()> {
    let HostQkv {
        q: qv,
        k: kv,
        v: vv,
        kv_dim,
    } = new;
    let qd = out.len() / seqs.iter().map(|s| s.len).sum::<usize>().max(1);
    let hd = qd / heads;
    let scale = 1.0 / (hd as f32).sqrt();
    // Split the output rows by sequence so each sequence's work owns its slice.
    let mut chunks: Vec<&mut [f32]> = Vec::with_capacity(seqs.len());
    let mut rest = out;
    for s in seqs {
        let (head, tail) = rest.split_at_mut(s.len * qd);
        chunks.push(head);
        rest = tail;
    }
    let work: Vec<_> = seqs.iter().zip(caches.iter_mut()).zip(chunks).collect();
    work.into_par_iter()
        .try_for_each(|((s, cache), out_rows)| -> candle_core::Result<()> {
            let new_k = &kv[s.start * kv_dim..(s.start + s.len) * kv_dim];
            let new_v = &vv[s.start * kv_dim..(s.start + s.len) * kv_dim];
            if cache.layers.len() <= index {
                cache.layers.push(LayerKv::Host {
                    k: Vec::with_capacity(new_k.len() * 4),
                    v: Vec::with_capacity(new_v.len() * 4),
                    kv_dim,
                });
            }
            let LayerKv::Host { k: ck, v: cv, .. } = &mut cache.layers[index] else {
                candle_core::bail!("KV cache built on another device");
            };
            ck.extend_from_slice(new_k);
            cv.extend_from_slice(new_v);
            let total = ck.len() / kv_dim;
            let (ck, cv) = (&*ck, &*cv);
            let q_rows = &qv[s.start * qd..(s.start + s.len) * qd];
            let attend = |(i, (o, qr)): (usize, (&mut [f32], &[f32]))| {
                let cache = HostLayer {
                    k: ck,
                    v: cv,
                    visible: total - s.len + i + 1,
                    kv_dim,
                };
                attend_row(qr, cache, hd, scale, o);
            };
            // A decode step has one row per sequence: no second level of tasks for it.
            if s.len == 1 {
                let rows = out_rows.chunks_exact_mut(qd).zip(q_rows.chunks_exact(qd));
                rows.enumerate().for_each(attend);
            } else {
                let rows = out_rows.par_chunks_mut(qd).zip(q_rows.par_chunks(qd));
                rows.enumerate().for_each(attend);
            }
            Ok(())
        })?;
    Ok(())
}

/// One layer's cached keys and values of a sequence, `(tokens, kv_dim)` each, of which
/// the first `visible` rows are attended to.
#[derive(Clone, Copy)]
struct HostLayer<'a> {
    k: &'a [f32],
    v: &'a [f32],
    visible: usize,
    kv_dim: usize,
}

/// Attention of one query row `q` (its heads, `hd` values each) over `cache`, written
/// to `out`; consecutive query heads share a key/value head. Compiled for AVX-512 and
/// AVX2 too, picked at run time (the default target has only SSE2); the lanes are
/// explicit ([`dot`]), so every version computes the same floats.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn attend_row(q: &[f32], cache: HostLayer<'_>, hd: usize, scale: f32, out: &mut [f32]) {
    let HostLayer {
        k,
        v,
        visible,
        kv_dim,
    } = cache;
    let group = q.len() / kv_dim;
    let mut p = vec![0f32; visible];
    for (h, (qh, oh)) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).enumerate() {
        let at = (h / group) * hd;
        let mut max = f32::NEG_INFINITY;
        for (j, pj) in p.iter_mut().enumerate() {
            *pj = dot(qh, &k[j * kv_dim + at..j * kv_dim + at + hd]) * scale;
            max = max.max(*pj);
        }
        let mut sum = 0f32;
        for pj in p.iter_mut() {
            *pj = exp_f32(*pj - max);
            sum += *pj;
        }
        oh.fill(0.0);
        for (j, pj) in p.iter().enumerate() {
            let w = pj / sum;
            for (x, y) in oh.iter_mut().zip(&v[j * kv_dim + at..j * kv_dim + at + hd]) {
                *x += w * y;
            }
        }
    }
}
