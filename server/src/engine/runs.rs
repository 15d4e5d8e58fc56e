//! Training runs: creation, the operations queued on them, checkpoints they save and load.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use lathe_sdk::types::{
    CheckpointKind, CheckpointUri, GetInfoResponse, ModelData, UntypedApiFuture,
    WeightsInfoResponse,
};

use crate::model::LoraSpec;
use crate::store::checkpoints::CheckpointMeta;
use crate::store::db::{CheckpointRow, RunRow};
use crate::train::reverse_kl::{KlDatum, MAX_COMPLETION_TOKENS};
use crate::worker::{RunOp, SamplerSource};

use super::run_queue::Queued;
use super::state::{now_unix, After, Inflight, Run};
use super::{Engine, EngineError, Ttl};

/// In-memory sampler snapshots (`save_weights_and_get_sampling_client`) kept per run;
/// taking one more frees the least recently used (by `asample`) and closes its sampling
/// session.
pub const MAX_SNAPSHOTS_PER_RUN: usize = 4;

/// A validated `create_model`.
#[derive(Debug, Clone)]
pub struct NewRun {
    /// Owning session.
    pub session_id: String,
    /// The client's model counter.
    pub model_seq_id: u64,
    /// Rank and targets.
    pub spec: LoraSpec,
    /// Seed of A (random when the client gave none).
    pub seed: u64,
    /// Metadata kept with the run.
    pub user_metadata: BTreeMap<String, String>,
}

/// A validated save request.
#[derive(Debug, Clone)]
pub struct SaveRequest {
    /// Training state or sampler weights.
    pub kind: CheckpointKind,
    /// Checkpoint name (already checked).
    pub name: String,
    /// Replace an existing one.
    pub overwrite: bool,
    /// Delete this long after saving.
    pub ttl: Option<Ttl>,
}

impl Engine {
    /// Refuses a new run when the server holds `--max-sessions`, or when `owner` already
    /// has a run and only the reserved eighth of the slots is left: those are kept for
    /// keys without one, so that a few keys at their `--max-live-runs` cannot shut every
    /// other key out.
    fn check_capacity(&self, owner: &str) -> Result<(), EngineError> {
        let max = self.config.max_sessions;
        let loaded = self.runs.len();
        if loaded >= max {
            return Err(EngineError::Capacity(format!(
                "the server is at its limit of {max} training sessions (--max-sessions); \
                 unload one or try again later"
            )));
        }
        let reserved = max / 8;
        if loaded + reserved >= max && self.runs.values().any(|r| r.owner == owner) {
            return Err(EngineError::Capacity(format!(
                "the server holds {loaded} of its {max} training sessions (--max-sessions), \
                 and the last {reserved} are kept for keys without a loaded run; unload \
                 one of this key's runs or try again later"
            )));
        }
        Ok(())
    }

