//! KV caches and attention against them, for decoding.
//!
//! On CPU with f32 the cache is a plain growable buffer per layer and attention for all
//! sequences of a step runs in one parallel kernel: a decode step of 8 sequences is 30
//! kernel calls instead of thousands of small tensor ops. Elsewhere (the device
//! backend) the cache is a preallocated tensor per layer on the model's device, written
//! in place, and attention goes through [`ops::attention`], the same code training uses,
//! except a decode step on a GPU, which attends every sequence in one kernel launch.
//! A sequence's cache holds at least the tokens its sampler said it would need
//! ([`KvCache::with_capacity`]); past that its buffers double, so a step never copies
//! the whole cache.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::backend::Backend;
use super::cpu::attention::{probabilities_row, weighted_row};
use super::ops;
use super::transformer::SeqSpan;

/// Keys and values of one sequence in one layer, `(tokens, kv_dim)` each.
#[derive(Debug)]
enum LayerKv {
    /// On the model's device: `(capacity, kv_dim)` buffers whose first `len` rows hold
    /// the tokens so far. Appends write the rows after them in place.
    Device { k: Tensor, v: Tensor, len: usize },
    Host {
        k: Vec<f32>,
        v: Vec<f32>,
        kv_dim: usize,
    },
}

impl LayerKv {
    fn len(&self) -> usize {
        match self {
            LayerKv::Device { len, .. } => *len,
            LayerKv::Host { k, kv_dim, .. } => k.len() / kv_dim,
        }
    }

    /// A copy whose buffers are its own (device buffers are written in place, so two
    /// sequences never share one).
    fn try_clone(&self) -> candle_core::Result<Self> {
        Ok(match self {
            LayerKv::Device { k, v, len } => {
                // Only the filled rows are copied, into buffers of the same capacity.
                let copy = |t: &Tensor| -> candle_core::Result<Tensor> {
                    let fresh = Tensor::zeros(t.shape(), t.dtype(), t.device())?;
                    if *len > 0 {
                        fresh.slice_set(&t.narrow(0, 0, *len)?, 0, 0)?;
                    }
                    Ok(fresh)
                };
                LayerKv::Device {
                    k: copy(k)?,
                    v: copy(v)?,
                    len: *len,
                }
            }
            LayerKv::Host { k, v, kv_dim } => LayerKv::Host {
                k: k.clone(),
                v: v.clone(),
                kv_dim: *kv_dim,
            },
        })
    }
}

/// Writes `new` (`(n, kv_dim)`) after the first `len` rows of `buf`, first moving the
/// filled rows into a buffer of twice the rows needed when `buf` is full; returns the
/// filled rows, `(len + n, kv_dim)`, a view of `buf`.
fn append_rows(buf: &mut Tensor, len: usize, new: &Tensor) -> candle_core::Result<Tensor> {
    let n = new.dim(0)?;
    reserve_rows(buf, len, n)?;
    buf.slice_set(&new.contiguous()?, 0, len)?;
    buf.narrow(0, 0, len + n)
}

/// Makes room for `n` rows after the first `len` of `buf`: when it is full, moves the
/// filled rows into a buffer of twice the rows needed.
fn reserve_rows(buf: &mut Tensor, len: usize, n: usize) -> candle_core::Result<()> {
    let (rows, kv_dim) = buf.dims2()?;
    let need = len + n;
    if need > rows {
        let grown = Tensor::zeros((need * 2, kv_dim), buf.dtype(), buf.device())?;
        if len > 0 {
            grown.slice_set(&buf.narrow(0, 0, len)?, 0, 0)?;
        }
        *buf = grown;
    }
    Ok(())
}

/// The KV cache of one sequence: one entry per layer once it has been prefilled.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    /// Tokens the device buffers are first made for.
    capacity: usize,
}

impl KvCache {
    /// An empty cache whose device buffers will hold `tokens` tokens before they grow
    /// (the prompt plus the most tokens its sampler may add).
    pub fn with_capacity(tokens: usize) -> Self {
        Self {
            layers: Vec::new(),
            capacity: tokens,
        }
    }

    /// A copy with buffers of its own (the samples of one prompt each continue a copy
    /// of its prefilled cache).
    pub fn try_clone(&self) -> candle_core::Result<Self> {
        Ok(Self {
            layers: self
                .layers
                .iter()
                .map(LayerKv::try_clone)
                .collect::<candle_core::Result<_>>()?,
            capacity: self.capacity,
        })
    }

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
    #[cfg(feature = "cuda")]
    if be.cuda(q)
        && seqs
            .iter()
            .enumerate()
            .all(|(i, s)| s.len == 1 && s.start == i)
    {
        if let Some(out) = decode_on_gpu(index, q, k, v, caches, heads, kv_heads)? {
            return Ok(out);
        }
    }
    let mut outs = Vec::with_capacity(seqs.len());
    for (s, cache) in seqs.iter().zip(caches.iter_mut()) {
        let (new_k, new_v) = (k.narrow(0, s.start, s.len)?, v.narrow(0, s.start, s.len)?);
        if cache.layers.len() == index {
            let rows = cache.capacity.max(s.len);
            let empty = || Tensor::zeros((rows, k.dim(1)?), k.dtype(), k.device());
            cache.layers.push(LayerKv::Device {
                k: empty()?,
                v: empty()?,
                len: 0,
            });
        }
        let Some(LayerKv::Device { k: ck, v: cv, len }) = cache.layers.get_mut(index) else {
            candle_core::bail!("KV cache built on another device");
        };
        let ks = append_rows(ck, *len, &new_k)?;
        let vs = append_rows(cv, *len, &new_v)?;
        *len += s.len;
        let (o, _) = ops::attention(be, &q.narrow(0, s.start, s.len)?, &ks, &vs, heads, kv_heads)?;
        outs.push(o);
    }
    Tensor::cat(&outs, 0)
}

