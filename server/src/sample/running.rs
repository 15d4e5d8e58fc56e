//! Continuous batching: sampling requests join a running decode between two steps and
//! leave it when their last sequence ends (iteration-level scheduling, as in Orca, TGI
//! and vLLM).
//!
//! A [`RunningDecode`] holds every live sequence with its KV cache, its generator and its
//! adapter. [`RunningDecode::admit`] prefills new prompts in one batched pass and adds
//! their samples; [`RunningDecode::step`] picks every live sequence's next token and
//! advances the unfinished ones by one forward step, all adapters together. Between two
//! calls the caller may run anything else (a training pass), so no request holds the
//! model for its whole length, and a short request admitted later finishes first.
//!
//! A request fails alone where the failure is its own (its prompt, its stop strings);
//! a failed forward step fails every request in it, since their caches may be half
//! written, and leaves the set empty and usable.

use std::sync::Arc;
use std::time::Instant;

use candle_core::DType;
use rand::{rngs::StdRng, SeedableRng};
use rayon::prelude::*;

use super::jobs::{DecodeMode, Generated, SampleJob, SampleOutput, SampleTimings, Stop};
use super::logits::token_logprob;
#[cfg(feature = "cuda")]
use super::logits::{pick_on_device, Picker, StepPick};
use super::prefill::{check, prefill, scoring_groups, Prefilled};
use super::progress::TokenProgress;
use super::rescore::Rescorer;
use crate::model::cpu::decode_step::{HostAdapter, HostDecoder, StepRow};
use crate::model::transformer::TopK;
use crate::model::{Adapter, KvCache, ModelError, PackedBatch, TextTokenizer, Transformer};

/// A sampling request to start decoding, `key` naming it in what comes back.
pub struct Admission<K> {
    /// The caller's name for the request.
    pub key: K,
    /// Prompt and settings (its `adapter` index is ignored: `adapter` below decides).
    pub job: SampleJob,
    /// The adapter to sample with; `None` is the base model.
    pub adapter: Option<Arc<Adapter>>,
    /// Where to publish each picked token as it comes (streaming clients).
    pub progress: Option<TokenProgress>,
}

/// A request that left the decode: its output, or why it failed.
pub type Finished<K> = (K, Result<SampleOutput, ModelError>);

/// An adapter some live request samples with.
struct Slot {
    adapter: Arc<Adapter>,
    /// Its factors in host form, when decode steps run on the host.
    host: Option<HostAdapter>,
    /// Requests using it; the slot is freed at zero.
    users: usize,
}

/// A request with sequences still decoding.
struct Request<K> {
    key: K,
    job: SampleJob,
    slot: Option<usize>,
    /// Its sequences not yet ended.
    live: usize,
    /// Ended sequences, with their sample index.
    ended: Vec<(usize, Generated)>,
    prompt_logprobs: Option<Vec<Option<f32>>>,
    topk_prompt_logprobs: Option<Vec<Option<TopK>>>,
    /// The prompt's f32 KV cache, kept when the sampled tokens are rescored at the end.
    prompt_cache: Option<KvCache>,
    progress: Option<TokenProgress>,
    /// Set once every sequence ended and the sampled tokens wait to be rescored, a pass
    /// at a time ([`RunningDecode::rescore`]).
    rescoring: Option<Rescorer>,
}

/// One sequence being decoded.
struct Stream {
    request: usize,
    sample: usize,
    cache: KvCache,
    /// Next-token logits, waiting for a pick.
    logits: Vec<f32>,
    /// The next token and its log-probability, when the device picked it (the logits
    /// then stay there).
    chosen: Option<(u32, f32)>,
    rng: StdRng,
    out: Generated,
}

/// Every sequence being decoded, across requests and adapters. `K` names requests.
pub struct RunningDecode<K> {
    mode: DecodeMode,
    slots: Vec<Option<Slot>>,
    requests: Vec<Option<Request<K>>>,
    /// Grouped by slot, so a step's batch has one segment per adapter.
    streams: Vec<Stream>,
    timings: SampleTimings,
    /// Most rows of one rescoring pass; `None`: the model's training pass size.
    rescore_pass_rows: Option<usize>,
}