    /// Registers a run and queues `first` as its operation number 0.
    fn start_run(
        &mut self,
        owner: &str,
        session_id: &str,
        model_seq_id: u64,
        spec: LoraSpec,
        user_metadata: BTreeMap<String, String>,
        first: RunOp,
    ) -> Result<UntypedApiFuture, EngineError> {
        self.check_open()?;
        let run_id = format!("{session_id}:train:{model_seq_id}");
        if let Some(run) = self.runs.get(&run_id) {
            // A retried create: answer with the same future.
            if run.owner == owner {
                if let Some(id) = run.queue.seen(0) {
                    return Ok(UntypedApiFuture {
                        request_id: id.clone(),
                        model_id: Some(run_id),
                        sample_sequence_ids: None,
                    });
                }
            }
            return Err(EngineError::BadRequest(format!(
                "training run {run_id} already exists"
            )));
        }
        self.check_capacity(owner)?;
        self.check_live_runs(owner)?;
        let state = self
            .model
            .lora_widths
            .adapter_bytes(&spec)
            .saturating_mul(super::limits::RUN_STATE_COPIES);
        self.check_adapter_memory(owner, state)?;
        self.check_queue(owner)?;
        self.session_mut(owner, session_id)?
            .runs
            .push(run_id.clone());
        let now = now_unix();
        self.store_work.new_runs.push(RunRow {
            id: run_id.clone(),
            owner: owner.to_string(),
            session_id: session_id.to_string(),
            base_model: self.model.name.clone(),
            rank: spec.rank,
            train_attn: spec.train_attn,
            train_mlp: spec.train_mlp,
            train_unembed: spec.train_unembed,
            created_at: now,
            last_request_at: now,
            user_metadata,
        });
        let request_id = uuid::Uuid::new_v4().to_string();
        let arrival = self.next_arrival();
        let mut run = Run {
            owner: owner.to_string(),
            session_id: session_id.to_string(),
            spec,
            queue: Default::default(),
            inflight: false,
            last_submit: Instant::now(),
            snapshots: Default::default(),
        };
        run.queue.push(
            0,
            Queued {
                request_id: request_id.clone(),
                arrival,
                since: Instant::now(),
                op: first,
            },
        );
        self.runs.insert(run_id.clone(), run);
        self.futures.insert(request_id.clone(), owner);
        self.inflight.insert(
            request_id.clone(),
            Inflight {
                run_id: Some(run_id.clone()),
                after: After::DropRunOnFailure,
                owner: owner.to_string(),
                sample_tokens: 0,
                arrival: 0,
                more_passes: false,
                partial: None,
                save: None,
                adapter: None,
            },
        );
        Ok(UntypedApiFuture {
            request_id,
            model_id: Some(run_id),
            sample_sequence_ids: None,
        })
    }

    /// `create_model`: a fresh adapter.
    pub fn create_model(
        &mut self,
        owner: &str,
        req: NewRun,
    ) -> Result<UntypedApiFuture, EngineError> {
        let op = RunOp::Create {
            spec: req.spec,
            seed: req.seed,
        };
        self.start_run(
            owner,
            &req.session_id,
            req.model_seq_id,
            req.spec,
            req.user_metadata,
            op,
        )
    }

    /// Create-via-load (SDK 0.38): a new run initialised from a training checkpoint.
    pub fn create_from_checkpoint(
        &mut self,
        owner: &str,
        session_id: &str,
        model_seq_id: u64,
        uri: &CheckpointUri,
        optimizer: bool,
    ) -> Result<UntypedApiFuture, EngineError> {
        let (row, dir) = self.resolve_checkpoint(owner, uri)?;
        check_loadable(uri, optimizer)?;
        let spec = spec_of(&row);
        let op = RunOp::Load {
            uri: uri.clone(),
            dir,
            optimizer,
            create: true,
        };
        self.start_run(owner, session_id, model_seq_id, spec, BTreeMap::new(), op)
    }

    /// Queues a forward pass, optimizer step or unload on a run.
    pub fn submit(
        &mut self,
        owner: &str,
        run_id: &str,
        seq_id: Option<u64>,
        op: RunOp,
    ) -> Result<String, EngineError> {
        let after = if matches!(op, RunOp::Unload) {
            After::Unloaded
        } else {
            After::Nothing
        };
        self.enqueue(owner, run_id, seq_id, op, after)
    }

    /// Queues a checkpoint save; the index row is written when the files are in place.
    pub fn save(
        &mut self,
        owner: &str,
        run_id: &str,
        seq_id: Option<u64>,
        req: SaveRequest,
    ) -> Result<String, EngineError> {
        if let Some(first) = self.repeated(owner, run_id, seq_id) {
            return Ok(first);
        }
        let spec = self.loaded_run(owner, run_id)?.spec;
        let uri = CheckpointUri {
            run_id: run_id.to_string(),
            kind: req.kind,
            name: req.name.clone(),
        };
        let exists = self.catalog.exists(&uri);
        if exists && !req.overwrite {
            return Err(EngineError::BadRequest(format!(
                "checkpoint {uri} already exists (pass overwrite to replace it)"
            )));
        }
        let training = req.kind == CheckpointKind::Training;
        let bytes = self.model.lora_widths.checkpoint_bytes(&spec, training);
        self.check_checkpoint_quota(owner, !exists, bytes)?;
        let now = now_unix();
        let meta = CheckpointMeta {
            run_id: run_id.to_string(),
            kind: req.kind.type_name().to_string(),
            name: req.name,
            owner: owner.to_string(),
            base_model: self.model.name.clone(),
            created_at: now,
            expires_at: req.ttl.map(|t| t.expires_at(now)),
            rank: spec.rank,
            train_attn: spec.train_attn,
            train_mlp: spec.train_mlp,
            train_unembed: spec.train_unembed,
        };
        let op = RunOp::Save {
            meta,
            overwrite: req.overwrite,
        };
        let request_id = self.enqueue(owner, run_id, seq_id, op, After::Nothing)?;
        if let Some(f) = self.inflight.get_mut(&request_id) {
            f.save = Some((!exists, bytes));
        }
        Ok(request_id)
    }

