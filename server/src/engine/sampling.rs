//! Sampling sessions and sampling requests. Sampling needs no ordering: requests queue
//! oldest first and decode together, whatever their adapters.

use std::path::PathBuf;

use lathe_sdk::types::{CheckpointUri, GetSamplerResponse, UntypedApiFuture};

use crate::sample::{SampleJob, TokenProgress};
use crate::worker::{SampleWork, SamplerSource};

use super::completions::MAX_LOGS_PER_KEY;
use super::limits::too_many_logs;
use super::runs::spec_of;
use super::state::{After, Inflight, Pin, QueuedSample, Sampler};
use super::{Engine, EngineError};

fn logs_message() -> String {
    format!(
        "this key has {MAX_LOGS_PER_KEY} completion logs (one per sampling client copy that \
         sampled or waited on retrieve_futures); they go when their sampling session ends \
         or after the futures' TTL idle"
    )
}

/// Copies of a checkpoint adapter a decode holds in the worker: the adapter and the
/// host decoder's copy of its factors.
pub(super) const SAMPLING_ADAPTER_COPIES: u64 = 2;

/// Most copies of one sampling client (`join_sampling_session`); each may have a
/// completion queue.
pub const MAX_CLIENT_COPIES: u64 = 1024;

/// Which sampler a request uses.
#[derive(Debug, Clone)]
pub enum SamplerRef {
    /// A sampling session.
    Session(String),
    /// The base model, without a session.
    BaseModel,
    /// A checkpoint, without a session.
    Path(CheckpointUri),
}

impl Engine {
    pub(super) fn register_sampler(
        &mut self,
        owner: &str,
        session_id: &str,
        sampler_id: String,
        source: SamplerSource,
        pin: Option<Pin>,
    ) {
        if let Some(s) = self.sessions.get_mut(session_id) {
            if !s.samplers.contains(&sampler_id) {
                s.samplers.push(sampler_id.clone());
            }
        }
        self.samplers.insert(
            sampler_id,
            Sampler {
                owner: owner.to_string(),
                base_model: self.model.name.clone(),
                model_path: pin.as_ref().map(|p| p.uri.to_string()),
                source,
                pin,
                clients: 0,
            },
        );
    }

