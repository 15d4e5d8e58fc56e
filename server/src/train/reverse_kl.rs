//! Reverse-KL distillation (MinT's `forward_backward_reverse_kl`): the student is
//! trained towards a frozen reference over the whole vocabulary, at every completion
//! position.
//!
//! A datum is a student prompt, a reference prompt and one completion both continue
//! with, weighted per token. At completion position `i`, with student logits `s_i` and
//! reference logits `r_i` at temperature `T`, `q = softmax(s_i / T)` and
//! `p = softmax(r_i / T)`:
//!
//! `loss = T^2 * sum_i w_i * KL(q || p)`,  `KL(q || p) = sum_v q_v (log q_v - log p_v)`
//!
//! (the `T^2` keeps gradient sizes comparable across temperatures, as in knowledge
//! distillation). Gradients flow through the student only:
//! `d loss / d s_{i,v} = T * w_i * q_v * (log q_v - log p_v - KL(q || p))`.

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::TrainError;
use crate::model::cpu::pool::on_pool;
use crate::model::{Adapter, AdapterGrads, PackedBatch, Transformer};

/// Most completion tokens one reverse-KL request may hold: each is a full-vocabulary
/// row of both models' logits in f64 while its gradient is computed.
pub const MAX_COMPLETION_TOKENS: usize = 1024;

/// One datum.
#[derive(Debug, Clone, PartialEq)]
pub struct KlDatum {
    /// The student's prompt (non-empty).
    pub student: Vec<u32>,
    /// The reference's prompt (non-empty).
    pub reference: Vec<u32>,
    /// The completion both prompts continue with (non-empty).
    pub completion: Vec<u32>,
    /// One weight per completion token.
    pub weights: Vec<f32>,
}

impl KlDatum {
    /// Tokens the two forward passes read.
    pub fn tokens(&self) -> usize {
        self.student.len() + self.reference.len() + 2 * self.completion.len()
    }

    /// A prompt followed by the completion without its last token: the rows that
    /// predict the completion are the last `completion.len()`.
    fn sequence(&self, prompt: &[u32]) -> Vec<u32> {
        let mut s = prompt.to_vec();
        s.extend_from_slice(&self.completion[..self.completion.len() - 1]);
        s
    }
}

/// One datum's result.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KlResult {
    /// `T^2 * sum_i w_i KL_i`.
    pub loss: f64,
    /// `sum_i w_i KL_i` (no temperature factor).
    pub weighted_kl: f64,
    /// `sum_i w_i`.
    pub weight: f64,
    /// Completion tokens with a non-zero weight.
    pub tokens: usize,
}

/// Checks a datum against the model before anything runs.
fn check(i: usize, d: &KlDatum, vocab: usize, max_len: usize) -> Result<(), TrainError> {
    let bad = |m: String| Err(TrainError::Input(format!("datum {i}: {m}")));
    if d.student.is_empty() || d.reference.is_empty() || d.completion.is_empty() {
        return bad("student_input, reference_input and target_tokens must be non-empty".into());
    }
    if d.weights.len() != d.completion.len() {
        return bad(format!(
            "weights has {} values for {} target_tokens",
            d.weights.len(),
            d.completion.len()
        ));
    }
    if let Some(w) = d.weights.iter().find(|w| !w.is_finite()) {
        return bad(format!("weights must be finite, got {w}"));
    }
    let all = d.student.iter().chain(&d.reference).chain(&d.completion);
    if let Some(t) = all.into_iter().find(|&&t| t as usize >= vocab) {
        return bad(format!(
            "token {t} is out of range for a vocabulary of {vocab}"
        ));
    }
    let longest = d.student.len().max(d.reference.len()) + d.completion.len() - 1;
    if longest > max_len {
        return bad(format!(
            "{longest} tokens exceed the context limit of {max_len}"
        ));
    }
    Ok(())
}

/// Per completion row: the KL and, when asked, `d loss / d s` for that row.
fn row_terms(s: &[f64], r: &[f64], t: f64, w: f64, grad: bool) -> (f64, Option<Vec<f64>>) {
    let log_softmax = |x: &[f64]| -> Vec<f64> {
        let m = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v / t));
        let z = x.iter().map(|&v| (v / t - m).exp()).sum::<f64>().ln() + m;
        x.iter().map(|&v| v / t - z).collect()
    };
    let (lq, lp) = (log_softmax(s), log_softmax(r));
    let kl: f64 = lq.iter().zip(&lp).map(|(q, p)| q.exp() * (q - p)).sum();
    let g = grad.then(|| {
        lq.iter()
            .zip(&lp)
            .map(|(q, p)| t * w * q.exp() * (q - p - kl))
            .collect()
    });
    (kl, g)
}

