//! The frozen base weights, in the Hugging Face layout (`(out, in)` matrices, rotate-half
//! RoPE order for q and k), whatever file they were read from.

use candle_core::{DType, Device, Tensor};

use super::backend::Backend;
use super::config::ModelConfig;
use super::cpu::kernels;
use super::ops;
use super::ModelError;

/// `x W^T`, through the few-rows kernel when decoding on the CPU backend in f32. A
/// weight stored narrower than `x` (bf16 on the device backend) multiplies `x` rounded
/// to its type, and the product comes back in `x`'s type, as autocast computes it.
pub fn matmul_t(be: Backend, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    if x.dims()[0] <= kernels::FEW_ROWS && be.host_f32(x) && w.dtype() == DType::F32 {
        return kernels::matmul_t_few_rows(x, w);
    }
    if w.dtype() != x.dtype() {
        return ops::matmul(&x.to_dtype(w.dtype())?, &w.t()?)?.to_dtype(x.dtype());
    }
    ops::matmul(x, &w.t()?)
}

/// `dy W`, the input gradient of a frozen projection (no weight gradient: the base is
/// frozen); through the few-rows kernel for a handful of f32 rows on the CPU backend.
pub fn matmul_input_grad(be: Backend, dy: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let m = dy.dim(0)?;
    if m <= kernels::FEW_ROWS && be.host_f32(dy) {
        let dx =
            super::cpu::gemm::with_slices(&[dy], |s| super::cpu::input_grad::dy_w(s[0], m, w))?;
        return Tensor::from_vec(dx, (m, w.dim(1)?), dy.device());
    }
    if w.dtype() != dy.dtype() {
        return ops::matmul(&dy.to_dtype(w.dtype())?, w)?.to_dtype(dy.dtype());
    }
    ops::matmul(dy, w)
}

/// [`matmul_t`] for a plain `(m, in)` buffer on the CPU; returns `(m, out)` row-major.
pub fn matmul_t_host(x: &[f32], m: usize, w: &Tensor) -> candle_core::Result<Vec<f32>> {
    if m <= kernels::FEW_ROWS {
        return kernels::matmul_t_few_rows_host(x, m, w);
    }
    let k = x.len() / m.max(1);
    let xt = Tensor::from_slice(x, (m, k), w.device())?;
    matmul_t(Backend::Cpu, &xt, w)?.flatten_all()?.to_vec1()
}

/// One frozen projection `y = x W^T (+ b)`. It never receives a weight gradient.
#[derive(Debug, Clone)]
pub struct FrozenLinear {
    /// `(out, in)`.
    pub weight: Tensor,
    /// `(out,)`, Qwen2's q/k/v only.
    pub bias: Option<Tensor>,
}

impl FrozenLinear {
    /// Output width.
    pub fn out_dim(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Input width.
    pub fn in_dim(&self) -> usize {
        self.weight.dims()[1]
    }
}

/// The weights of one decoder block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub input_layernorm: Tensor,
    /// Query projection.
    pub q_proj: FrozenLinear,
    /// Key projection.
    pub k_proj: FrozenLinear,
    /// Value projection.
    pub v_proj: FrozenLinear,
    /// Attention output projection.
    pub o_proj: FrozenLinear,
    /// Qwen3's per-head RMSNorm weight for q, `(head_dim,)`.
    pub q_norm: Option<Tensor>,
    /// Qwen3's per-head RMSNorm weight for k, `(head_dim,)`.
    pub k_norm: Option<Tensor>,
    /// RMSNorm before the MLP.
    pub post_attention_layernorm: Tensor,
    /// MLP gate projection.
    pub gate_proj: FrozenLinear,
    /// MLP up projection.
    pub up_proj: FrozenLinear,
    /// MLP down projection.
    pub down_proj: FrozenLinear,
}

/// All frozen weights of a model.
#[derive(Debug, Clone)]
pub struct BaseWeights {
    /// Token embedding, `(vocab, hidden)`.
    pub embed_tokens: Tensor,
    /// Decoder blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm.
    pub norm: Tensor,
    /// Untied output projection; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Tensor>,
}

