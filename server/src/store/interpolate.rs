//! A weighted sum of LoRA adapters as one adapter, exactly: MinT's
//! `checkpoints/interpolate`.
//!
//! Source `k` adds `c_k (alpha_k / r_k) B_k A_k` to each adapted matrix. Stacking the
//! sources' ranks, `A = [A_1; ...; A_K]` and `B = [s_1 B_1, ..., s_K B_K]` with
//! `s_k = c_k alpha_k / r_k`, and writing the result with `alpha = r = sum r_k` (scale 1)
//! gives `B A = sum_k c_k (alpha_k / r_k) B_k A_k`: the sum of the deltas, not an
//! average of the factors (which would not be the weighted sum of the models). Only the
//! products `s_k B_k` are rounded (to f32). The sum needs rank `sum r_k`, at most
//! [`MAX_RANK`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::peft::{AdapterConfigFile, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use super::StoreError;
use crate::model::lora::MAX_RANK;

fn invalid(message: impl Into<String>) -> StoreError {
    StoreError::Invalid(message.into())
}

/// One source adapter: its config and tensors.
struct Source {
    config: AdapterConfigFile,
    tensors: HashMap<String, Tensor>,
}

fn read(dir: &Path) -> Result<Source, StoreError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|source| StoreError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let config: AdapterConfigFile =
        serde_json::from_str(&text).map_err(|e| invalid(format!("{ADAPTER_CONFIG}: {e}")))?;
    let tensors = candle_core::safetensors::load(dir.join(ADAPTER_WEIGHTS), &Device::Cpu)
        .map_err(|e| invalid(format!("{ADAPTER_WEIGHTS}: {e}")))?;
    Ok(Source { config, tensors })
}