/// Runs every datum (each as its own pass), returning each one's result and, with
/// `with_grad`, the student's gradient summed over the datums. `reference` `None` is the
/// base model.
pub fn forward_backward(
    model: &Transformer,
    student: &Adapter,
    reference: Option<&Adapter>,
    data: &[KlDatum],
    temperature: f64,
    with_grad: bool,
) -> Result<(Vec<KlResult>, AdapterGrads), TrainError> {
    if data.is_empty() {
        return Err(TrainError::Input("no data".into()));
    }
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(TrainError::Input(format!(
            "temperature must be finite and > 0, got {temperature}"
        )));
    }
    let (vocab, max_len) = (model.config.vocab_size, model.max_seq_len());
    for (i, d) in data.iter().enumerate() {
        check(i, d, vocab, max_len)?;
    }
    on_pool(|| {
        let mut grads = AdapterGrads::default();
        let mut results = Vec::with_capacity(data.len());
        for d in data {
            let (result, g) = one(model, student, reference, d, temperature, with_grad)?;
            if let Some(g) = g {
                grads.merge(g)?;
            }
            results.push(result);
        }
        Ok((results, grads))
    })
}

/// The completion rows' logits of one forward pass, as host rows (f64, so that an f64
/// model keeps its precision).
fn completion_logits(
    model: &Transformer,
    adapter: Option<&Adapter>,
    seq: &[u32],
    c: usize,
) -> Result<(Vec<Vec<f64>>, crate::model::transformer::Tape), TrainError> {
    let dev = model.device();
    let adapters: Vec<&Adapter> = adapter.into_iter().collect();
    let batch = PackedBatch::new(&[(seq, adapter.map(|_| 0), 0)], dev)?;
    let targets = Tensor::zeros((batch.rows(), 1), DType::U32, dev)?;
    let (_, tape) = model.forward_logprobs(&batch, &adapters, &targets, true)?;
    let tape = tape.expect("kept");
    let rows = tape
        .logits_rows(seq.len() - c, c)?
        .to_dtype(DType::F64)?
        .to_vec2()?;
    Ok((rows, tape))
}

/// The completion rows' logits of the frozen reference, as host rows (no tape kept).
fn reference_logits(
    model: &Transformer,
    adapter: Option<&Adapter>,
    seq: &[u32],
    c: usize,
) -> Result<Vec<Vec<f64>>, TrainError> {
    let adapters: Vec<&Adapter> = adapter.into_iter().collect();
    let batch = PackedBatch::new(&[(seq, adapter.map(|_| 0), 0)], model.device())?;
    Ok(model
        .forward_logits_rows(&batch, &adapters, seq.len() - c, c)?
        .to_dtype(DType::F64)?
        .to_vec2()?)
}

fn one(
    model: &Transformer,
    student: &Adapter,
    reference: Option<&Adapter>,
    d: &KlDatum,
    t: f64,
    with_grad: bool,
) -> Result<(KlResult, Option<AdapterGrads>), TrainError> {
    let c = d.completion.len();
    let ref_rows = reference_logits(model, reference, &d.sequence(&d.reference), c)?;
    let seq = d.sequence(&d.student);
    let (rows, tape) = completion_logits(model, Some(student), &seq, c)?;
    // Rows are consumed as their terms are computed, so the logits copies and the
    // gradient rows are not all alive at once.
    let terms: Vec<(f64, Option<Vec<f64>>)> = rows
        .into_par_iter()
        .zip(ref_rows.into_par_iter())
        .zip(d.weights.par_iter())
        .map(|((s, r), &w)| row_terms(&s, &r, t, w as f64, with_grad && w != 0.0))
        .collect();
    let mut result = KlResult::default();
    for ((kl, _), &w) in terms.iter().zip(&d.weights) {
        result.weighted_kl += w as f64 * kl;
        result.weight += w as f64;
        result.tokens += usize::from(w != 0.0);
    }
    result.loss = t * t * result.weighted_kl;
    if !with_grad {
        return Ok((result, None));
    }
    let dev = model.device();
    let dtype = model.weights.dtype();
    let first = seq.len() - c;
    let vocab = model.config.vocab_size;
    let grads = model.backward_from_logits(tape, &[student], |start, len| {
        let mut block = vec![0f64; len * vocab];
        for (row, (_, g)) in terms.iter().enumerate() {
            let at = first + row;
            if let (Some(g), true) = (g, (start..start + len).contains(&at)) {
                block[(at - start) * vocab..(at - start + 1) * vocab].copy_from_slice(g);
            }
        }
        Ok(Tensor::from_vec(block, (len, vocab), dev)?.to_dtype(dtype)?)
    })?;
    Ok((result, grads.into_iter().next()))
}

#[cfg(test)]
mod tests {
    use super::row_terms;

    #[test]
    fn row_gradient_matches_finite_differences() {
        let s = [0.3, -1.2, 2.0, 0.1, -0.4];
        let r = [1.0, 0.2, -0.5, 0.3, 0.0];
        for t in [1.0, 0.7, 2.0] {
            let (kl, g) = row_terms(&s, &r, t, 1.0, true);
            assert!(kl > 0.0);
            let g = g.unwrap();
            for v in 0..s.len() {
                let at = |d: f64| {
                    let mut x = s;
                    x[v] += d;
                    t * t * row_terms(&x, &r, t, 1.0, false).0
                };
                let fd = (at(1e-3) - at(-1e-3)) / 2e-3;
                assert!((fd - g[v]).abs() < 1e-6, "t {t} v {v}: {fd} vs {}", g[v]);
            }
        }
        // Equal distributions: no divergence, no gradient.
        let (kl, g) = row_terms(&s, &s, 1.3, 2.0, true);
        assert!(kl.abs() < 1e-12);
        assert!(g.unwrap().iter().all(|x| x.abs() < 1e-12));
    }
}