    /// MinT's reverse-KL step on a run: the reference must be readable now (and is
    /// checked again when the step runs). Without a `seq_id` the step takes no number.
    pub fn reverse_kl(
        &mut self,
        owner: &str,
        run_id: &str,
        seq_id: Option<u64>,
        reference: Option<CheckpointUri>,
        data: Vec<KlDatum>,
        temperature: f64,
    ) -> Result<String, EngineError> {
        // The step runs as one worker operation: it must be no larger than a pass (or a
        // single datum), so no key holds the worker longer than a pass.
        let completion: usize = data.iter().map(|d| d.completion.len()).sum();
        if completion > MAX_COMPLETION_TOKENS {
            return Err(EngineError::BadRequest(format!(
                "this reverse-KL request has {completion} completion tokens; the limit is \
                 {MAX_COMPLETION_TOKENS} per request: split it"
            )));
        }
        let tokens: usize = data.iter().map(KlDatum::tokens).sum();
        if data.len() > 1 && tokens > self.config.max_batch_tokens {
            return Err(EngineError::BadRequest(format!(
                "this reverse-KL request reads {tokens} tokens (both prompts and the \
                 completion, per datum); requests of several datums are limited to \
                 --max-batch-tokens ({}): split it",
                self.config.max_batch_tokens
            )));
        }
        if let Some(uri) = &reference {
            self.resolve_checkpoint(owner, uri)?;
        }
        let op = RunOp::ReverseKl {
            data,
            reference,
            dir: PathBuf::new(),
            temperature,
        };
        match seq_id {
            Some(_) => self.enqueue(owner, run_id, seq_id, op, After::Nothing),
            None => self.enqueue_unordered(owner, run_id, op),
        }
    }

    /// `save_weights_and_get_sampling_client`: snapshots the adapter in memory and opens
    /// a sampling session on it.
    pub fn snapshot_for_sampler(
        &mut self,
        owner: &str,
        run_id: &str,
        seq_id: Option<u64>,
        sampling_session_seq_id: Option<u64>,
    ) -> Result<String, EngineError> {
        if let Some(first) = self.repeated(owner, run_id, seq_id) {
            return Ok(first);
        }
        let run = self.loaded_run(owner, run_id)?;
        let (session_id, spec, replaces) = (
            run.session_id.clone(),
            run.spec,
            run.snapshots.len() >= MAX_SNAPSHOTS_PER_RUN,
        );
        // A snapshot past the run's last few replaces the oldest.
        let copy = if replaces {
            0
        } else {
            self.model.lora_widths.adapter_bytes(&spec)
        };
        self.check_samplers(owner)?;
        self.check_adapter_memory(owner, copy)?;
        let seq = match sampling_session_seq_id {
            Some(s) => s,
            None => self.next_arrival() + 1_000_000_000,
        };
        let sampler_id = format!("{session_id}:sample:{seq}");
        let request_id = self.enqueue(
            owner,
            run_id,
            seq_id,
            RunOp::Snapshot {
                sampler_id: sampler_id.clone(),
            },
            After::Nothing,
        )?;
        let source = SamplerSource::Snapshot(sampler_id.clone());
        self.register_sampler(owner, &session_id, sampler_id.clone(), source, None);
        // Each snapshot holds a full adapter in memory; keep the most recently used few.
        let run = self.runs.get_mut(run_id).expect("loaded above");
        run.snapshots.push_back(sampler_id);
        let mut evicted = Vec::new();
        while run.snapshots.len() > MAX_SNAPSHOTS_PER_RUN {
            evicted.extend(run.snapshots.pop_front());
        }
        let closed = evicted.iter().cloned().collect();
        self.futures.completions.forget_samplers(&closed);
        for old in evicted {
            self.samplers.remove(&old);
            if let Some(s) = self.sessions.get_mut(&session_id) {
                s.samplers.retain(|x| x != &old);
            }
            self.drop_snapshots.push(old);
        }
        Ok(request_id)
    }

