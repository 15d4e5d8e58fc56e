//! Lathe's fused CUDA kernels (`model::cuda`) against the device backend's candle
//! composites they replace, each on a GPU in f32 against the composite in f64 on the
//! CPU, on shapes that do not divide the block size, rows wider than a block, a KV-cache
//! step (more keys than queries) and repeated targets. Built with `--features cuda`
//! (`scripts/gpu-check` runs it); without a GPU each test fails when
//! `LATHE_REQUIRE_GPU=1` and otherwise says it was skipped.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor, D};
use common::gpu;
use common::kernels::{on, rel, uniform, TOL};
use lathe_server::model::transformer::SeqSpan;
use lathe_server::model::{cuda, kv, ops, Backend, KvCache};
use rand::{rngs::StdRng, Rng, SeedableRng};

#[test]
fn rms_norm_and_its_backward_match_the_composite() {
    let Some(dev) = gpu() else { return };
    // Rows narrower than, as wide as and wider than a block, and a width that is no
    // multiple of a warp.
    for (rows, d, seed) in [
        (7, 576, 1),
        (3, 1000, 2),
        (5, 256, 3),
        (2, 3, 4),
        (1, 1536, 5),
    ] {
        let (x, w, dy) = (
            uniform(&[rows, d], 2.0, seed),
            uniform(&[d], 1.5, seed + 10),
            uniform(&[rows, d], 1.0, seed + 20),
        );
        let (want_y, saved) = ops::rms_norm_composite(&x, &w, 1e-5).unwrap();
        let want_dx = ops::rms_norm_backward(&dy, &w, &saved).unwrap();
        let (y, rstd) = cuda::rms_norm(&on(&x, &dev), &on(&w, &dev), 1e-5).unwrap();
        assert_eq!(rstd.dims(), &[rows]);
        assert!(
            rel(&y, &want_y) < TOL,
            "rms_norm {rows}x{d}: {}",
            rel(&y, &want_y)
        );
        let dx =
            cuda::rms_norm_backward(&on(&dy, &dev), &on(&x, &dev), &on(&w, &dev), &rstd).unwrap();
        assert!(
            rel(&dx, &want_dx) < TOL,
            "rms_norm backward {rows}x{d}: {}",
            rel(&dx, &want_dx)
        );
    }
    // No rows at all.
    let (y, rstd) = cuda::rms_norm(
        &on(&uniform(&[0, 8], 1.0, 9), &dev),
        &on(&uniform(&[8], 1.0, 9), &dev),
        1e-5,
    )
    .unwrap();
    assert_eq!((y.dims(), rstd.dims()), (&[0, 8][..], &[0][..]));
}

#[test]
fn rope_matches_the_composite_both_ways() {
    let Some(dev) = gpu() else { return };
    for (n, heads, hd, seed) in [(9, 3, 64, 1), (5, 4, 6, 2), (1, 9, 128, 3)] {
        let x = uniform(&[n, heads, hd], 2.0, seed);
        let angles = uniform(&[n, hd / 2], 3.0, seed + 10);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let want = ops::rope_composite(&x, &cos, &sin).unwrap();
        let got = cuda::rope(&on(&x, &dev), &on(&cos, &dev), &on(&sin, &dev), 1.0).unwrap();
        assert!(rel(&got, &want) < TOL, "rope {n}x{heads}x{hd}");
        let want = ops::rope_composite(&x, &cos, &sin.neg().unwrap()).unwrap();
        let got = cuda::rope(&on(&x, &dev), &on(&cos, &dev), &on(&sin, &dev), -1.0).unwrap();
        assert!(rel(&got, &want) < TOL, "rope backward {n}x{heads}x{hd}");
    }
}

#[test]
fn swiglu_and_its_backward_match_the_composite() {
    let Some(dev) = gpu() else { return };
    for (n, f, seed) in [(7, 1536, 1), (3, 9, 2), (1, 1000, 3)] {
        let (gu, dy) = (
            uniform(&[n, 2 * f], 4.0, seed),
            uniform(&[n, f], 1.0, seed + 10),
        );
        let want = ops::swiglu(Backend::Device, &gu).unwrap();
        let got = cuda::swiglu(&on(&gu, &dev)).unwrap();
        assert!(rel(&got, &want) < TOL, "swiglu {n}x{f}");
        let want = ops::swiglu_backward_composite(&dy, &gu).unwrap();
        let got = cuda::swiglu_backward(&on(&dy, &dev), &on(&gu, &dev)).unwrap();
        assert!(rel(&got, &want) < TOL, "swiglu backward {n}x{f}");
    }
}

