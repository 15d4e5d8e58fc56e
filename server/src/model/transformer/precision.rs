//! The element type of the frozen products and the switch between f32 and bf16: on the
//! CPU backend the base weights packed for bf16 tiles (see [`crate::model::cpu::bf16`]),
//! on the device backend the matrices themselves stored in bf16.

use candle_core::DType;

use super::Transformer;
use crate::model::backend::Backend;
use crate::model::cpu::bf16::panels::{self, QuantPanels};
use crate::model::cpu::bf16::{self, Bf16Ref, Precision};
use crate::model::cpu::gemm::{Mat, MatMut};
use crate::model::cpu::quant::{BlockArith, QuantMatrix};
use crate::model::cpu::warm::Warm;
use crate::model::weights::matmul_t_host;
use crate::model::ModelError;

/// The frozen weights packed for bf16 products, and the kernel that reads them.
#[derive(Debug)]
pub(super) struct Bf16Weights {
    pub(super) kernel: bf16::Kernel,
    /// Per block: q/k/v, o, gate/up, down.
    pub(super) layers: Vec<[bf16::PackedWeight; 4]>,
    /// The output head.
    pub(super) head: bf16::PackedWeight,
    /// The same weights as 4- or 8-bit blocks in the `VDPBF16PS` kernel's panel order,
    /// for the few-row products of decoding with that kernel (built with the packing:
    /// built on first use, inside a parallel region, a re-entrant call could block).
    pub(super) panels: Option<PanelWeights>,
}

/// The frozen matrices as [`QuantPanels`] where their blocks are exact (`None` where not:
/// those take the packed weights).
#[derive(Debug)]
pub(super) struct PanelWeights {
    /// Per block: q/k/v, o, gate/up, down.
    layers: Vec<[Option<QuantPanels>; 4]>,
    head: Option<QuantPanels>,
}

impl PanelWeights {
    fn get(&self, w: Frozen) -> Option<&QuantPanels> {
        match w {
            Frozen::Qkv(l) => self.layers[l][0].as_ref(),
            Frozen::O(l) => self.layers[l][1].as_ref(),
            Frozen::GateUp(l) => self.layers[l][2].as_ref(),
            Frozen::Down(l) => self.layers[l][3].as_ref(),
            Frozen::Head => self.head.as_ref(),
        }
    }
}

/// A frozen matrix of the model, for [`Transformer::frozen_product_host`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frozen {
    /// Block `l`'s stacked q/k/v.
    Qkv(usize),
    /// Block `l`'s attention output.
    O(usize),
    /// Block `l`'s stacked gate/up.
    GateUp(usize),
    /// Block `l`'s MLP down.
    Down(usize),
    /// The output head.
    Head,
}

impl Transformer {
    /// Chooses the element type of the frozen products of training and prefill, and
    /// returns the one in effect. Activations, LoRA factors, gradients and optimizer
    /// state stay f32 either way.
    ///
    /// On the CPU backend, bf16 needs f32 weights and a CPU with a bf16 kernel (AMX or
    /// AVX512-BF16); without one the model stays in f32 (and says so in the log).
    /// Packing the weights takes a moment and holds as many bytes again as the f32
    /// weights (two bf16 layouts of each). Decoding computes the same bf16 products
    /// with the same kernel ([`Transformer::block_arith`],
    /// [`Transformer::frozen_product_host`]).
    ///
    /// On the device backend, bf16 stores the projection matrices, the embedding and
    /// the output head in bf16 in place of f32 (half the memory); every product then
    /// rounds its input to bf16 and accumulates as the device's bf16 matmul does, and
    /// sampling uses the same weights as training. This cannot be undone: going back to
    /// f32 means loading the model again.
    pub fn set_precision(&mut self, precision: Precision) -> Result<Precision, ModelError> {
        self.set_precision_with(precision, None)
    }

