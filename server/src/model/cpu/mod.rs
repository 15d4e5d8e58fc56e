//! The CPU backend's fast paths ([`super::Backend::Cpu`]): code that reads candle's CPU
//! storage directly to do what candle's ops would do in several passes, allocations or
//! thread hand-offs. The decoder's definition stays in [`super::transformer`],
//! [`super::ops`] and [`super::adapted`]; they call in here when the model's backend
//! and the tensors allow it, and run candle's ops otherwise.
//!
//! - [`kernels`]: fused row-wise kernels (RMSNorm, RoPE, SwiGLU, causal softmax, output
//!   log-softmax, residual adds) with their backward passes, f32 and f64, and the
//!   few-rows products of decoding; [`vector_math`] their vectorisable `exp` and sums.
//! - [`gemm`]: bounds-checked strided views over the `gemm` crate, used for training's
//!   products; [`input_grad`] the few-rows `dy W`; [`lora_rows`] the LoRA deltas row by
//!   row and [`attention`] causal attention, each in one order of operations that
//!   training, prefill and decoding share.
//! - [`bf16`]: the frozen products in bf16 on AMX tiles or AVX512-BF16, chosen at run
//!   time.
//! - [`quant`]: block-quantized matrices and their kernels; [`decode_weights`] the
//!   decode copies of the model built from them; [`decode_step`] a decode step over
//!   plain buffers.
//! - [`pool`]: keeping rayon's threads awake across a pass's short regions; [`warm`]
//!   prefetching what a decode step reads next while its products compute.

pub mod attention;
pub mod bf16;
pub mod decode_step;
pub mod decode_weights;
pub mod gemm;
pub mod input_grad;
pub mod kernels;
pub mod lora_rows;
pub mod pool;
pub mod quant;
pub mod row_loops;
mod transpose;
pub mod vector_math;
pub mod warm;
