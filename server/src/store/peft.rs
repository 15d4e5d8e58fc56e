//! Adapters and optimizer state on disk, in the PEFT layout:
//! `adapter_model.safetensors` + `adapter_config.json` (loadable by
//! `peft.PeftModel.from_pretrained`), and `optimizer.safetensors` beside them. Tensors are
//! stored in their own dtype, so a save/load round trip is bit-exact.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::StoreError;
use crate::model::{Adapter, LoraSpec, ModelConfig, Target};
use crate::train::adamw::{AdamState, Moments};

/// Adapter weights file name (PEFT).
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// Adapter config file name (PEFT).
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// Optimizer state file name (Lathe).
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// PEFT's `adapter_config.json` (the fields Lathe writes and reads).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdapterConfigFile {
    /// Always `LORA`.
    pub peft_type: String,
    /// Always `CAUSAL_LM`.
    pub task_type: String,
    /// Rank.
    pub r: usize,
    /// Alpha (the delta is scaled by `lora_alpha / r`).
    pub lora_alpha: f64,
    /// Adapted module names (`q_proj`, ..., `lm_head`).
    pub target_modules: Vec<String>,
    /// Dropout (Lathe trains without).
    #[serde(default)]
    pub lora_dropout: f64,
    /// Bias handling; Lathe adapters have none.
    #[serde(default = "none")]
    pub bias: String,
    /// Whether weights are stored transposed (never).
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// The base model this adapter was trained on.
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// Whether this adapter is for inference only.
    #[serde(default)]
    pub inference_mode: bool,
}

fn none() -> String {
    "none".into()
}

/// Writes the adapter (PEFT layout) into `dir`, which must exist.
pub fn save_adapter(dir: &Path, adapter: &Adapter, base_model: &str) -> Result<(), StoreError> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (target, pair) in &adapter.pairs {
        let m = target.peft_module();
        tensors.insert(
            format!("{m}.lora_A.weight"),
            pair.a.to_device(&Device::Cpu)?,
        );
        tensors.insert(
            format!("{m}.lora_B.weight"),
            pair.b.to_device(&Device::Cpu)?,
        );
    }
    candle_core::safetensors::save(&tensors, dir.join(ADAPTER_WEIGHTS))?;
    let cfg = AdapterConfigFile {
        peft_type: "LORA".into(),
        task_type: "CAUSAL_LM".into(),
        r: adapter.spec.rank,
        lora_alpha: adapter.alpha,
        target_modules: adapter.spec.target_module_names(),
        lora_dropout: 0.0,
        bias: none(),
        fan_in_fan_out: false,
        base_model_name_or_path: Some(base_model.to_string()),
        inference_mode: false,
    };
    let text = serde_json::to_string_pretty(&cfg).expect("config serialises");
    let path = dir.join(ADAPTER_CONFIG);
    std::fs::write(&path, text).map_err(io(&path))
}

/// Reads an adapter saved by [`save_adapter`] (or by PEFT with the same targets),
/// checking every tensor against `cfg`.
pub fn load_adapter(dir: &Path, cfg: &ModelConfig, device: &Device) -> Result<Adapter, StoreError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let file: AdapterConfigFile = serde_json::from_str(&text)
        .map_err(|e| StoreError::Invalid(format!("{ADAPTER_CONFIG}: {e}")))?;
    let has = |m: &str| file.target_modules.iter().any(|t| t == m);
    let spec = LoraSpec {
        rank: file.r,
        train_attn: has("q_proj"),
        train_mlp: has("gate_proj"),
        train_unembed: has("lm_head"),
    };
    spec.validate()
        .map_err(|e| StoreError::Invalid(e.to_string()))?;
    let wpath = dir.join(ADAPTER_WEIGHTS);
    let mut tensors = candle_core::safetensors::load(&wpath, device)
        .map_err(|e| StoreError::Invalid(format!("{ADAPTER_WEIGHTS}: {e}")))?;
    let mut pairs = BTreeMap::new();
    for target in spec.targets(cfg) {
        let m = target.peft_module();
        let mut take = |suffix: &str, dims: (usize, usize)| -> Result<Tensor, StoreError> {
            let name = format!("{m}.{suffix}.weight");
            let t = tensors
                .remove(&name)
                .ok_or_else(|| StoreError::Invalid(format!("tensor {name} missing")))?;
            if t.dims() != [dims.0, dims.1] {
                return Err(StoreError::Invalid(format!(
                    "{name}: expected shape {dims:?}, found {:?}",
                    t.dims()
                )));
            }
            Ok(t)
        };
        let (out, inp) = target.dims(cfg);
        let a = take("lora_A", (spec.rank, inp))?;
        let b = take("lora_B", (out, spec.rank))?;
        pairs.insert(target, crate::model::lora::LoraPair { a, b });
    }
    if let Some(extra) = tensors.keys().next() {
        return Err(StoreError::Invalid(format!("unexpected tensor {extra}")));
    }
    Ok(Adapter {
        spec,
        alpha: file.lora_alpha,
        pairs,
    })
}