    /// The adapter source of a checkpoint `owner` may read now, pinned to its current
    /// version.
    fn checkpoint_source(
        &self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<(SamplerSource, Pin), EngineError> {
        let (row, dir) = self.resolve_checkpoint(owner, uri)?;
        let pin = Pin {
            uri: uri.clone(),
            version: row.version,
        };
        Ok((SamplerSource::Checkpoint(dir), pin))
    }

    /// The checkpoint adapter a sampling request on `source` will hold in the worker,
    /// with its f32 size (held [`SAMPLING_ADAPTER_COPIES`] times there), refused past
    /// the key's adapter memory unless its requests hold it already, or past the
    /// server's unless any request does.
    fn sampling_adapter(
        &self,
        owner: &str,
        source: &SamplerSource,
        pin: Option<&Pin>,
    ) -> Result<Option<(PathBuf, u64)>, EngineError> {
        let (SamplerSource::Checkpoint(dir), Some(pin)) = (source, pin) else {
            return Ok(None);
        };
        let row = self.catalog.readable(owner, &pin.uri)?;
        let bytes = self.model.lora_widths.adapter_bytes(&spec_of(row));
        let held = bytes.saturating_mul(SAMPLING_ADAPTER_COPIES);
        let new = |holds: bool| if holds { 0 } else { held };
        self.check_adapter_memory_of(
            owner,
            new(self.holds_sampling_adapter(Some(owner), dir)),
            new(self.holds_sampling_adapter(None, dir)),
        )?;
        Ok(Some((dir.clone(), bytes)))
    }

    /// `create_sampling_session` on the base model or on a checkpoint.
    pub fn create_sampling_session(
        &mut self,
        owner: &str,
        session_id: &str,
        seq: u64,
        model_path: Option<&CheckpointUri>,
    ) -> Result<String, EngineError> {
        self.check_open()?;
        self.session_mut(owner, session_id)?;
        let (source, pin) = match model_path {
            Some(uri) => {
                let (source, pin) = self.checkpoint_source(owner, uri)?;
                (source, Some(pin))
            }
            None => (SamplerSource::Base, None),
        };
        let id = format!("{session_id}:sample:{seq}");
        match self.samplers.get(&id) {
            Some(existing) if existing.owner != owner => {
                return Err(EngineError::BadRequest(format!(
                    "sampler {id} already exists"
                )));
            }
            Some(_) => {}
            None => self.check_samplers(owner)?,
        }
        self.register_sampler(owner, session_id, id.clone(), source, pin);
        Ok(id)
    }

    /// `GET /samplers/{id}`.
    pub fn get_sampler(&self, owner: &str, id: &str) -> Result<GetSamplerResponse, EngineError> {
        let s = self
            .samplers
            .get(id)
            .filter(|s| s.owner == owner)
            .ok_or_else(|| EngineError::NotFound(format!("unknown sampler {id}")))?;
        Ok(GetSamplerResponse {
            sampler_id: id.to_string(),
            base_model: s.base_model.clone(),
            model_path: s.model_path.clone(),
        })
    }

    /// Marks a snapshot as just used, so the next eviction of its run spares it.
    fn touch_snapshot(&mut self, sampler_id: &str) {
        for run in self.runs.values_mut() {
            if let Some(at) = run.snapshots.iter().position(|s| s == sampler_id) {
                if let Some(id) = run.snapshots.remove(at) {
                    run.snapshots.push_back(id);
                }
                return;
            }
        }
    }

    /// `asample`: queues a sampling request.
    pub fn sample(
        &mut self,
        owner: &str,
        sampler: SamplerRef,
        job: SampleJob,
    ) -> Result<UntypedApiFuture, EngineError> {
        self.sample_streamed(owner, sampler, job, None, None)
    }

    /// Queues a sampling request whose tokens are also published to `progress` as they
    /// are picked (the OpenAI-compatible streaming endpoints). A request on a sampling
    /// session reports its completion to the session's `retrieve_futures` queue of
    /// client clone `clone` when that is given.
    pub fn sample_streamed(
        &mut self,
        owner: &str,
        sampler: SamplerRef,
        job: SampleJob,
        progress: Option<TokenProgress>,
        clone: Option<u64>,
    ) -> Result<UntypedApiFuture, EngineError> {
        // Only the session's own client and the copies it handed out have a queue.
        let target = match (&sampler, clone) {
            (SamplerRef::Session(id), Some(clone))
                if self.samplers.get(id).is_some_and(|s| clone <= s.clients) =>
            {
                Some((id.clone(), clone))
            }
            _ => None,
        };
        self.check_open()?;
        if let Some(target) = &target {
            if !self.futures.completions.may_watch(target, owner) {
                return Err(too_many_logs(logs_message()));
            }
        }
        // Which client is sampling, for the batching decision in `pump`.
        let submitter = match &sampler {
            SamplerRef::Session(id) => id.clone(),
            SamplerRef::BaseModel => format!("{owner} base"),
            SamplerRef::Path(uri) => format!("{owner} {uri}"),
        };
        let (source, pin) = match sampler {
            SamplerRef::Session(id) => {
                let s = self
                    .samplers
                    .get(&id)
                    .filter(|s| s.owner == owner)
                    .ok_or_else(|| EngineError::NotFound(format!("unknown sampler {id}")))?;
                (s.source.clone(), s.pin.clone())
            }
            SamplerRef::BaseModel => (SamplerSource::Base, None),
            SamplerRef::Path(uri) => {
                let (source, pin) = self.checkpoint_source(owner, &uri)?;
                (source, Some(pin))
            }
        };
        // A session opened on someone's published checkpoint samples only while it is
        // still readable and still the version it was opened on.
        self.check_pin(owner, pin.as_ref())?;
        self.check_queue(owner)?;
        let adapter = self.sampling_adapter(owner, &source, pin.as_ref())?;
        let job_tokens = job.token_budget();
        self.check_sampling_tokens(owner, job_tokens)?;
        if let SamplerSource::Snapshot(id) = &source {
            self.touch_snapshot(id);
        }
        let request_id = uuid::Uuid::new_v4().to_string();
        let sample_sequence_ids = (0..job.num_samples)
            .map(|_| uuid::Uuid::new_v4().to_string())
            .collect();
        let arrival = self.next_arrival();
        self.sample_submits
            .insert(submitter, std::time::Instant::now());
        self.samples.push_back(QueuedSample {
            arrival,
            since: std::time::Instant::now(),
            owner: owner.to_string(),
            pin,
            work: SampleWork {
                request_id: request_id.clone(),
                source,
                job,
                progress,
            },
        });
        self.futures.insert(request_id.clone(), owner);
        if let Some(target) = target {
            self.futures.completions.watch(&request_id, target, owner);
        }
        self.inflight.insert(
            request_id.clone(),
            Inflight {
                run_id: None,
                after: After::Nothing,
                owner: owner.to_string(),
                sample_tokens: job_tokens,
                arrival,
                more_passes: false,
                partial: None,
                save: None,
                adapter,
            },
        );
        Ok(UntypedApiFuture {
            request_id,
            model_id: None,
            sample_sequence_ids: Some(sample_sequence_ids),
        })
    }
}

impl Engine {
    /// `retrieve_futures`: the completions of one of `owner`'s sampling sessions (and
    /// client clone) after `prev_cursor`, or a signal for the next one when `wait`.
    pub fn poll_completions(
        &mut self,
        owner: &str,
        sampler_id: &str,
        clone: u64,
        prev_cursor: u64,
        wait: bool,
    ) -> Result<crate::engine::CompletionPoll, EngineError> {
        let sampler = self
            .samplers
            .get(sampler_id)
            .filter(|s| s.owner == owner)
            .ok_or_else(|| EngineError::NotFound(format!("unknown sampler {sampler_id}")))?;
        if clone > sampler.clients {
            return Err(EngineError::BadRequest(format!(
                "sampler {sampler_id} has no client copy {clone} (copies get their id from \
                 join_sampling_session)"
            )));
        }
        self.futures
            .completions
            .poll((sampler_id.to_string(), clone), owner, prev_cursor, wait)
            .ok_or_else(|| too_many_logs(logs_message()))
    }

