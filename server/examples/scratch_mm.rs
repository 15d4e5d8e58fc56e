use candle_core::{Device, Tensor};
use lathe_server::model::kernels::{matmul_t_few_rows, Q8Matrix};
use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let w = Tensor::randn(0f32, 1.0, (1536, 576), &Device::Cpu)?;
    let q = Q8Matrix::new(&w)?;
    for m in [1usize, 2, 4, 8] {
        let x = Tensor::randn(0f32, 1.0, (m, 576), &Device::Cpu)?;
        let t = Instant::now();
        for _ in 0..200 {
            let _ = matmul_t_few_rows(&x, &w)?;
        }
        let f = t.elapsed().as_secs_f64() / 200.0;
        let t = Instant::now();
        for _ in 0..200 {
            let _ = q.matmul_t(&x)?;
        }
        let g = t.elapsed().as_secs_f64() / 200.0;
        let t = Instant::now();
        for _ in 0..200 {
            let _ = x.matmul(&w.t()?)?;
        }
        let h = t.elapsed().as_secs_f64() / 200.0;
        println!(
            "m={m}: few-rows f32 {:.3} ms, q8 {:.3} ms, gemm {:.3} ms",
            f * 1e3,
            g * 1e3,
            h * 1e3
        );
    }
    Ok(())
}
