use candle_core::{DType, Device, Tensor};
use lathe_server::model::{Adapter, LoadedModel, LoraSpec, PackedBatch};
use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let m = LoadedModel::load("default", &Device::Cpu)?;
    let t = &m.transformer;
    let spec = LoraSpec {
        rank: 8,
        train_attn: true,
        train_mlp: true,
        train_unembed: false,
    };
    let a = Adapter::new(&t.config, spec, 0, DType::F32, &Device::Cpu)?;
    let toks: Vec<Vec<u32>> = (0..4)
        .map(|s| {
            (0..128)
                .map(|i| ((i * 7919 + s * 31) % 40000 + 100) as u32)
                .collect()
        })
        .collect();
    let seqs: Vec<(&[u32], Option<usize>, usize)> =
        toks.iter().map(|t| (t.as_slice(), Some(0), 0)).collect();
    let batch = PackedBatch::new(&seqs, &Device::Cpu)?;
    let tg: Vec<u32> = toks.iter().flatten().copied().collect();
    let targets = Tensor::from_vec(tg, (512, 1), &Device::Cpu)?;
    if std::env::var("FWD_ONLY").is_ok() {
        for _ in 0..6 {
            let t0 = Instant::now();
            let _ = t.forward_logprobs(&batch, &[&a], &targets, false)?;
            println!("fwd {:.3}", t0.elapsed().as_secs_f64());
        }
        return Ok(());
    }
    for _ in 0..3 {
        let t0 = Instant::now();
        let _ = t.forward_logprobs(&batch, &[&a], &targets, false)?;
        let t1 = Instant::now();
        let (lp, tape) = t.forward_logprobs(&batch, &[&a], &targets, true)?;
        let t2 = Instant::now();
        let d = lp.ones_like()?;
        let _g = t.backward(tape.unwrap(), &[&a], &d)?;
        let t3 = Instant::now();
        println!(
            "fwd nograd {:.3}s  fwd tape {:.3}s  bwd {:.3}s",
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64()
        );
    }
    Ok(())
}