    /// `load_weights` into an existing run.
    pub fn load(
        &mut self,
        owner: &str,
        run_id: &str,
        seq_id: Option<u64>,
        uri: &CheckpointUri,
        optimizer: bool,
    ) -> Result<String, EngineError> {
        if let Some(first) = self.repeated(owner, run_id, seq_id) {
            return Ok(first);
        }
        check_loadable(uri, optimizer)?;
        let (row, dir) = self.resolve_checkpoint(owner, uri)?;
        let spec = self.loaded_run(owner, run_id)?.spec;
        if spec_of(&row) != spec {
            return Err(EngineError::BadRequest(format!(
                "checkpoint {uri} has rank {} (attn {}, mlp {}, unembed {}) but run {run_id} has \
                 rank {} (attn {}, mlp {}, unembed {})",
                row.meta.rank,
                row.meta.train_attn,
                row.meta.train_mlp,
                row.meta.train_unembed,
                spec.rank,
                spec.train_attn,
                spec.train_mlp,
                spec.train_unembed
            )));
        }
        let op = RunOp::Load {
            uri: uri.clone(),
            dir,
            optimizer,
            create: false,
        };
        self.enqueue(owner, run_id, seq_id, op, After::Nothing)
    }

    /// `get_info` on a loaded run.
    pub fn get_info(&mut self, owner: &str, run_id: &str) -> Result<GetInfoResponse, EngineError> {
        let rank = self.loaded_run(owner, run_id)?.spec.rank;
        Ok(GetInfoResponse {
            model_id: run_id.to_string(),
            is_lora: true,
            lora_rank: rank,
            model_name: self.model.name.clone(),
            model_data: ModelData {
                arch: self.model.arch.clone(),
                model_name: self.model.name.clone(),
                tokenizer_id: None,
            },
        })
    }

    /// What a checkpoint was trained as.
    pub fn weights_info(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<WeightsInfoResponse, EngineError> {
        let (row, _) = self.resolve_checkpoint(owner, uri)?;
        Ok(WeightsInfoResponse {
            base_model: row.meta.base_model,
            is_lora: true,
            lora_rank: row.meta.rank,
            train_unembed: row.meta.train_unembed,
            train_mlp: row.meta.train_mlp,
            train_attn: row.meta.train_attn,
        })
    }

    /// A checkpoint readable by `owner` now (its own, or published), and the directory
    /// of its current version.
    pub fn resolve_checkpoint(
        &self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<(CheckpointRow, PathBuf), EngineError> {
        let row = self.catalog.readable(owner, uri)?;
        let dir = self
            .catalog
            .dir_of(row)
            .ok_or_else(|| EngineError::NotFound(format!("unknown checkpoint {uri}")))?;
        Ok((row.clone(), dir))
    }
}

pub(super) fn spec_of(row: &CheckpointRow) -> LoraSpec {
    LoraSpec {
        rank: row.meta.rank,
        train_attn: row.meta.train_attn,
        train_mlp: row.meta.train_mlp,
        train_unembed: row.meta.train_unembed,
    }
}

fn check_loadable(uri: &CheckpointUri, optimizer: bool) -> Result<(), EngineError> {
    if optimizer && uri.kind == CheckpointKind::Sampler {
        return Err(EngineError::BadRequest(format!(
            "{uri} holds sampler weights only; load it without the optimizer state, or load a \
             weights/ checkpoint"
        )));
    }
    Ok(())
}