impl<K> RunningDecode<K> {
    /// An empty decode choosing tokens with `mode`'s weights.
    pub fn new(mode: DecodeMode) -> Self {
        Self {
            mode,
            slots: Vec::new(),
            requests: Vec::new(),
            streams: Vec::new(),
            timings: SampleTimings::default(),
            rescore_pass_rows: None,
        }
    }

    /// Rescores in passes of at most `rows` rows instead of the model's training pass
    /// size ([`crate::train::pass_tokens`]).
    pub fn with_rescore_pass_rows(mut self, rows: usize) -> Self {
        self.set_rescore_pass_rows(rows);
        self
    }

    /// As [`Self::with_rescore_pass_rows`], in place.
    pub fn set_rescore_pass_rows(&mut self, rows: usize) {
        self.rescore_pass_rows = Some(rows.max(1));
    }

    /// Whether no request is decoding.
    pub fn is_empty(&self) -> bool {
        self.requests.iter().all(Option::is_none)
    }

    /// Sequences still decoding, across all requests.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Each decoding request with its sequences still decoding.
    pub fn live(&self) -> impl Iterator<Item = (&K, usize)> {
        self.requests.iter().flatten().map(|r| (&r.key, r.live))
    }

    /// Each request whose sequences all ended and whose sampled tokens wait to be
    /// rescored, with the rows (tokens) of its next pass.
    pub fn rescoring(&self) -> impl Iterator<Item = (&K, usize)> {
        self.requests
            .iter()
            .flatten()
            .filter_map(|r| Some((&r.key, r.rescoring.as_ref()?.next_rows())))
    }

    /// Time spent in each phase so far.
    pub fn timings(&self) -> SampleTimings {
        self.timings
    }

    /// Drops the requests named in `keys` with their sequences (their clients gave up on
    /// them); returns the keys of those that were decoding.
    pub fn cancel(&mut self, keys: &[K]) -> Vec<K>
    where
        K: PartialEq,
    {
        let doomed: Vec<usize> = self
            .requests
            .iter()
            .enumerate()
            .filter(|(_, r)| r.as_ref().is_some_and(|r| keys.contains(&r.key)))
            .map(|(i, _)| i)
            .collect();
        if doomed.is_empty() {
            return Vec::new();
        }
        self.streams.retain(|st| !doomed.contains(&st.request));
        doomed
            .into_iter()
            .filter_map(|i| self.remove(i).map(|r| r.key))
            .collect()
    }

    /// Drops every request (after a panic left the set in doubt); returns their keys.
    pub fn clear(&mut self) -> Vec<K> {
        self.streams.clear();
        self.slots.clear();
        self.requests.drain(..).flatten().map(|r| r.key).collect()
    }

    /// Prefills `admissions`' prompts (one batched pass; alone, one by one, if that
    /// fails, so a bad prompt fails only its own request) and adds their sequences. A
    /// request that fails, or that asks for no new tokens, comes back at once.
    pub fn admit(
        &mut self,
        model: &Transformer,
        admissions: Vec<Admission<K>>,
    ) -> Vec<Finished<K>> {
        let start = Instant::now();
        let mut finished = Vec::new();
        let mut valid = Vec::with_capacity(admissions.len());
        for a in admissions {
            match check(model, &a.job) {
                Ok(()) => valid.push(a),
                Err(e) => finished.push((a.key, Err(e))),
            }
        }
        if valid.is_empty() {
            return finished;
        }
        let rescores = match self.rescores(model) {
            Ok(r) => r,
            Err(e) => {
                finished.extend(valid.into_iter().map(|a| (a.key, Err(copy(&e)))));
                return finished;
            }
        };
        for group in scoring_groups(valid) {
            match prefill(model, &group, self.mode) {
                Ok(pre) => {
                    for (a, p) in group.into_iter().zip(pre) {
                        finished.extend(self.add(model, a, p, rescores));
                    }
                }
                Err(_) if group.len() > 1 => {
                    for a in group {
                        match prefill(model, std::slice::from_ref(&a), self.mode) {
                            Ok(mut p) => {
                                let p = p.pop().expect("one prompt, one prefill");
                                finished.extend(self.add(model, a, p, rescores));
                            }
                            Err(e) => finished.push((a.key, Err(e))),
                        }
                    }
                }
                Err(e) => finished.extend(group.into_iter().map(|a| (a.key, Err(copy(&e))))),
            }
        }
        // Stable: the samples of a request keep their order within a slot.
        self.streams
            .sort_by_key(|s| self.requests[s.request].as_ref().and_then(|r| r.slot));
        self.timings.prefill += start.elapsed();
        finished
    }

