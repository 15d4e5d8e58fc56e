//! Sampling sessions and sampling requests. Sampling needs no ordering: requests queue
//! oldest first and decode together, whatever their adapters.

use lathe_sdk::types::{CheckpointUri, GetSamplerResponse, UntypedApiFuture};

use crate::sample::SampleJob;
use crate::worker::{SampleWork, SamplerSource};

use super::state::After;
use super::state::{Inflight, Sampler};
use super::{Engine, EngineError};

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
        model_path: Option<String>,
    ) {
        if let Some(s) = self.sessions.get_mut(session_id) {
            s.samplers.push(sampler_id.clone());
        }
        self.samplers.insert(
            sampler_id,
            Sampler {
                owner: owner.to_string(),
                base_model: self.model.name.clone(),
                model_path,
                source,
            },
        );
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
        let source = match model_path {
            Some(uri) => SamplerSource::Checkpoint(self.resolve_checkpoint(owner, uri)?.1),
            None => SamplerSource::Base,
        };
        let id = format!("{session_id}:sample:{seq}");
        if let Some(existing) = self.samplers.get(&id) {
            if existing.owner != owner {
                return Err(EngineError::BadRequest(format!(
                    "sampler {id} already exists"
                )));
            }
        }
        self.register_sampler(
            owner,
            session_id,
            id.clone(),
            source,
            model_path.map(|u| u.to_string()),
        );
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
        self.check_open()?;
        // Which client is sampling, for the batching decision in `pump`.
        let submitter = match &sampler {
            SamplerRef::Session(id) => id.clone(),
            SamplerRef::BaseModel => format!("{owner} base"),
            SamplerRef::Path(uri) => format!("{owner} {uri}"),
        };
        let source = match sampler {
            SamplerRef::Session(id) => self
                .samplers
                .get(&id)
                .filter(|s| s.owner == owner)
                .map(|s| s.source.clone())
                .ok_or_else(|| EngineError::NotFound(format!("unknown sampler {id}")))?,
            SamplerRef::BaseModel => SamplerSource::Base,
            SamplerRef::Path(uri) => {
                SamplerSource::Checkpoint(self.resolve_checkpoint(owner, &uri)?.1)
            }
        };
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
        self.samples.push_back((
            arrival,
            std::time::Instant::now(),
            SampleWork {
                request_id: request_id.clone(),
                source,
                job,
            },
        ));
        self.futures.insert(request_id.clone(), owner);
        self.inflight.insert(
            request_id.clone(),
            Inflight {
                run_id: None,
                after: After::Nothing,
            },
        );
        Ok(UntypedApiFuture {
            request_id,
            model_id: None,
            sample_sequence_ids: Some(sample_sequence_ids),
        })
    }
}