    /// `join_sampling_session`: a new client id for a copy of a sampling client
    /// (unique within the session; the original client is 0).
    pub fn join_sampling_session(
        &mut self,
        owner: &str,
        sampler_id: &str,
    ) -> Result<u64, EngineError> {
        let s = self
            .samplers
            .get_mut(sampler_id)
            .filter(|s| s.owner == owner)
            .ok_or_else(|| EngineError::NotFound(format!("unknown sampler {sampler_id}")))?;
        if s.clients >= MAX_CLIENT_COPIES {
            return Err(EngineError::BadRequest(format!(
                "sampler {sampler_id} already has {MAX_CLIENT_COPIES} client copies"
            )));
        }
        s.clients += 1;
        Ok(s.clients)
    }
}

impl super::EngineHandle {
    /// `retrieve_futures`: waits up to `timeout` for a completion after `prev_cursor`
    /// of one of `owner`'s sampling sessions; answers the completions (maybe none) and
    /// the cursor to send next.
    pub async fn retrieve_futures(
        &self,
        owner: String,
        sampler_id: String,
        clone: u64,
        prev_cursor: u64,
        timeout: std::time::Duration,
    ) -> Result<(Vec<crate::engine::Completion>, u64), EngineError> {
        use crate::engine::CompletionPoll;
        // A poll that may not wait (the SDK's acknowledgements) makes no log.
        let wait = !timeout.is_zero();
        let signal = match self
            .poll_completions(owner.clone(), sampler_id.clone(), clone, prev_cursor, wait)
            .await??
        {
            CompletionPoll::Ready(events, cursor) => return Ok((events, cursor)),
            CompletionPoll::Wait(signal) => signal,
        };
        let _ = tokio::time::timeout(timeout, signal).await;
        match self
            .poll_completions(owner, sampler_id, clone, prev_cursor, false)
            .await??
        {
            CompletionPoll::Ready(events, cursor) => Ok((events, cursor)),
            CompletionPoll::Wait(_) => Ok((Vec::new(), prev_cursor)),
        }
    }
}