    /// Whether this mode's sampled tokens are rescored with the f32 weights at the end.
    fn rescores(&self, model: &Transformer) -> Result<bool, ModelError> {
        Ok(self.mode.on(model) == DecodeMode::Fast && !model.decode_weights()?.exact())
    }

    /// Adds one prefilled request's sequences; returns it at once if it has none to run.
    fn add(
        &mut self,
        model: &Transformer,
        a: Admission<K>,
        pre: Prefilled,
        rescores: bool,
    ) -> Option<Finished<K>> {
        let samples = if a.job.max_tokens == 0 {
            0
        } else {
            a.job.num_samples
        };
        // Each sample continues a cache of its own: copies of the prompt's, and the last
        // takes the prompt's own unless rescoring keeps it.
        let copies = if rescores {
            samples
        } else {
            samples.saturating_sub(1)
        };
        let caches: Result<Vec<KvCache>, _> = (0..copies).map(|_| pre.cache.try_clone()).collect();
        let mut caches = match caches {
            Ok(caches) => caches,
            Err(e) => return Some((a.key, Err(e.into()))),
        };
        let mut prompt_cache = Some(pre.cache);
        if caches.len() < samples {
            caches.extend(prompt_cache.take());
        }
        let mut caches = caches.into_iter();
        let slot = match a.adapter.map(|ad| self.slot_for(model, ad)).transpose() {
            Ok(slot) => slot,
            Err(e) => return Some((a.key, Err(e))),
        };
        let index = match self.requests.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.requests.push(None);
                self.requests.len() - 1
            }
        };
        for sample in 0..samples {
            let rng = match a.job.seed {
                Some(seed) => StdRng::seed_from_u64(seed.wrapping_add(sample as u64)),
                None => StdRng::from_os_rng(),
            };
            self.streams.push(Stream {
                request: index,
                sample,
                cache: caches.next().expect("one cache per sample"),
                logits: pre.first.clone(),
                chosen: None,
                rng,
                out: nothing_yet(),
            });
        }
        let ended = (samples..a.job.num_samples)
            .map(|i| (i, nothing_yet()))
            .collect();
        self.requests[index] = Some(Request {
            key: a.key,
            job: a.job,
            slot,
            live: samples,
            ended,
            prompt_logprobs: pre.prompt_logprobs,
            topk_prompt_logprobs: pre.topk_prompt_logprobs,
            prompt_cache: if rescores { prompt_cache } else { None },
            progress: a.progress,
            rescoring: None,
        });
        if samples == 0 {
            self.ended(model, index)
        } else {
            None
        }
    }

    /// The slot holding `adapter` (the same `Arc`), made if new.
    fn slot_for(
        &mut self,
        model: &Transformer,
        adapter: Arc<Adapter>,
    ) -> Result<usize, ModelError> {
        let found = self.slots.iter().position(|s| {
            s.as_ref()
                .is_some_and(|s| Arc::ptr_eq(&s.adapter, &adapter))
        });
        if let Some(i) = found {
            self.slots[i].as_mut().expect("found").users += 1;
            return Ok(i);
        }
        let host = if HostDecoder::applies(model) {
            Some(HostAdapter::new(model, &adapter)?)
        } else {
            None
        };
        let slot = Some(Slot {
            adapter,
            host,
            users: 1,
        });
        match self.slots.iter().position(Option::is_none) {
            Some(i) => {
                self.slots[i] = slot;
                Ok(i)
            }
            None => {
                self.slots.push(slot);
                Ok(self.slots.len() - 1)
            }
        }
    }

    /// One iteration: every live sequence picks its next token; requests whose
    /// sequences have all ended leave (returned) or, when their tokens are rescored,
    /// start rescoring ([`Self::rescoring`], [`Self::rescore`]); the rest advance one
    /// forward step.
    pub fn step(&mut self, model: &Transformer, tokenizer: &TextTokenizer) -> Vec<Finished<K>> {
        let start = Instant::now();
        let mut finished = Vec::new();
        if self.streams.is_empty() {
            return finished;
        }
        let picked = self.pick(tokenizer);
        // Sequences that ended join their request's results; a failed pick fails its
        // request.
        let mut failed: Vec<(usize, ModelError)> = Vec::new();
        let mut kept = Vec::with_capacity(self.streams.len());
        for (stream, result) in std::mem::take(&mut self.streams).into_iter().zip(picked) {
            if result.is_ok() {
                let r = self.requests[stream.request].as_ref();
                if let (Some(p), Some(&tok)) = (
                    r.and_then(|r| r.progress.as_ref()),
                    stream.out.tokens.last(),
                ) {
                    p.push(stream.sample, tok);
                }
            }
            match result {
                Ok(false) => kept.push(stream),
                Ok(true) => {
                    let r = self.requests[stream.request]
                        .as_mut()
                        .expect("live request");
                    r.live -= 1;
                    r.ended.push((stream.sample, stream.out));
                }
                Err(e) => {
                    if !failed.iter().any(|(i, _)| *i == stream.request) {
                        failed.push((stream.request, e));
                    }
                }
            }
        }
        self.streams = kept;
        for (index, e) in failed {
            self.streams.retain(|s| s.request != index);
            if let Some(r) = self.remove(index) {
                finished.push((r.key, Err(e)));
            }
        }
        let done: Vec<usize> = (0..self.requests.len())
            .filter(|&i| {
                self.requests[i]
                    .as_ref()
                    .is_some_and(|r| r.live == 0 && r.rescoring.is_none())
            })
            .collect();
        let decoded = start.elapsed();
        for index in done {
            finished.extend(self.ended(model, index));
        }
        let forward = Instant::now();
        if !self.streams.is_empty() {
            if let Err(e) = self.forward(model) {
                // The caches may be half written: every request in the step fails (those
                // rescoring had no sequence in it).
                tracing::warn!("a decode step failed; failing its requests: {e}");
                self.streams.clear();
                let stepped: Vec<usize> = (0..self.requests.len())
                    .filter(|&i| {
                        self.requests[i]
                            .as_ref()
                            .is_some_and(|r| r.rescoring.is_none())
                    })
                    .collect();
                for index in stepped {
                    if let Some(r) = self.remove(index) {
                        finished.push((r.key, Err(copy(&e))));
                    }
                }
            }
        }
        self.timings.decode += decoded + forward.elapsed();
        finished
    }

    /// Each live sequence picks its next token from its logits; `Ok(true)` when it
    /// ended. Sequences pick in parallel: a pick reads the whole vocabulary row.
    fn pick(&mut self, tokenizer: &TextTokenizer) -> Vec<Result<bool, ModelError>> {
        let jobs: Vec<Option<&SampleJob>> = self
            .requests
            .iter()
            .map(|r| r.as_ref().map(|r| &r.job))
            .collect();
        let pick = |st: &mut Stream| -> Result<bool, ModelError> {
            let job = jobs[st.request].expect("live request");
            let (tok, logprob) = match st.chosen.take() {
                Some((tok, logprob)) => (tok as usize, logprob),
                None => {
                    let tok = job.picker.pick(&st.logits, &mut st.rng);
                    (tok, token_logprob(&st.logits, tok) as f32)
                }
            };
            st.out.tokens.push(tok as u32);
            st.out.logprobs.push(logprob);
            let stopped = job.stop_tokens.contains(&(tok as u32))
                || tokenizer.eos_ids().contains(&(tok as u32))
                || (!job.stop_strings.is_empty()
                    && hits_stop_string(tokenizer, &st.out.tokens, &job.stop_strings)?);
            if stopped {
                st.out.stop = Stop::Stop;
            }
            Ok(stopped || st.out.tokens.len() >= job.max_tokens)
        };
        if self.streams.len() > 1 {
            self.streams.par_iter_mut().map(pick).collect()
        } else {
            self.streams.iter_mut().map(pick).collect()
        }
    }

    /// Advances every live sequence by its newest token, all adapters in one step.
    fn forward(&mut self, model: &Transformer) -> Result<(), ModelError> {
        // The slots in use, numbered densely for this step.
        let mut dense: Vec<usize> = Vec::new();
        let mut index_of = vec![usize::MAX; self.slots.len()];
        for st in &self.streams {
            if let Some(s) = self.requests[st.request].as_ref().and_then(|r| r.slot) {
                if index_of[s] == usize::MAX {
                    index_of[s] = dense.len();
                    dense.push(s);
                }
            }
        }
        let adapter_of = |st: &Stream| {
            self.requests[st.request]
                .as_ref()
                .and_then(|r| r.slot)
                .map(|s| index_of[s])
        };
        let slot = |s: usize| self.slots[s].as_ref().expect("a slot in use");
        let quantized = self.mode.on(model) == DecodeMode::Fast;
        // On the CPU, decode steps run over plain buffers (see `model::cpu::decode_step`).
        if HostDecoder::applies(model) {
            let hosts: Vec<&HostAdapter> = dense
                .iter()
                .map(|&s| slot(s).host.as_ref().expect("built for a host model"))
                .collect();
            let host = HostDecoder::new(model, hosts, quantized)?.expect("checked above");
            let rows: Vec<StepRow> = self
                .streams
                .iter()
                .map(|st| StepRow {
                    token: *st.out.tokens.last().expect("a token"),
                    adapter: adapter_of(st),
                    position: st.cache.len(),
                })
                .collect();
            let mut caches: Vec<&mut KvCache> =
                self.streams.iter_mut().map(|st| &mut st.cache).collect();
            let logits = host.step(&rows, &mut caches)?;
            let vocab = logits.len() / rows.len();
            for (st, row) in self.streams.iter_mut().zip(logits.chunks_exact(vocab)) {
                st.logits.clear();
                st.logits.extend_from_slice(row);
            }
            return Ok(());
        }
        let adapters: Vec<&Adapter> = dense.iter().map(|&s| slot(s).adapter.as_ref()).collect();
        let last: Vec<[u32; 1]> = self
            .streams
            .iter()
            .map(|st| [*st.out.tokens.last().expect("a token")])
            .collect();
        let seqs: Vec<(&[u32], Option<usize>, usize)> = self
            .streams
            .iter()
            .zip(&last)
            .map(|(st, t)| (t.as_slice(), adapter_of(st), st.cache.len()))
            .collect();
        let batch = PackedBatch::new(&seqs, model.device())?;
        let mut caches: Vec<&mut KvCache> =
            self.streams.iter_mut().map(|st| &mut st.cache).collect();
        let logits = model
            .forward_cached(&batch, &adapters, &mut caches, quantized)?
            .to_dtype(DType::F32)?;
        #[cfg(feature = "cuda")]
        {
            let requests = &self.requests;
            let mut pickers: Vec<(&Picker, &mut StdRng)> = (self.streams.iter_mut())
                .map(|st| {
                    let r = requests[st.request].as_ref().expect("live request");
                    (&r.job.picker, &mut st.rng)
                })
                .collect();
            if let Some(picks) = pick_on_device(model.backend(), &logits, &mut pickers)? {
                for (st, pick) in self.streams.iter_mut().zip(picks) {
                    match pick {
                        StepPick::Chosen(token, logprob) => {
                            st.logits.clear();
                            st.chosen = Some((token, logprob));
                        }
                        StepPick::Logits(row) => st.logits = row,
                    }
                }
                return Ok(());
            }
        }
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        for (st, row) in self.streams.iter_mut().zip(rows) {
            st.logits = row;
        }
        Ok(())
    }

    /// Removes request `index` and releases its adapter slot.
    fn remove(&mut self, index: usize) -> Option<Request<K>> {
        let r = self.requests.get_mut(index)?.take()?;
        if let Some(s) = r.slot {
            let slot = self.slots[s].as_mut().expect("a slot in use");
            slot.users -= 1;
            if slot.users == 0 {
                self.slots[s] = None;
            }
        }
        Some(r)
    }

    /// Request `index`, all of whose sequences ended: it leaves with its output, or
    /// starts rescoring its sampled tokens when the mode asks for it.
    fn ended(&mut self, model: &Transformer, index: usize) -> Option<Finished<K>> {
        let r = self.requests[index].as_mut().expect("a live request");
        r.ended.sort_by_key(|(i, _)| *i);
        let sequences: Vec<Generated> = std::mem::take(&mut r.ended)
            .into_iter()
            .map(|(_, g)| g)
            .collect();
        if r.prompt_cache.is_some() {
            let rows = self
                .rescore_pass_rows
                .unwrap_or_else(|| crate::train::pass_tokens(model));
            let rescorer = Rescorer::new(sequences, rows);
            if !rescorer.is_done() {
                r.rescoring = Some(rescorer);
                return None;
            }
            return Some(self.leave(index, rescorer.sequences));
        }
        Some(self.leave(index, sequences))
    }

    /// One pass of rescoring request `key`'s tokens (the rows [`Self::rescoring`] gave);
    /// it leaves once all are scored, or if the pass fails. Nothing for a key that is
    /// not rescoring (cancelled meanwhile).
    pub fn rescore(&mut self, model: &Transformer, key: &K) -> Option<Finished<K>>
    where
        K: PartialEq,
    {
        let index = self.requests.iter().position(|r| {
            r.as_ref()
                .is_some_and(|r| r.rescoring.is_some() && r.key == *key)
        })?;
        let adapter = self.requests[index].as_ref().and_then(|r| r.slot).map(|s| {
            self.slots[s]
                .as_ref()
                .expect("a slot in use")
                .adapter
                .clone()
        });
        let start = Instant::now();
        let r = self.requests[index].as_mut().expect("a live request");
        let (job, cache) = (&r.job, r.prompt_cache.as_ref().expect("kept to rescore"));
        let rescorer = r.rescoring.as_mut().expect("rescoring");
        let passed = rescorer.pass(model, adapter.as_deref(), job, cache);
        let done = rescorer.is_done();
        self.timings.rescore += start.elapsed();
        match passed {
            Err(e) => self.remove(index).map(|r| (r.key, Err(e))),
            Ok(()) if done => {
                let rescorer = r.rescoring.take().expect("rescoring");
                Some(self.leave(index, rescorer.sequences))
            }
            Ok(()) => None,
        }
    }

    /// One pass of every rescoring request's tokens (for a caller with nothing else to
    /// interleave with them).
    pub fn rescore_all(&mut self, model: &Transformer) -> Vec<Finished<K>>
    where
        K: Clone + PartialEq,
    {
        let keys: Vec<K> = self.rescoring().map(|(k, _)| k.clone()).collect();
        keys.iter().filter_map(|k| self.rescore(model, k)).collect()
    }

    /// Request `index` leaves with `sequences` as its output.
    fn leave(&mut self, index: usize, sequences: Vec<Generated>) -> Finished<K> {
        let r = self.remove(index).expect("a live request");
        let output = SampleOutput {
            sequences,
            prompt_logprobs: r.prompt_logprobs,
            topk_prompt_logprobs: r.topk_prompt_logprobs,
        };
        (r.key, Ok(output))
    }
}

/// A sequence before its first token.
fn nothing_yet() -> Generated {
    Generated {
        tokens: Vec::new(),
        logprobs: Vec::new(),
        stop: Stop::Length,
    }
}

/// Whether the text ends in a stop string. Checked after every token, so only a window
/// that can hold the newest occurrence is decoded: a stop string of `L` bytes spans at
/// most `L` tokens (every token is at least one byte), plus one for a split character.
fn hits_stop_string(
    tokenizer: &TextTokenizer,
    tokens: &[u32],
    stops: &[String],
) -> Result<bool, ModelError> {
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let window = &tokens[tokens.len().saturating_sub(longest + 1)..];
    let text = tokenizer.decode(window)?;
    Ok(stops
        .iter()
        .any(|s| !s.is_empty() && text.contains(s.as_str())))
}

/// A copy of `e` for each of several requests it fails: bad input stays bad input, a
/// fault stays a fault (with its message).
fn copy(e: &ModelError) -> ModelError {
    match e {
        ModelError::Input(m) => ModelError::Input(m.clone()),
        ModelError::Lora(m) => ModelError::Lora(m.clone()),
        other => ModelError::Candle(candle_core::Error::Msg(other.to_string())),
    }
}
