//! Lathe's CUDA kernels for decoding many adapters at once, on a GPU: the segmented
//! LoRA deltas (SGMV) against the segment-by-segment composite in f64 and through
//! `lora_forward` / `add_deltas` / `lora_backward` against the CPU, and token choice on
//! the device against the host picker. Built with `--features cuda` (`scripts/gpu-check`
//! runs it); without a GPU each test fails when `LATHE_REQUIRE_GPU=1` and otherwise says
//! it was skipped.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::gpu;
use common::kernels::{on, rel, uniform, TOL};
use lathe_server::model::{cuda, Backend};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Each part's `(A, B)` of a segment, if any.
type Factors = Vec<Option<(Tensor, Tensor)>>;

/// Rows `start..start + len`, their scale, and each part's `(A, B)`, if any, in f64 on
/// the CPU.
type RefSegment<'a> = (usize, usize, f64, Vec<Option<(&'a Tensor, &'a Tensor)>>);

/// The LoRA deltas of a packed batch, segment by segment and part by part in f64 on the
/// CPU: part p of each segment's rows gets `base + scale (x A_pᵀ) B_pᵀ`, rows or parts
/// without factors keep `base`; `u`'s columns `p r ..` are `x A_pᵀ`, zero elsewhere.
fn lora_reference(
    x: &Tensor,
    base: &Tensor,
    widths: &[usize],
    segments: &[RefSegment<'_>],
    r: usize,
) -> (Tensor, Tensor) {
    let n = x.dim(0).unwrap();
    let mut y = base.clone();
    let mut u = Tensor::zeros((n, widths.len() * r), DType::F64, &Device::Cpu).unwrap();
    for (start, len, scale, pairs) in segments {
        let (start, len) = (*start, *len);
        let mut col = 0;
        for (p, (pair, &w)) in pairs.iter().zip(widths).enumerate() {
            if let Some((a, b)) = pair {
                let xs = x.narrow(0, start, len).unwrap();
                let us = xs.matmul(&a.t().unwrap()).unwrap();
                let delta = (us.matmul(&b.t().unwrap()).unwrap() * *scale).unwrap();
                let ys = (base
                    .narrow(0, start, len)
                    .unwrap()
                    .narrow(1, col, w)
                    .unwrap()
                    + delta)
                    .unwrap();
                y = y
                    .slice_assign(&[start..start + len, col..col + w], &ys)
                    .unwrap();
                u = u
                    .slice_assign(&[start..start + len, p * r..(p + 1) * r], &us)
                    .unwrap();
            }
            col += w;
        }
    }
    (y, u)
}

#[test]
fn lora_deltas_of_many_adapters_in_two_launches_match_the_composite() {
    let Some(dev) = gpu() else { return };
    // One part wider than a block and no multiple of a warp, three parts (q/k/v-like,
    // one adapter lacking a part), ranks that do and do not fill the warps of a block,
    // segments of one row (a decode step), a segment without an adapter, an adapter used
    // by two segments, and rows no segment covers.
    for (d, widths, r, seed) in [
        (300, vec![1000], 8, 1),
        (576, vec![192, 64, 64], 12, 2),
        (64, vec![33, 7], 1, 3),
    ] {
        let n = 14;
        let w: usize = widths.iter().sum();
        let x = uniform(&[n, d], 1.0, seed);
        let base = uniform(&[n, w], 1.0, seed + 1);
        let factors = |s: u64| -> Vec<(Tensor, Tensor)> {
            (widths.iter().enumerate())
                .map(|(p, &wp)| {
                    let s = s + 10 * p as u64;
                    (uniform(&[r, d], 0.3, s), uniform(&[wp, r], 0.3, s + 1))
                })
                .collect()
        };
        let (f0, f1) = (factors(seed + 2), factors(seed + 50));
        let all = |f: &[(Tensor, Tensor)]| -> Factors {
            f.iter()
                .map(|(a, b)| Some((a.clone(), b.clone())))
                .collect()
        };
        // Adapter 1 has no factors for the last part when there are several.
        let mut some1 = all(&f1);
        if widths.len() > 1 {
            *some1.last_mut().unwrap() = None;
        }
        let none: Factors = vec![None; widths.len()];
        let layout: [(usize, usize, f64, &Factors); 5] = [
            (0, 5, 4.0, &all(&f0)),
            (5, 1, 0.0, &none),
            (6, 1, 0.5, &some1),
            (7, 1, 4.0, &all(&f0)),
            (8, 4, 0.5, &some1),
        ];
        let reference: Vec<RefSegment<'_>> = layout
            .iter()
            .map(|(start, len, scale, pairs)| {
                let pairs = pairs
                    .iter()
                    .map(|p| p.as_ref().map(|(a, b)| (a, b)))
                    .collect();
                (*start, *len, *scale, pairs)
            })
            .collect();
        let (want_y, want_u) = lora_reference(&x, &base, &widths, &reference, r);
        let on_gpu: Vec<Factors> = layout
            .iter()
            .map(|(.., pairs)| {
                (pairs.iter())
                    .map(|p| p.as_ref().map(|(a, b)| (on(a, &dev), on(b, &dev))))
                    .collect()
            })
            .collect();
        let segments: Vec<cuda::LoraSegment<'_>> = layout
            .iter()
            .zip(&on_gpu)
            .map(|((start, len, scale, _), pairs)| cuda::LoraSegment {
                start: *start,
                len: *len,
                scale: *scale as f32,
                pairs: pairs
                    .iter()
                    .map(|p| p.as_ref().map(|(a, b)| (a, b)))
                    .collect(),
            })
            .collect();
        let (y, u) =
            cuda::lora_deltas(&on(&x, &dev), &on(&base, &dev), &widths, &segments).unwrap();
        assert!(
            rel(&y, &want_y) < TOL,
            "lora y {d} {widths:?} r{r}: {}",
            rel(&y, &want_y)
        );
        assert!(
            rel(&u, &want_u) < TOL,
            "lora u {d} {widths:?} r{r}: {}",
            rel(&u, &want_u)
        );
    }
    // Shapes that disagree are errors, not out-of-bounds reads.
    let x = on(&uniform(&[4, 16], 1.0, 7), &dev);
    let base = on(&uniform(&[4, 8], 1.0, 8), &dev);
    let (a, b) = (
        on(&uniform(&[2, 16], 1.0, 9), &dev),
        on(&uniform(&[8, 3], 1.0, 10), &dev),
    );
    let seg = |start, len, pairs| cuda::LoraSegment {
        start,
        len,
        scale: 1.0,
        pairs,
    };
    assert!(cuda::lora_deltas(&x, &base, &[8], &[seg(0, 4, vec![Some((&a, &b))])]).is_err());
    let b = on(&uniform(&[8, 2], 1.0, 11), &dev);
    assert!(cuda::lora_deltas(&x, &base, &[8], &[seg(3, 2, vec![Some((&a, &b))])]).is_err());
    assert!(cuda::lora_deltas(&x, &base, &[4, 4], &[seg(0, 4, vec![Some((&a, &b))])]).is_err());
    assert!(cuda::lora_deltas(&x, &base, &[6], &[seg(0, 4, vec![Some((&a, &b))])]).is_err());
}

/// `lora_forward` and `lora_backward` of a decode-like batch (segments of a few rows,
/// two adapters of one rank, one segment without an adapter, an adapter in two segments,
/// a column view as the frozen output) on a GPU, where they take the SGMV kernels,
/// against the same calls on the CPU; and a batch with a long segment, which keeps the
/// per-segment products.
#[test]
fn lora_forward_and_backward_through_sgmv_match_the_cpu() {
    use lathe_server::model::lora::{lora_backward, lora_forward, Segment};
    use lathe_server::model::{Adapter, AdapterGrads, Arch, Proj, Target};
    let Some(dev) = gpu() else { return };
    let model = common::tiny(Arch::Llama);
    let cfg = &model.transformer.config;
    let cpu_adapters =
        [1, 2].map(|seed| common::random_adapter(&model, common::full_spec(4), seed));
    let gpu_adapters = cpu_adapters.each_ref().map(|a| a.to_device(&dev).unwrap());
    let seg = |start, len, adapter| Segment {
        start,
        len,
        adapter,
    };
    let decode = vec![
        seg(0, 3, Some(0)),
        seg(3, 1, None),
        seg(4, 1, Some(1)),
        seg(5, 1, Some(0)),
        seg(6, 2, Some(1)),
    ];
    let long = vec![seg(0, 20, Some(1)), seg(20, 2, Some(0))];
    for (segments, target, seed) in [
        (decode.clone(), Target::Layer(0, Proj::Q), 40),
        (decode, Target::Layer(1, Proj::Down), 41),
        (long, Target::Layer(0, Proj::V), 42),
    ] {
        let (out, inp) = target.dims(cfg);
        let n: usize = segments.iter().map(|s| s.len).sum();
        let x = on(&uniform(&[n, inp], 1.0, seed), &Device::Cpu);
        let wide = on(&uniform(&[n, out + 5], 1.0, seed + 1), &Device::Cpu);
        let dy = on(&uniform(&[n, out], 1.0, seed + 2), &Device::Cpu);
        let run = |dev: &Device, adapters: &[Adapter]| {
            let refs: Vec<&Adapter> = adapters.iter().collect();
            let (x, wide, dy) = (
                x.to_device(dev).unwrap(),
                wide.to_device(dev).unwrap(),
                dy.to_device(dev).unwrap(),
            );
            let base = wide.narrow(1, 2, out).unwrap();
            let (y, cache) =
                lora_forward(Backend::Device, &x, base, target, &segments, &refs).unwrap();
            let mut grads = vec![AdapterGrads::default(); refs.len()];
            let dx = lora_backward(&x, &dy, target, &segments, &refs, &cache, &mut grads)
                .unwrap()
                .expect("an input gradient");
            (y, dx, grads)
        };
        let (want_y, want_dx, want_grads) = run(&Device::Cpu, &cpu_adapters);
        let (y, dx, grads) = run(&dev, &gpu_adapters);
        let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        assert!(
            rel(&y, &f64s(&want_y)) < TOL,
            "{target:?} y: {}",
            rel(&y, &f64s(&want_y))
        );
        assert!(
            rel(&dx, &f64s(&want_dx)) < TOL,
            "{target:?} dx: {}",
            rel(&dx, &f64s(&want_dx))
        );
        for (got, want) in grads.iter().zip(&want_grads) {
            let (da, db) = &got.pairs[&target];
            let (wa, wb) = &want.pairs[&target];
            assert!(
                rel(da, &f64s(wa)) < TOL,
                "{target:?} dA: {}",
                rel(da, &f64s(wa))
            );
            assert!(
                rel(db, &f64s(wb)) < TOL,
                "{target:?} dB: {}",
                rel(db, &f64s(wb))
            );
        }
    }
}

/// Whether `token` is where the walk of `u` over `candidates` (in walking order, with
/// their weights) lands, up to `tol` of the walked mass: the cumulative weight before it
/// is at most `u · mass` and with it at least that.
fn walk_lands_on(candidates: &[(usize, f64)], u: f64, token: usize, tol: f64) -> bool {
    let mass: f64 = candidates.iter().map(|c| c.1).sum();
    let target = u * mass;
    let mut before = 0.0;
    for &(id, w) in candidates {
        if id == token {
            return before <= target + tol * mass && before + w >= target - tol * mass;
        }
        before += w;
    }
    false
}

#[test]
fn pick_tokens_picks_as_the_host_picker_does() {
    use lathe_server::sample::logits::token_logprob;
    use lathe_server::sample::Picker;
    let Some(dev) = gpu() else { return };
    let picker = |temperature: f64, top_k: Option<usize>, top_p: f64| Picker {
        temperature,
        top_k,
        top_p,
    };
    let pickers = [
        picker(0.0, None, 1.0),
        picker(1.0, None, 1.0),
        picker(0.7, None, 1.0),
        picker(1.0, Some(1), 1.0),
        picker(1.0, Some(5), 1.0),
        picker(0.8, Some(64), 0.9),
        picker(1.3, Some(40), 0.5),
        picker(1.0, Some(1 << 20), 1.0),
    ];
    let mut agree = 0;
    let mut total = 0;
    for (vocab, seed) in [(1000, 1), (49_152, 2), (7, 3)] {
        let n = 16;
        let mut rng = StdRng::seed_from_u64(seed);
        // Quarter steps: many exact ties, which rank by lower id first.
        let mut rows: Vec<Vec<f32>> = (0..n)
            .map(|_| {
                (0..vocab)
                    .map(|_| (rng.random_range(-12.0f32..12.0) * 4.0).round() / 4.0)
                    .collect()
            })
            .collect();
        // A diverged adapter's row: every logit NaN. The host picks id 0 greedily and the
        // last candidate when walking; so must the device, without reading out of bounds.
        rows[n - 1] = vec![f32::NAN; vocab];
        // Signed zeros rank +0 above -0 (the host's total order).
        rows[n - 2][0] = -0.0;
        rows[n - 2][1] = 0.0;
        let flat: Vec<f32> = rows.concat();
        let logits = Tensor::from_vec(flat, (n, vocab), &dev).unwrap();
        for (pi, p) in pickers.iter().enumerate() {
            if !p.on_device(vocab) {
                // A top-k as large as the vocabulary with a nucleus: the host's case.
                assert!(p.top_k.unwrap_or(0) >= vocab && p.top_p < 1.0, "{p:?}");
                continue;
            }
            let mut host_rngs: Vec<StdRng> = (0..n)
                .map(|i| StdRng::seed_from_u64(seed * 1000 + (pi * n + i) as u64))
                .collect();
            let mut dev_rngs = host_rngs.clone();
            let picks: Vec<_> = dev_rngs
                .iter_mut()
                .map(|r| p.device_row(vocab, r).unwrap())
                .collect();
            let got = cuda::pick_tokens(&logits, &picks).unwrap();
            for (i, row) in rows.iter().enumerate() {
                let host = p.pick(row, &mut host_rngs[i]);
                // The device row drew exactly what the host pick drew.
                assert_eq!(host_rngs[i].random::<u64>(), dev_rngs[i].random::<u64>());
                let (tok, lp) = (got[i].0 as usize, got[i].1);
                assert!(tok < vocab);
                if i == n - 1 {
                    assert_eq!(tok, host, "{p:?} on a row of NaN");
                    assert!(lp.is_nan());
                    continue;
                }
                let want_lp = token_logprob(row, tok);
                assert!(
                    (lp as f64 - want_lp).abs() < 1e-4,
                    "logprob {lp} vs {want_lp}"
                );
                // Candidates in walking order, with their weights.
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let inv_t = 1.0 / p.temperature;
                let weight = |i: usize| (((row[i] - max) as f64) * inv_t).exp();
                let k = p.top_k.unwrap_or(vocab).clamp(1, vocab);
                let candidates: Vec<(usize, f64)> = if p.temperature <= 0.0 {
                    Vec::new()
                } else if k < vocab {
                    let mut ranked: Vec<usize> = (0..vocab).collect();
                    ranked.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
                    let ws: Vec<(usize, f64)> =
                        ranked[..k].iter().map(|&i| (i, weight(i))).collect();
                    let mass: f64 = ws.iter().map(|c| c.1).sum();
                    let mut keep = k;
                    let mut cum = 0.0;
                    for (r, c) in ws.iter().enumerate() {
                        cum += c.1 / mass;
                        if cum >= p.top_p {
                            keep = r + 1;
                            break;
                        }
                    }
                    ws[..keep].to_vec()
                } else {
                    (0..vocab).map(|i| (i, weight(i))).collect()
                };
                if p.temperature <= 0.0 {
                    assert_eq!(tok, host, "greedy");
                } else {
                    let u = picks[i].u;
                    assert!(
                        walk_lands_on(&candidates, u, tok, 1e-6),
                        "{p:?} vocab {vocab}: token {tok} is not where u = {u} lands"
                    );
                }
                agree += usize::from(tok == host);
                total += 1;
            }
        }
    }
    // Rounding at the walk's boundaries may part them, rarely.
    assert!(
        agree as f64 >= 0.99 * total as f64,
        "{agree} of {total} picks agree"
    );
    // Pickers the kernel does not implement are left to the host.
    assert!(!picker(1.0, None, 0.9).on_device(100));
    assert!(!picker(1.0, Some(65), 1.0).on_device(100));
    assert!(picker(0.0, None, 0.5).on_device(100));
}

/// The stacked q/k/v projection's deltas of a decode-like batch through
/// `adapted::add_deltas` (every part in one pair of launches on a GPU) against the same
/// call on the CPU, and each part's backward from the caches it returns (strided views
/// of one `u` on the GPU).
#[test]
fn stacked_parts_through_sgmv_match_the_cpu() {
    use lathe_server::model::adapted::add_deltas;
    use lathe_server::model::lora::{lora_backward, Segment};
    use lathe_server::model::{Adapter, AdapterGrads, Arch, Proj, Target};
    let Some(dev) = gpu() else { return };
    let model = common::tiny(Arch::Llama);
    let cfg = &model.transformer.config;
    let cpu_adapters =
        [3, 4].map(|seed| common::random_adapter(&model, common::full_spec(4), seed));
    let gpu_adapters = cpu_adapters.each_ref().map(|a| a.to_device(&dev).unwrap());
    let segments = [
        (0, 2, Some(1)),
        (2, 1, None),
        (3, 1, Some(0)),
        (4, 3, Some(1)),
    ]
    .map(|(start, len, adapter)| Segment {
        start,
        len,
        adapter,
    });
    let parts: Vec<(Target, usize)> = [Proj::Q, Proj::K, Proj::V]
        .map(|p| (Target::Layer(1, p), Target::Layer(1, p).dims(cfg).0))
        .to_vec();
    let (n, d) = (7, cfg.hidden_size);
    let w: usize = parts.iter().map(|p| p.1).sum();
    let x = on(&uniform(&[n, d], 1.0, 60), &Device::Cpu);
    let base = on(&uniform(&[n, w], 1.0, 61), &Device::Cpu);
    let dy = on(&uniform(&[n, w], 1.0, 62), &Device::Cpu);
    let run = |dev: &Device, adapters: &[Adapter]| {
        let refs: Vec<&Adapter> = adapters.iter().collect();
        let (x, base, dy) = (
            x.to_device(dev).unwrap(),
            base.to_device(dev).unwrap(),
            dy.to_device(dev).unwrap(),
        );
        let (y, caches) = add_deltas(Backend::Device, &x, base, &parts, &segments, &refs).unwrap();
        if dev.is_cuda() && cuda::enabled() {
            // The kernels ran: each part's cache is a column view of one shared `u`.
            let u = caches[1][0].as_ref().expect("segment 0 carries an adapter");
            assert_eq!(u.dims(), &[2, 4]);
            assert!(
                !u.is_contiguous(),
                "the stacked parts fell back to the composite"
            );
        }
        let mut grads = vec![AdapterGrads::default(); refs.len()];
        let mut dxs = Vec::new();
        let mut col = 0;
        for (&(target, width), cache) in parts.iter().zip(&caches) {
            let dyp = dy.narrow(1, col, width).unwrap().contiguous().unwrap();
            let dx = lora_backward(&x, &dyp, target, &segments, &refs, cache, &mut grads)
                .unwrap()
                .expect("an input gradient");
            dxs.push(dx);
            col += width;
        }
        (y, dxs, grads)
    };
    let (want_y, want_dxs, want_grads) = run(&Device::Cpu, &cpu_adapters);
    let (y, dxs, grads) = run(&dev, &gpu_adapters);
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    assert!(
        rel(&y, &f64s(&want_y)) < TOL,
        "y: {}",
        rel(&y, &f64s(&want_y))
    );
    for (dx, want) in dxs.iter().zip(&want_dxs) {
        assert!(rel(dx, &f64s(want)) < TOL, "dx: {}", rel(dx, &f64s(want)));
    }
    for (got, want) in grads.iter().zip(&want_grads) {
        for &(target, _) in &parts {
            let ((da, db), (wa, wb)) = (&got.pairs[&target], &want.pairs[&target]);
            assert!(rel(da, &f64s(wa)) < TOL, "{target:?} dA");
            assert!(rel(db, &f64s(wb)) < TOL, "{target:?} dB");
        }
    }
}

/// Device tensors dropped on rayon's pool threads, or on a thread that made the context
/// current (as the worker's thread does when it starts), are freed and leave the context
/// usable. The control shows what that guards against: cudarc frees a buffer without
/// making its context current, so one dropped on a thread that never did fails to free,
/// and the context's next operation, on any thread, reports `CUDA_ERROR_INVALID_CONTEXT`
/// (on a GPU server that failed another request's decode step).
#[test]
fn device_tensors_dropped_on_the_pool_or_a_made_current_thread_leave_the_context_usable() {
    let Some(dev) = gpu() else { return };
    let make = || Tensor::ones(1024, DType::F32, &dev);
    let sum = |t: candle_core::Result<Tensor>| -> candle_core::Result<f32> {
        t?.sum_all()?.to_scalar::<f32>()
    };
    // One tensor, made here, dropped on each thread of the pool.
    let threads = rayon::current_num_threads();
    let pile = std::sync::Mutex::new((0..threads).map(|_| make().unwrap()).collect::<Vec<_>>());
    rayon::broadcast(|_| drop(pile.lock().unwrap().pop()));
    assert!(pile.lock().unwrap().is_empty());
    assert_eq!(sum(make()).expect("after drops on the pool"), 1024.0);
    // A thread of its own that makes the context current first.
    let t = make().unwrap();
    std::thread::spawn(move || {
        lathe_server::model::backend::make_current(t.device()).unwrap();
        drop(t);
    })
    .join()
    .unwrap();
    assert_eq!(
        sum(make()).expect("after a drop on a made-current thread"),
        1024.0
    );
    // The control: a thread of its own that does not.
    let t = make().unwrap();
    std::thread::spawn(move || drop(t)).join().unwrap();
    let err = sum(make()).expect_err("cudarc reports the failed free at the next call");
    assert!(err.to_string().contains("INVALID_CONTEXT"), "{err}");
    // Reported once: the context works again.
    assert_eq!(sum(make()).expect("after the report"), 1024.0);
}

/// Work issued from one thread and then, with no synchronisation between, from another
/// runs in that order, as the worker's optimizer step (its own thread) and the next pass
/// (a pool thread) must: the device has one stream for every thread. On per-thread
/// streams the second thread's read would not wait for the first thread's products.
#[test]
fn work_issued_from_two_threads_runs_in_the_order_issued() {
    let Some(dev) = gpu() else { return };
    let n = 4096;
    let a = Tensor::ones((n, n), DType::F32, &dev).unwrap();
    let dst = Tensor::zeros((1, n), DType::F32, &dev).unwrap();
    a.matmul(&a).unwrap();
    dev.synchronize().unwrap();
    for round in 0..3 {
        std::thread::scope(|s| {
            s.spawn(|| {
                // About a TFLOP of products ending in a write: tens of milliseconds.
                let mut x = a.clone();
                for _ in 0..8 {
                    x = (x.matmul(&a).unwrap() / n as f64).unwrap();
                }
                dst.slice_set(
                    &((x.narrow(0, 0, 1).unwrap() * (round + 1) as f64).unwrap()),
                    0,
                    0,
                )
                .unwrap();
            })
            .join()
            .unwrap();
            s.spawn(|| {
                let row = dst.to_vec2::<f32>().unwrap().remove(0);
                let want = (round + 1) as f32;
                assert!(
                    row.iter().all(|&v| v == want),
                    "round {round}: read {:?}",
                    &row[..4]
                );
            })
            .join()
            .unwrap();
        });
    }
}