/// Writes AdamW state next to the adapter: moments as `<module>.lora_{A,B}.exp_avg(_sq)`,
/// the step count in the safetensors metadata.
pub fn save_optimizer(dir: &Path, state: &AdamState) -> Result<(), StoreError> {
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (target, (ma, mb)) in &state.moments {
        let m = target.peft_module();
        for (which, mom) in [("lora_A", ma), ("lora_B", mb)] {
            tensors.push((
                format!("{m}.{which}.exp_avg"),
                mom.m.to_device(&Device::Cpu)?,
            ));
            tensors.push((
                format!("{m}.{which}.exp_avg_sq"),
                mom.v.to_device(&Device::Cpu)?,
            ));
        }
    }
    let mut meta = HashMap::new();
    meta.insert("step".to_string(), state.step.to_string());
    meta.insert("optimizer".to_string(), "adamw".to_string());
    let views: Vec<(String, TensorBytes)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), TensorBytes::new(t)?)))
        .collect::<Result<_, StoreError>>()?;
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| StoreError::Invalid(format!("serialising optimizer state: {e}")))?;
    let path = dir.join(OPTIMIZER_STATE);
    std::fs::write(&path, bytes).map_err(io(&path))
}

/// Reads AdamW state written by [`save_optimizer`].
pub fn load_optimizer(dir: &Path, device: &Device) -> Result<AdamState, StoreError> {
    let path = dir.join(OPTIMIZER_STATE);
    let bytes = std::fs::read(&path).map_err(io(&path))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| StoreError::Invalid(format!("{OPTIMIZER_STATE}: {e}")))?;
    let step = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("step"))
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| StoreError::Invalid(format!("{OPTIMIZER_STATE}: step missing")))?;
    let mut tensors = candle_core::safetensors::load_buffer(&bytes, device)?;
    let mut moments = BTreeMap::new();
    let names: Vec<String> = tensors.keys().cloned().collect();
    for name in names {
        let Some(module) = name.strip_suffix(".lora_A.exp_avg") else {
            continue;
        };
        let target = Target::from_peft_module(module)
            .ok_or_else(|| StoreError::Invalid(format!("unknown module {module}")))?;
        let mut take = |suffix: &str| {
            tensors
                .remove(&format!("{module}.{suffix}"))
                .ok_or_else(|| StoreError::Invalid(format!("{module}.{suffix} missing")))
        };
        let a = Moments {
            m: take("lora_A.exp_avg")?,
            v: take("lora_A.exp_avg_sq")?,
        };
        let b = Moments {
            m: take("lora_B.exp_avg")?,
            v: take("lora_B.exp_avg_sq")?,
        };
        moments.insert(target, (a, b));
    }
    Ok(AdamState { step, moments })
}

/// A CPU tensor's raw bytes, for `safetensors::serialize` with metadata.
struct TensorBytes {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl TensorBytes {
    fn new(t: &Tensor) -> Result<Self, StoreError> {
        let t = t.contiguous()?;
        let (dtype, data) = match t.dtype() {
            DType::F32 => (
                safetensors::Dtype::F32,
                t.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            DType::F64 => (
                safetensors::Dtype::F64,
                t.flatten_all()?
                    .to_vec1::<f64>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            other => {
                return Err(StoreError::Invalid(format!(
                    "cannot store {other:?} optimizer state"
                )))
            }
        };
        Ok(Self {
            dtype,
            shape: t.dims().to_vec(),
            data,
        })
    }
}

impl safetensors::View for TensorBytes {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}