    /// [`Transformer::set_precision`] with the CPU backend's bf16 products on `kernel`
    /// rather than the fastest this CPU has ([`bf16::kernel`]): for tests and
    /// benchmarks of a kernel that is not the first choice. An error if this CPU lacks
    /// `kernel`.
    pub fn set_precision_with(
        &mut self,
        precision: Precision,
        kernel: Option<bf16::Kernel>,
    ) -> Result<Precision, ModelError> {
        if let Some(k) = kernel.filter(|k| !bf16::available().contains(k)) {
            return Err(ModelError::Input(format!(
                "this CPU has no {} kernel for bf16 products",
                k.name()
            )));
        }
        if self.backend == Backend::Device {
            return self.set_device_precision(precision);
        }
        if precision == Precision::F32 {
            self.bf16 = None;
            return Ok(Precision::F32);
        }
        if self.weights.dtype() != DType::F32 {
            return Err(ModelError::Input(
                "bf16 precision needs the model's f32 weights".into(),
            ));
        }
        let Some(kernel) = kernel.or_else(bf16::kernel) else {
            tracing::warn!(
                "this CPU has neither AMX nor AVX512-BF16: the base model's products stay in f32"
            );
            self.bf16 = None;
            return Ok(Precision::F32);
        };
        let start = std::time::Instant::now();
        let pack = bf16::PackedWeight::from_tensor;
        let layers = self
            .fused
            .iter()
            .zip(&self.weights.layers)
            .map(|(f, w)| {
                Ok([
                    pack(&f.qkv)?,
                    pack(&w.o_proj.weight)?,
                    pack(&f.gate_up)?,
                    pack(&w.down_proj.weight)?,
                ])
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let packed = Bf16Weights {
            kernel,
            layers,
            head: pack(self.weights.lm_head())?,
            panels: (kernel == bf16::Kernel::Avx512Bf16 && panels::usable())
                .then(|| self.build_panels()),
        };
        let bytes: usize = packed.head.bytes()
            + packed
                .layers
                .iter()
                .flatten()
                .map(|p| p.bytes())
                .sum::<usize>();
        tracing::info!(
            kernel = kernel.name(),
            mib = bytes >> 20,
            seconds = format!("{:.2}", start.elapsed().as_secs_f64()),
            "base weights packed for bf16 products"
        );
        self.bf16 = Some(std::sync::Arc::new(packed));
        Ok(Precision::Bf16)
    }

    /// [`Transformer::set_precision`] on the device backend.
    fn set_device_precision(&mut self, precision: Precision) -> Result<Precision, ModelError> {
        let narrowed = self.weights.matrix_dtype() == DType::BF16;
        match precision {
            Precision::F32 if narrowed => Err(ModelError::Input(
                "the base weights were narrowed to bf16; load the model again for f32".into(),
            )),
            Precision::F32 => Ok(Precision::F32),
            Precision::Bf16 if narrowed => Ok(Precision::Bf16),
            Precision::Bf16 => {
                if self.weights.dtype() != DType::F32 {
                    return Err(ModelError::Input(
                        "bf16 precision needs the model's f32 weights".into(),
                    ));
                }
                let weights = self.weights.with_matrices_in(DType::BF16)?;
                *self = Transformer::new(self.config.clone(), weights)?;
                Ok(Precision::Bf16)
            }
        }
    }

    /// The element type of the frozen products of training and prefill.
    pub fn precision(&self) -> Precision {
        if self.bf16.is_some() || self.weights.matrix_dtype() == DType::BF16 {
            Precision::Bf16
        } else {
            Precision::F32
        }
    }

    /// The arithmetic of the decode weights' products: in bf16 precision on AMX tiles the
    /// trainer's bf16 products with the trainer's kernel, so sampling computes what
    /// training computes; f32 otherwise (and in bf16 on another kernel decoding does not
    /// use the decode weights, see `DecodeMode::on`).
    pub fn block_arith(&self) -> BlockArith {
        match &self.bf16 {
            Some(b) if bf16::blocks::usable(b.kernel) => BlockArith::Bf16(b.kernel),
            _ => BlockArith::F32,
        }
    }

    /// `x Wᵀ + bias` for `m` rows `x` (`(m, in)`, row-major) and the frozen matrix `w`,
    /// computed as the trainer computes it: in bf16 precision the bf16 product from the
    /// packed weights (or their panel copy), the bias taken as the trainer's kernel
    /// takes it; otherwise f32, the bias added after. For decoding where the block
    /// weights do not take a product (a width that is not whole blocks, more rows than
    /// their kernels take, exact mode). CPU backend only.
    pub fn frozen_product_host(
        &self,
        w: Frozen,
        x: &[f32],
        m: usize,
        bias: Option<&[f32]>,
    ) -> Result<Vec<f32>, ModelError> {
        self.frozen_product_host_warming(w, x, m, bias, Warm::NONE)
    }

    /// [`Transformer::frozen_product_host`], pulling `warm` toward the caches where the
    /// product is bound by its arithmetic (the bf16 panel copy's products), for what the
    /// caller reads right after it.
    pub fn frozen_product_host_warming(
        &self,
        w: Frozen,
        x: &[f32],
        m: usize,
        bias: Option<&[f32]>,
        warm: Warm<'_>,
    ) -> Result<Vec<f32>, ModelError> {
        if let Some(b) = &self.bf16 {
            let packed = match w {
                Frozen::Qkv(l) => &b.layers[l][0],
                Frozen::O(l) => &b.layers[l][1],
                Frozen::GateUp(l) => &b.layers[l][2],
                Frozen::Down(l) => &b.layers[l][3],
                Frozen::Head => &b.head,
            };
            let (k, n) = (packed.forward.k(), packed.forward.n());
            if x.len() != m * k {
                return Err(ModelError::Input(format!(
                    "a frozen product of {m} rows of {k} got {} values",
                    x.len()
                )));
            }
            if let Some(b) = bias.filter(|b| b.len() != n) {
                return Err(ModelError::Input(format!(
                    "{} biases for a product into {n} columns",
                    b.len()
                )));
            }
            // A decode step's few rows read every weight once: with the `VDPBF16PS`
            // kernel, the same products from a third of the bytes.
            let copy = b.panels.as_ref().and_then(|p| p.get(w));
            if let Some(p) = copy.filter(|_| (1..=panels::MAX_ROWS).contains(&m)) {
                return Ok(p.product_warming(x, m, bias, warm));
            }
            let mut out = match bias {
                Some(b) => (0..m).flat_map(|_| b.iter().copied()).collect(),
                None => vec![0f32; m * n],
            };
            bf16::gemm(
                b.kernel,
                &mut MatMut::new(&mut out, m, n, n),
                Mat::new(x, m, k),
                &packed.forward,
                bias.is_some(),
            );
            return Ok(out);
        }
        let weight = match w {
            Frozen::Qkv(l) => self.stacked(l).qkv,
            Frozen::O(l) => &self.weights.layers[l].o_proj.weight,
            Frozen::GateUp(l) => self.stacked(l).gate_up,
            Frozen::Down(l) => &self.weights.layers[l].down_proj.weight,
            Frozen::Head => self.weights.lm_head(),
        };
        let mut y = matmul_t_host(x, m, weight)?;
        if let Some(b) = bias {
            if b.len() * m != y.len() {
                return Err(ModelError::Input(format!(
                    "{} biases for a product into {} columns",
                    b.len(),
                    y.len() / m.max(1)
                )));
            }
            crate::model::cpu::decode_step::add_bias(&mut y, b);
        }
        Ok(y)
    }

    /// Every frozen matrix as [`QuantPanels`] where its weights are exact Q4_1 or Q8
    /// blocks (the default model's are).
    fn build_panels(&self) -> PanelWeights {
        let start = std::time::Instant::now();
        let panels =
            |w: &candle_core::Tensor| QuantMatrix::new(w).ok().and_then(|q| QuantPanels::new(&q));
        let built = PanelWeights {
            layers: self
                .fused
                .iter()
                .zip(&self.weights.layers)
                .map(|(f, l)| {
                    [
                        panels(&f.qkv),
                        panels(&l.o_proj.weight),
                        panels(&f.gate_up),
                        panels(&l.down_proj.weight),
                    ]
                })
                .collect(),
            head: panels(self.weights.lm_head()),
        };
        let all = built.layers.iter().flatten().chain([&built.head]);
        let (kept, bytes) = all.fold((0, 0), |(n, b), p| match p {
            Some(p) => (n + 1, b + p.bytes()),
            None => (n, b),
        });
        tracing::info!(
            matrices = kept,
            of = built.layers.len() * 4 + 1,
            mib = bytes >> 20,
            seconds = format!("{:.2}", start.elapsed().as_secs_f64()),
            "bf16 panel weights built for decoding"
        );
        built
    }

    /// The packed output head, in bf16 precision.
    pub(super) fn bf16_head(&self) -> Option<Bf16Ref<'_>> {
        self.bf16.as_ref().map(|b| Bf16Ref {
            kernel: b.kernel,
            weight: &b.head,
        })
    }
}