impl BaseWeights {
    /// The output projection, `(vocab, hidden)`.
    pub fn lm_head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Element type of the model's activations, and of everything trained against it
    /// (LoRA factors, gradients): the norms' type. The projection matrices and the
    /// embedding may be stored narrower ([`BaseWeights::matrix_dtype`]).
    pub fn dtype(&self) -> DType {
        self.norm.dtype()
    }

    /// Element type the projection matrices and the embedding are stored in.
    pub fn matrix_dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// A copy on `device`. Each tensor goes alone: a view of a stacked weight (q, k and
    /// v of one stack) takes its own elements, not the whole stack's storage.
    pub fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        let mv = |t: &Tensor| t.force_contiguous()?.to_device(device);
        self.map(mv, mv)
    }

    /// A copy whose projection matrices, embedding and output head are stored in
    /// `dtype` (bf16 halves a GPU's weight memory); norms and biases keep their type, so
    /// activations stay in [`BaseWeights::dtype`].
    pub fn with_matrices_in(&self, dtype: DType) -> candle_core::Result<Self> {
        self.map(|t| t.to_dtype(dtype), |t| Ok(t.clone()))
    }

    /// A copy with `matrix` applied to the projection matrices, the embedding and the
    /// output head, and `other` to the norms and biases.
    fn map(
        &self,
        matrix: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
        other: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        let lin = |l: &FrozenLinear| -> candle_core::Result<FrozenLinear> {
            Ok(FrozenLinear {
                weight: matrix(&l.weight)?,
                bias: l.bias.as_ref().map(&other).transpose()?,
            })
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerWeights {
                    input_layernorm: other(&l.input_layernorm)?,
                    q_proj: lin(&l.q_proj)?,
                    k_proj: lin(&l.k_proj)?,
                    v_proj: lin(&l.v_proj)?,
                    o_proj: lin(&l.o_proj)?,
                    q_norm: l.q_norm.as_ref().map(&other).transpose()?,
                    k_norm: l.k_norm.as_ref().map(&other).transpose()?,
                    post_attention_layernorm: other(&l.post_attention_layernorm)?,
                    gate_proj: lin(&l.gate_proj)?,
                    up_proj: lin(&l.up_proj)?,
                    down_proj: lin(&l.down_proj)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            embed_tokens: matrix(&self.embed_tokens)?,
            layers,
            norm: other(&self.norm)?,
            lm_head: self.lm_head.as_ref().map(&matrix).transpose()?,
        })
    }

    /// The embedding rows of `tokens`, in the activations' type.
    pub fn embed(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        self.embed_tokens
            .index_select(tokens, 0)?
            .to_dtype(self.dtype())
    }

    /// Device the weights live on.
    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// A copy in another element type (f64 for finite-difference checks).
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<Self> {
        let cast = |t: &Tensor| t.to_dtype(dtype);
        self.map(cast, cast)
    }

    /// Checks every tensor's shape against the config, so a bad file fails at load time
    /// with a message instead of deep inside a matmul.
    pub fn check_shapes(&self, cfg: &ModelConfig) -> Result<(), ModelError> {
        let (v, d, f) = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size);
        let expect = |name: &str, t: &Tensor, dims: &[usize]| {
            if t.dims() == dims {
                Ok(())
            } else {
                Err(ModelError::Shape(format!(
                    "{name}: expected {dims:?}, found {:?}",
                    t.dims()
                )))
            }
        };
        expect("embed_tokens", &self.embed_tokens, &[v, d])?;
        expect("norm", &self.norm, &[d])?;
        if let Some(h) = &self.lm_head {
            expect("lm_head", h, &[v, d])?;
        }
        if self.layers.len() != cfg.num_hidden_layers {
            return Err(ModelError::Shape(format!(
                "expected {} layers, found {}",
                cfg.num_hidden_layers,
                self.layers.len()
            )));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let n = |s: &str| format!("layers.{i}.{s}");
            expect(&n("input_layernorm"), &l.input_layernorm, &[d])?;
            expect(&n("q_proj"), &l.q_proj.weight, &[cfg.q_dim(), d])?;
            expect(&n("k_proj"), &l.k_proj.weight, &[cfg.kv_dim(), d])?;
            expect(&n("v_proj"), &l.v_proj.weight, &[cfg.kv_dim(), d])?;
            expect(&n("o_proj"), &l.o_proj.weight, &[d, cfg.q_dim()])?;
            expect(
                &n("post_attention_layernorm"),
                &l.post_attention_layernorm,
                &[d],
            )?;
            expect(&n("gate_proj"), &l.gate_proj.weight, &[f, d])?;
            expect(&n("up_proj"), &l.up_proj.weight, &[f, d])?;
            expect(&n("down_proj"), &l.down_proj.weight, &[d, f])?;
            if cfg.qk_norm() {
                match (&l.q_norm, &l.k_norm) {
                    (Some(q), Some(k)) => {
                        expect(&n("q_norm"), q, &[cfg.head_dim])?;
                        expect(&n("k_norm"), k, &[cfg.head_dim])?;
                    }
                    _ => return Err(ModelError::Shape(n("q_norm/k_norm missing"))),
                }
            }
        }
        Ok(())
    }

    /// Number of parameters (the tied head counted once).
    pub fn num_params(&self) -> usize {
        let lin = |l: &FrozenLinear| l.weight.elem_count();
        let mut n = self.embed_tokens.elem_count() + self.norm.elem_count();
        n += self.lm_head.as_ref().map_or(0, |t| t.elem_count());
        for l in &self.layers {
            n += lin(&l.q_proj) + lin(&l.k_proj) + lin(&l.v_proj) + lin(&l.o_proj);
            n += lin(&l.gate_proj) + lin(&l.up_proj) + lin(&l.down_proj);
            n += l.input_layernorm.elem_count() + l.post_attention_layernorm.elem_count();
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_util::{max_entry, uniform};

    /// `max |got - want| / (sum |a b|)` over the entries of a product, `want` in f64.
    fn worst(got: &Tensor, want: &Tensor, scale: &Tensor) -> f64 {
        let got = got.to_dtype(DType::F64).unwrap();
        max_entry(&((got - want).unwrap().abs().unwrap() / scale).unwrap())
    }

    /// A product against a weight stored in bf16 (the device backend's bf16): the input
    /// is rounded to bf16, exactly as the f64 reference rounds it; the sums are f32, at
    /// most `k 2^-24 sum|ab|` off; the output is rounded to bf16, at most `u |y| <= u
    /// sum|ab|` off with `u = 2^-8`. Both products of a frozen projection, `x Wᵀ` and
    /// `dy W`, stay within `(u + k 2^-24) sum|ab|`, and return the input's type.
    #[test]
    fn a_bf16_weight_multiplies_within_its_rounding_bound() {
        let u = 2f64.powi(-8);
        for (rows, k, out) in [(3, 16, 8), (8, 64, 32), (20, 576, 96), (5, 1536, 64)] {
            let x = uniform(&[rows, k], 2.0, k as u64)
                .to_dtype(DType::F32)
                .unwrap();
            let dy = uniform(&[rows, out], 2.0, 7).to_dtype(DType::F32).unwrap();
            let w = uniform(&[out, k], 1.0, 3).to_dtype(DType::BF16).unwrap();
            let exact = |t: &Tensor| {
                t.to_dtype(DType::BF16)
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
            };
            let (xr, dyr, wr) = (exact(&x), exact(&dy), exact(&w));
            let bound = u + k.max(out) as f64 * 2f64.powi(-24);

            let y = matmul_t(Backend::Device, &x, &w).unwrap();
            assert_eq!(y.dtype(), DType::F32);
            let want = xr.matmul(&wr.t().unwrap()).unwrap();
            let scale = xr
                .abs()
                .unwrap()
                .matmul(&wr.abs().unwrap().t().unwrap())
                .unwrap();
            let e = worst(&y, &want, &scale);
            assert!(e <= bound, "x Wᵀ, k = {k}: {e:e} > {bound:e}");

            let dx = matmul_input_grad(Backend::Device, &dy, &w).unwrap();
            assert_eq!(dx.dtype(), DType::F32);
            let want = dyr.matmul(&wr).unwrap();
            let scale = dyr.abs().unwrap().matmul(&wr.abs().unwrap()).unwrap();
            let e = worst(&dx, &want, &scale);
            assert!(e <= bound, "dy W, k = {k}: {e:e} > {bound:e}");
        }
    }
}