/// A decode step (one new row per sequence) on a GPU in one launch of Lathe's kernel
/// ([`super::cuda::decode_attention`]), which writes the new keys and values into each
/// cache as it attends; `None` where the kernel does not apply (a layer not prefilled, a
/// sequence past the kernel's length), and the per-sequence path runs instead.
#[cfg(feature = "cuda")]
fn decode_on_gpu(
    index: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    caches: &mut [&mut KvCache],
    heads: usize,
    kv_heads: usize,
) -> candle_core::Result<Option<Tensor>> {
    use super::cuda;
    let fits = |c: &KvCache| matches!(c.layers.get(index), Some(LayerKv::Device { len, .. }) if *len < cuda::DECODE_MAX_KEYS);
    if !caches.iter().all(|c| fits(c)) {
        return Ok(None);
    }
    let mut buffers = Vec::with_capacity(caches.len());
    for cache in caches.iter_mut() {
        let Some(LayerKv::Device { k: ck, v: cv, len }) = cache.layers.get_mut(index) else {
            candle_core::bail!("KV cache built on another device");
        };
        reserve_rows(ck, *len, 1)?;
        reserve_rows(cv, *len, 1)?;
        // Handles to the cache's own buffers (shared storage): the kernel writes row `len`.
        buffers.push((ck.clone(), cv.clone(), *len));
    }
    let refs: Vec<(&Tensor, &Tensor, usize)> = buffers.iter().map(|(k, v, l)| (k, v, *l)).collect();
    let out = cuda::decode_attention(q, k, v, &refs, heads, kv_heads)?;
    for cache in caches.iter_mut() {
        if let Some(LayerKv::Device { len, .. }) = cache.layers.get_mut(index) {
            *len += 1;
        }
    }
    Ok(Some(out))
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
    // The trainer's scale (`ops::attention_stacked`: computed in f64, then rounded), so
    // that scores are its own bit for bit at every head width.
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
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
/// to `out`; consecutive query heads share a key/value head. Each head is
/// [`probabilities_row`] and [`weighted_row`], as in training.
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
        probabilities_row(qh, &k[at..], kv_dim, scale, &mut p);
        weighted_row(&p, &v[at..], kv_dim, oh);
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::model::test_util::{max_abs_diff, uniform};

    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HD: usize = 8;

    /// `rows` random rows of queries, keys and values (f32, seeded).
    fn qkv(rows: usize, seed: u64) -> (Tensor, Tensor, Tensor) {
        let t = |cols: usize, s: u64| {
            uniform(&[rows, cols], 1.0, seed * 3 + s)
                .to_dtype(DType::F32)
                .unwrap()
        };
        (t(HEADS * HD, 0), t(KV_HEADS * HD, 1), t(KV_HEADS * HD, 2))
    }

    /// Appends `rows` new rows to `cache` through the device backend's path, and checks
    /// the output against attention over every key and value so far, `(ks, vs)`.
    fn step(
        cache: &mut KvCache,
        ks: &mut Vec<Tensor>,
        vs: &mut Vec<Tensor>,
        rows: usize,
        seed: u64,
    ) {
        let (q, k, v) = qkv(rows, seed);
        let span = [SeqSpan {
            start: 0,
            len: rows,
            adapter: None,
        }];
        let got = cached_attention(
            Backend::Device,
            0,
            &q,
            &k,
            &v,
            &span,
            &mut [cache],
            HEADS,
            KV_HEADS,
        )
        .unwrap();
        ks.push(k);
        vs.push(v);
        let (all_k, all_v) = (Tensor::cat(ks, 0).unwrap(), Tensor::cat(vs, 0).unwrap());
        let (want, _) =
            ops::attention(Backend::Device, &q, &all_k, &all_v, HEADS, KV_HEADS).unwrap();
        assert_eq!(cache.len(), all_k.dim(0).unwrap());
        assert!(
            max_abs_diff(&got, &want) < 1e-6,
            "after {} rows",
            cache.len()
        );
    }

    /// The device cache writes in place into buffers made for its capacity, grows past
    /// it without losing rows, and a copy's appends never reach the original.
    #[test]
    fn the_device_cache_appends_in_place_grows_and_copies_apart() {
        let mut cache = KvCache::with_capacity(3);
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        step(&mut cache, &mut ks, &mut vs, 2, 1);
        let LayerKv::Device { k, .. } = &cache.layers[0] else {
            panic!("a device cache")
        };
        assert_eq!(k.dim(0).unwrap(), 3, "made for the capacity asked");
        for seed in 2..6 {
            step(&mut cache, &mut ks, &mut vs, 1, seed);
        }
        let LayerKv::Device { k, .. } = &cache.layers[0] else {
            panic!("a device cache")
        };
        assert!(k.dim(0).unwrap() >= 6, "grown past its capacity");
        let mut copy = cache.try_clone().unwrap();
        let (mut copy_ks, mut copy_vs) = (ks.clone(), vs.clone());
        step(&mut copy, &mut copy_ks, &mut copy_vs, 1, 10);
        step(&mut cache, &mut ks, &mut vs, 1, 20);
        step(&mut copy, &mut copy_ks, &mut copy_vs, 3, 11);
        step(&mut cache, &mut ks, &mut vs, 2, 21);
    }
}