/// The causal softmax by hand: row `g*tq + i` sees keys `0..=tk-tq+i`.
fn masked_softmax(scores: &Tensor, tq: usize, scale: f64) -> Tensor {
    let dims = scores.dims().to_vec();
    let (rows, tk) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let mask: Vec<f64> = (0..rows)
        .flat_map(|r| {
            (0..tk).map(move |j| {
                if j <= tk - tq + r % tq {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (rows, tk), &Device::Cpu).unwrap();
    ops::softmax_last(&(scores * scale).unwrap().broadcast_add(&mask).unwrap()).unwrap()
}

#[test]
fn causal_softmax_and_its_backward_match_the_composite() {
    let Some(dev) = gpu() else { return };
    // (kv heads, group, queries, keys): a whole sequence, a KV-cache step of one query,
    // a prefill after a cached prefix, and rows wider than a block.
    for (kv, group, tq, tk, seed) in [
        (3, 3, 17, 17, 1),
        (2, 4, 1, 40, 2),
        (1, 2, 5, 12, 3),
        (2, 1, 3, 700, 4),
    ] {
        let scale = 0.125;
        let scores = uniform(&[kv, group * tq, tk], 8.0, seed);
        let dp = uniform(&[kv, group * tq, tk], 1.0, seed + 10);
        let want = masked_softmax(&scores, tq, scale);
        let p = cuda::causal_softmax(&on(&scores, &dev), tq, scale).unwrap();
        assert!(
            rel(&p, &want) < TOL,
            "causal softmax {kv}x{group}x{tq}x{tk}"
        );
        let rowdot = (&dp * &want).unwrap().sum_keepdim(D::Minus1).unwrap();
        let want_ds = ((&want * dp.broadcast_sub(&rowdot).unwrap()).unwrap() * scale).unwrap();
        let ds = cuda::softmax_backward(&p, &on(&dp, &dev), scale).unwrap();
        assert!(
            rel(&ds, &want_ds) < TOL,
            "softmax backward {kv}x{group}x{tq}x{tk}"
        );
    }
    assert!(cuda::causal_softmax(&on(&uniform(&[1, 6, 4], 1.0, 5), &dev), 5, 1.0).is_err());
}

#[test]
fn attention_through_the_kernels_matches_the_composite() {
    let Some(dev) = gpu() else { return };
    let (heads, kv_heads, hd) = (6, 2, 16);
    for (tq, tk, seed) in [(11, 11, 1), (3, 9, 2)] {
        let q = uniform(&[tq, heads * hd], 1.0, seed);
        let k = uniform(&[tk, kv_heads * hd], 1.0, seed + 10);
        let v = uniform(&[tk, kv_heads * hd], 1.0, seed + 20);
        let dout = uniform(&[tq, heads * hd], 1.0, seed + 30);
        let (want, saved) = ops::attention(Backend::Device, &q, &k, &v, heads, kv_heads).unwrap();
        let want_grads = ops::attention_backward(Backend::Device, &dout, &saved).unwrap();
        let (got, saved) = ops::attention(
            Backend::Device,
            &on(&q, &dev),
            &on(&k, &dev),
            &on(&v, &dev),
            heads,
            kv_heads,
        )
        .unwrap();
        assert!(rel(&got, &want) < TOL, "attention {tq}x{tk}");
        let grads = ops::attention_backward(Backend::Device, &on(&dout, &dev), &saved).unwrap();
        for (name, g, w) in [
            ("dq", &grads.0, &want_grads.0),
            ("dk", &grads.1, &want_grads.1),
            ("dv", &grads.2, &want_grads.2),
        ] {
            assert!(rel(g, w) < TOL, "attention {name} {tq}x{tk}: {}", rel(g, w));
        }
    }
}

#[test]
fn logprobs_at_and_its_backward_match_the_composite() {
    let Some(dev) = gpu() else { return };
    for (n, vocab, k, seed) in [(5, 49152, 1, 1), (4, 1000, 3, 2), (1, 7, 2, 3)] {
        let logits = uniform(&[n, vocab], 10.0, seed);
        let mut rng = StdRng::seed_from_u64(seed + 10);
        let mut ids: Vec<u32> = (0..n * k)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        if k > 1 {
            ids[1] = ids[0]; // a repeated target adds both terms
        }
        let targets = Tensor::from_vec(ids, (n, k), &Device::Cpu).unwrap();
        let d = uniform(&[n, k], 1.0, seed + 20);
        let (want_lp, want_lse) = ops::logprobs_at(Backend::Device, &logits, &targets).unwrap();
        let want_dl =
            ops::logprobs_at_backward(Backend::Device, &logits, &want_lse, &targets, &d).unwrap();
        let gpu_targets = targets.to_device(&dev).unwrap();
        let (lp, lse) = cuda::logprobs_at(&on(&logits, &dev), &gpu_targets).unwrap();
        assert!(rel(&lp, &want_lp) < TOL, "logprobs {n}x{vocab}x{k}");
        assert!(rel(&lse, &want_lse) < TOL, "lse {n}x{vocab}");
        let dl = cuda::logprobs_at_backward(&on(&logits, &dev), &lse, &gpu_targets, &on(&d, &dev))
            .unwrap();
        assert!(
            rel(&dl, &want_dl) < TOL,
            "logprobs backward {n}x{vocab}x{k}: {}",
            rel(&dl, &want_dl)
        );
    }
}

/// Decode steps of four sequences at once through `kv::cached_attention` (Lathe's
/// decode kernel on the GPU, the composite on the CPU), after prefills of different
/// lengths (one longer than a block has threads), with caches small enough to grow:
/// outputs equal, and the kernel, called directly, writes the new rows where the
/// composite's cache has them.
#[test]
fn decode_attention_matches_the_composite_and_fills_the_caches() {
    let Some(dev) = gpu() else { return };
    let (heads, kv_heads, hd) = (6, 2, 16);
    let (qd, kvd) = (heads * hd, kv_heads * hd);
    let mut cpu: Vec<KvCache> = (0..4).map(|_| KvCache::with_capacity(6)).collect();
    let mut gpu_caches: Vec<KvCache> = (0..4).map(|_| KvCache::with_capacity(6)).collect();
    let mut seed = 100;
    let mut rows = |n: usize, width: usize| {
        seed += 1;
        uniform(&[n, width], 1.0, seed)
    };
    // One step of layer 0 for `seqs`, on the CPU (the composite) and on the GPU.
    let both = |q: &Tensor,
                k: &Tensor,
                v: &Tensor,
                seqs: &[SeqSpan],
                caches: Vec<(&mut KvCache, &mut KvCache)>| {
        let (mut cpu_refs, mut gpu_refs): (Vec<_>, Vec<_>) = caches.into_iter().unzip();
        let want = kv::cached_attention(
            Backend::Device,
            0,
            q,
            k,
            v,
            seqs,
            &mut cpu_refs,
            heads,
            kv_heads,
        )
        .unwrap();
        let (q, k, v) = (on(q, &dev), on(k, &dev), on(v, &dev));
        let got = kv::cached_attention(
            Backend::Device,
            0,
            &q,
            &k,
            &v,
            seqs,
            &mut gpu_refs,
            heads,
            kv_heads,
        )
        .unwrap();
        rel(&got, &want)
    };
    for (i, n) in [5, 1, 17, 300].into_iter().enumerate() {
        let (q, k, v) = (rows(n, qd), rows(n, kvd), rows(n, kvd));
        let seqs = [SeqSpan {
            start: 0,
            len: n,
            adapter: None,
        }];
        let d = both(&q, &k, &v, &seqs, vec![(&mut cpu[i], &mut gpu_caches[i])]);
        assert!(d < TOL, "prefill of {n}: {d}");
    }
    let seqs: Vec<SeqSpan> = (0..4)
        .map(|i| SeqSpan {
            start: i,
            len: 1,
            adapter: None,
        })
        .collect();
    for step in 0..4 {
        let (q, k, v) = (rows(4, qd), rows(4, kvd), rows(4, kvd));
        let d = both(
            &q,
            &k,
            &v,
            &seqs,
            cpu.iter_mut().zip(gpu_caches.iter_mut()).collect(),
        );
        assert!(d < TOL, "decode step {step}: {d}");
    }
    // The kernel itself: 2 sequences with 3 and 0 cached rows in buffers of 4.
    let bufs: Vec<(Tensor, Tensor)> = (0..2)
        .map(|_| (on(&rows(4, kvd), &dev), on(&rows(4, kvd), &dev)))
        .collect();
    let lens = [3, 0];
    let (q, k, v) = (rows(2, qd), rows(2, kvd), rows(2, kvd));
    let refs: Vec<(&Tensor, &Tensor, usize)> =
        bufs.iter().zip(lens).map(|((k, v), l)| (k, v, l)).collect();
    let got = cuda::decode_attention(
        &on(&q, &dev),
        &on(&k, &dev),
        &on(&v, &dev),
        &refs,
        heads,
        kv_heads,
    )
    .unwrap();
    for (i, ((kb, vb), len)) in bufs.iter().zip(lens).enumerate() {
        let host = |t: &Tensor| {
            t.to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
        };
        let (kb, vb) = (host(kb), host(vb));
        let new_k = kb.narrow(0, len, 1).unwrap();
        assert!(
            rel(&new_k, &k.narrow(0, i, 1).unwrap()) < 1e-7,
            "sequence {i}: new key row"
        );
        let (keys, values) = (
            kb.narrow(0, 0, len + 1).unwrap(),
            vb.narrow(0, 0, len + 1).unwrap(),
        );
        let (want, _) = ops::attention(
            Backend::Device,
            &q.narrow(0, i, 1).unwrap(),
            &keys,
            &values,
            heads,
            kv_heads,
        )
        .unwrap();
        assert!(
            rel(&got.narrow(0, i, 1).unwrap(), &want) < TOL,
            "sequence {i}"
        );
    }
    let too_long = (&bufs[0].0, &bufs[0].1, 4);
    assert!(cuda::decode_attention(
        &on(&q.narrow(0, 0, 1).unwrap(), &dev),
        &on(&k.narrow(0, 0, 1).unwrap(), &dev),
        &on(&v.narrow(0, 0, 1).unwrap(), &dev),
        &[too_long],
        heads,
        kv_heads
    )
    .is_err());
}

/// The optimizer's one-launch kernels: `adamw_many` gives every parameter exactly what
/// `adamw` gives it alone (sizes below a block, above a block, and longer than the grid
/// covers in one stride), and `sum_squares` the f64 sum of squares of every tensor.
#[test]
fn adamw_many_equals_adamw_per_tensor_and_sum_squares_the_f64_sum() {
    let Some(dev) = gpu() else { return };
    let step = cuda::AdamwStep {
        grad_scale: 0.7,
        decay: 0.999,
        beta1: 0.9,
        beta2: 0.999,
        bc2_sqrt: 0.05,
        eps: 1e-8,
        step_size: 1e-3,
    };
    let shapes: [&[usize]; 4] = [&[3], &[8, 576], &[1000, 7], &[300_001]];
    let tensors: Vec<[Tensor; 4]> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let seed = 100 + 10 * i as u64;
            let v = uniform(shape, 1.0, seed + 3).abs().unwrap();
            [
                on(&uniform(shape, 1.0, seed), &dev),
                on(&uniform(shape, 1.0, seed + 1), &dev),
                on(&uniform(shape, 0.1, seed + 2), &dev),
                on(&v, &dev),
            ]
        })
        .collect();
    let items: Vec<cuda::AdamwTensors<'_>> =
        tensors.iter().map(|[p, g, m, v]| (p, g, m, v)).collect();
    let many = cuda::adamw_many(&items, &step).unwrap();
    assert_eq!(many.len(), items.len());
    for ((p, g, m, v), got) in items.iter().zip(&many) {
        let want = cuda::adamw(p, g, m, v, &step).unwrap();
        for (what, x, y) in [
            ("param", &got.0, &want.0),
            ("m", &got.1, &want.1),
            ("v", &got.2, &want.2),
        ] {
            assert_eq!(x.dims(), p.dims());
            let (x, y): (Vec<f32>, Vec<f32>) = (
                x.flatten_all().unwrap().to_vec1().unwrap(),
                y.flatten_all().unwrap().to_vec1().unwrap(),
            );
            assert!(x == y, "{what} of {:?} differs", p.dims());
        }
    }
    assert!(cuda::adamw_many(&[], &step).unwrap().is_empty());

    let grads: Vec<&Tensor> = tensors.iter().map(|t| &t[1]).collect();
    let want: f64 = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let g = uniform(shape, 1.0, 100 + 10 * i as u64 + 1)
                .to_dtype(DType::F32)
                .unwrap();
            let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
            g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()
        })
        .sum();
    let got = cuda::sum_squares(&grads).unwrap();
    assert!(
        (got - want).abs() <= 1e-12 * want,
        "sum of squares {got} vs {want}"
    );
    assert_eq!(cuda::sum_squares(&[]).unwrap(), 0.0);
}