/// Writes into `out` (an existing, empty directory) the adapter whose delta is
/// `sum_k coefficients[k] * delta(sources[k])`; returns its rank. Every source must
/// adapt the same modules with the same shapes.
pub fn interpolate(
    sources: &[(PathBuf, f64)],
    out: &Path,
    base_model: &str,
) -> Result<usize, StoreError> {
    let read: Vec<(Source, f64)> = sources
        .iter()
        .map(|(dir, c)| Ok((read(dir)?, *c)))
        .collect::<Result<_, StoreError>>()?;
    let (first, _) = read.first().ok_or_else(|| invalid("no sources"))?;
    let mut modules = first.config.target_modules.clone();
    modules.sort();
    let mut names: Vec<&String> = first.tensors.keys().collect();
    names.sort();
    let mut rank = 0usize;
    for (k, (s, c)) in read.iter().enumerate() {
        let mut m = s.config.target_modules.clone();
        m.sort();
        if m != modules {
            return Err(invalid(format!(
                "source {k} adapts {m:?}, source 0 {modules:?}: only adapters of the same \
                 modules can be summed"
            )));
        }
        if !c.is_finite() || !s.config.lora_alpha.is_finite() || s.config.r == 0 {
            return Err(invalid(format!(
                "source {k}: bad coefficient, alpha or rank"
            )));
        }
        rank = rank
            .checked_add(s.config.r)
            .filter(|&r| r <= MAX_RANK)
            .ok_or_else(|| {
                invalid(format!(
                    "the sum of the sources' ranks is above {MAX_RANK}, the largest rank \
                     Lathe serves"
                ))
            })?;
    }
    let mut merged: HashMap<String, Tensor> = HashMap::new();
    for name in names {
        let (is_a, is_b) = (
            name.ends_with(".lora_A.weight"),
            name.ends_with(".lora_B.weight"),
        );
        if !is_a && !is_b {
            return Err(invalid(format!("unexpected tensor {name}")));
        }
        let mut parts = Vec::with_capacity(read.len());
        for (k, (s, c)) in read.iter().enumerate() {
            let t = s
                .tensors
                .get(name)
                .ok_or_else(|| invalid(format!("source {k} has no tensor {name}")))?
                .to_dtype(DType::F32)?;
            let r_dim = if is_a { 0 } else { 1 };
            if t.rank() != 2 || t.dims()[r_dim] != s.config.r {
                return Err(invalid(format!(
                    "source {k}: {name} has shape {:?}, not rank {}",
                    t.dims(),
                    s.config.r
                )));
            }
            let scale = c * s.config.lora_alpha / s.config.r as f64;
            parts.push(if is_a { t } else { t.affine(scale, 0.0)? });
        }
        let cat = Tensor::cat(&parts, if is_a { 0 } else { 1 })
            .map_err(|e| invalid(format!("{name}: the sources' shapes differ ({e})")))?;
        merged.insert(name.clone(), cat);
    }
    for (k, (s, _)) in read.iter().enumerate() {
        if s.tensors.len() != merged.len() {
            return Err(invalid(format!(
                "source {k} holds {} tensors, source 0 {}",
                s.tensors.len(),
                merged.len()
            )));
        }
    }
    candle_core::safetensors::save(&merged, out.join(ADAPTER_WEIGHTS))?;
    let config = AdapterConfigFile {
        r: rank,
        lora_alpha: rank as f64,
        target_modules: first.config.target_modules.clone(),
        base_model_name_or_path: Some(base_model.to_string()),
        inference_mode: true,
        ..first.config.clone()
    };
    let text = serde_json::to_string_pretty(&config).expect("config serialises");
    let path = out.join(ADAPTER_CONFIG);
    std::fs::write(&path, text).map_err(|source| StoreError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(rank)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tiny::tiny_model;
    use crate::model::{Adapter, Arch, LoraSpec};
    use crate::store::peft::{load_adapter, save_adapter};

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lathe-interp-{tag}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// An adapter with random, non-zero A and B.
    fn adapter(cfg: &crate::model::ModelConfig, rank: usize, seed: u64) -> Adapter {
        let spec = LoraSpec {
            rank,
            train_attn: true,
            train_mlp: true,
            train_unembed: true,
        };
        let mut a = Adapter::new(cfg, spec, seed, DType::F32, &Device::Cpu).unwrap();
        for (i, pair) in a.pairs.values_mut().enumerate() {
            pair.b = pair
                .b
                .ones_like()
                .unwrap()
                .affine(0.01 * (i as f64 + 1.0), 0.0)
                .unwrap();
            pair.b =
                (&pair.b + Tensor::randn(0f32, 0.1, pair.b.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        a
    }

    fn delta(a: &Adapter, name: &crate::model::Target) -> Tensor {
        let p = &a.pairs[name];
        p.b.matmul(&p.a).unwrap().affine(a.scale(), 0.0).unwrap()
    }

    #[test]
    fn the_sum_of_deltas_is_exact_across_ranks() {
        let model = tiny_model(Arch::Llama, 1, &Device::Cpu).unwrap();
        let cfg = &model.transformer.config;
        let (x, y) = (adapter(cfg, 4, 1), adapter(cfg, 8, 2));
        let (dx, dy, out) = (temp("x"), temp("y"), temp("out"));
        save_adapter(&dx, &x, "m").unwrap();
        save_adapter(&dy, &y, "m").unwrap();
        let (cx, cy) = (0.7, -0.25);
        let rank = interpolate(&[(dx, cx), (dy, cy)], &out, "m").unwrap();
        assert_eq!(rank, 12);
        let z = load_adapter(&out, cfg, &Device::Cpu).unwrap();
        assert_eq!(z.spec.rank, 12);
        for target in x.pairs.keys() {
            let want =
                ((delta(&x, target) * cx).unwrap() + (delta(&y, target) * cy).unwrap()).unwrap();
            let got = delta(&z, target);
            let err = (got - &want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let size = want
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(err <= 1e-6 * size.max(1.0), "{target:?}: {err} vs {size}");
        }
    }

    #[test]
    fn mismatched_modules_and_excess_rank_are_refused() {
        let model = tiny_model(Arch::Llama, 1, &Device::Cpu).unwrap();
        let cfg = &model.transformer.config;
        let x = adapter(cfg, 4, 1);
        let mut spec = x.spec;
        spec.train_mlp = false;
        let y = Adapter::new(cfg, spec, 3, DType::F32, &Device::Cpu).unwrap();
        let (dx, dy) = (temp("x"), temp("y"));
        save_adapter(&dx, &x, "m").unwrap();
        save_adapter(&dy, &y, "m").unwrap();
        let err = interpolate(&[(dx.clone(), 1.0), (dy, 1.0)], &temp("o"), "m").unwrap_err();
        assert!(err.to_string().contains("same modules"), "{err}");
        let big = adapter(cfg, 200, 4);
        let db = temp("big");
        save_adapter(&db, &big, "m").unwrap();
        let err = interpolate(&[(db.clone(), 1.0), (db, 1.0)], &temp("o"), "m").unwrap_err();
        assert!(err.to_string().contains("256"), "{err}");
    }
}
