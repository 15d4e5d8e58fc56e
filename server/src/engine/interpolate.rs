//! MinT's `checkpoints/interpolate`: a new sampler checkpoint whose adapter is the
//! weighted sum of other checkpoints' LoRA deltas (see [`crate::store::interpolate`]).
//!
//! The engine checks the request and resolves every source (the key must be able to
//! read each; the output goes under the first source's run, which must be the key's),
//! the files are combined and written off the actor, the key's access to every source
//! is checked again once they have been read (an owner who unpublished or replaced one
//! meanwhile takes it back), and the index commits the new checkpoint before the future
//! resolves. From the first check to the commit or the failure, the output counts in
//! the key's checkpoint quota and its name is taken. No model work is involved, so the
//! worker is not.

use std::path::PathBuf;

use lathe_sdk::types::{CheckpointKind, CheckpointUri, UntypedApiFuture};

use super::actor::EngineHandle;
use super::state::{now_unix, Pin};
use super::{Engine, EngineError};
use crate::model::lora::{LoraSpec, MAX_RANK};
use crate::store::checkpoints::CheckpointMeta;
use crate::store::db::CheckpointRow;
use crate::worker::Reply;

/// Most sources one interpolation may sum.
pub const MAX_SOURCES: usize = 16;

/// An interpolation, checked and resolved, ready to write.
#[derive(Debug, Clone)]
pub struct InterpolatePlan {
    /// Each source's current version directory with its coefficient.
    pub sources: Vec<(PathBuf, f64)>,
    /// The output checkpoint's metadata.
    pub meta: CheckpointMeta,
    /// The output's URI.
    pub uri: CheckpointUri,
    /// The source versions the key was allowed to read when the plan was made.
    pub(super) pins: Vec<Pin>,
}

impl Engine {
    /// Checks an interpolation and resolves its sources now (their current versions).
    pub fn begin_interpolate(
        &mut self,
        owner: &str,
        sources: &[CheckpointUri],
        coefficients: &[f64],
        name: String,
    ) -> Result<InterpolatePlan, EngineError> {
        self.check_open()?;
        let bad = |m: String| Err(EngineError::BadRequest(m));
        if sources.len() < 2 || sources.len() > MAX_SOURCES {
            return bad(format!(
                "interpolate needs 2 to {MAX_SOURCES} source_paths, got {}",
                sources.len()
            ));
        }
        if coefficients.len() != sources.len() {
            return bad(format!(
                "{} coefficients for {} source_paths",
                coefficients.len(),
                sources.len()
            ));
        }
        if let Some(c) = coefficients.iter().find(|c| !c.is_finite()) {
            return bad(format!("coefficients must be finite, got {c}"));
        }
        let mut resolved = Vec::with_capacity(sources.len());
        let mut rank = 0usize;
        for (uri, c) in sources.iter().zip(coefficients) {
            let (row, dir) = self.resolve_checkpoint(owner, uri)?;
            rank = rank.saturating_add(row.meta.rank);
            resolved.push((row, dir, *c, uri.clone()));
        }
        if rank > MAX_RANK {
            return bad(format!(
                "the sources' ranks sum to {rank}, above {MAX_RANK}, the largest rank Lathe \
                 serves (the sum of the deltas needs the sum of the ranks)"
            ));
        }
        let first = &resolved[0].0;
        if first.meta.owner != owner {
            return bad(format!(
                "the output is saved under the first source's run, {}, which is not yours: \
                 list one of your own checkpoints first",
                first.meta.run_id
            ));
        }
        let uri = CheckpointUri {
            run_id: first.meta.run_id.clone(),
            kind: CheckpointKind::Sampler,
            name,
        };
        if self.catalog.exists(&uri) {
            return bad(format!("checkpoint {uri} already exists"));
        }
        if self.interpolating.contains_key(&uri) {
            return bad(format!(
                "checkpoint {uri} is being written by another interpolation"
            ));
        }
        let spec = LoraSpec {
            rank,
            train_attn: first.meta.train_attn,
            train_mlp: first.meta.train_mlp,
            train_unembed: first.meta.train_unembed,
        };
        let bytes = self.model.lora_widths.checkpoint_bytes(&spec, false);
        self.check_checkpoint_quota(owner, true, bytes)?;
        let meta = CheckpointMeta {
            run_id: uri.run_id.clone(),
            kind: CheckpointKind::Sampler.type_name().to_string(),
            name: uri.name.clone(),
            owner: owner.to_string(),
            base_model: self.model.name.clone(),
            created_at: now_unix(),
            expires_at: None,
            rank,
            train_attn: spec.train_attn,
            train_mlp: spec.train_mlp,
            train_unembed: spec.train_unembed,
        };
        self.interpolating
            .insert(uri.clone(), (owner.to_string(), bytes));
        let pins = resolved
            .iter()
            .map(|(row, _, _, uri)| Pin {
                uri: uri.clone(),
                version: row.version.clone(),
            })
            .collect();
        Ok(InterpolatePlan {
            sources: resolved
                .into_iter()
                .map(|(_, dir, c, _)| (dir, c))
                .collect(),
            meta,
            uri,
            pins,
        })
    }

    /// Checks, once the sources have been read, that `owner` may still read each at the
    /// version it read. On failure the interpolation is over (see
    /// [`Engine::end_interpolate`]).
    pub fn check_interpolated(
        &mut self,
        owner: &str,
        plan: &InterpolatePlan,
    ) -> Result<(), EngineError> {
        let checked = plan
            .pins
            .iter()
            .try_for_each(|pin| self.check_pin(owner, Some(pin)));
        if checked.is_err() {
            self.end_interpolate(&plan.uri);
        }
        checked
    }

    /// An interpolation of `uri` is over (recorded or abandoned): its name and quota
    /// share are free.
    pub fn end_interpolate(&mut self, uri: &CheckpointUri) {
        self.interpolating.remove(uri);
    }

    /// Records the written checkpoint and answers a future already resolved with it.
    pub fn finish_interpolate(
        &mut self,
        owner: &str,
        row: CheckpointRow,
        reply: Reply,
    ) -> UntypedApiFuture {
        if let Some(uri) = row.meta.uri() {
            self.end_interpolate(&uri);
        }
        self.catalog.saved(row);
        let request_id = uuid::Uuid::new_v4().to_string();
        self.futures.insert(request_id.clone(), owner);
        self.futures.resolve(&request_id, Ok(reply));
        UntypedApiFuture {
            request_id,
            model_id: None,
            sample_sequence_ids: None,
        }
    }
}

impl EngineHandle {
    /// Writes the interpolation of `sources` as sampler checkpoint `name`; answers a
    /// future of its path. Runs to completion even if the caller goes away, holding
    /// `slot` (which bounds how many run at once) until it is done.
    pub async fn interpolate(
        &self,
        owner: String,
        sources: Vec<CheckpointUri>,
        coefficients: Vec<f64>,
        name: String,
        slot: impl Send + 'static,
    ) -> Result<UntypedApiFuture, EngineError> {
        let this = self.clone();
        self.detached(async move {
            let _slot = slot;
            let plan = this
                .begin_interpolate(owner.clone(), sources.clone(), coefficients.clone(), name)
                .await??;
            let meta = plan.meta.clone();
            let uri = plan.uri.clone();
            let row = match this.write_interpolation(owner.clone(), plan).await {
                Ok(row) => row,
                Err(e) => {
                    this.end_interpolate(uri).await?;
                    return Err(e);
                }
            };
            let path = CheckpointUri {
                run_id: meta.run_id,
                kind: CheckpointKind::Sampler,
                name: meta.name,
            }
            .to_string();
            let reply = Reply::Interpolated {
                path,
                source_paths: sources.iter().map(ToString::to_string).collect(),
                coefficients,
            };
            this.finish_interpolate(owner, row, reply).await
        })
        .await
    }

    /// Writes a planned interpolation's files, checks the sources again, and commits it
    /// to the index; a version written but not committed is discarded.
    async fn write_interpolation(
        &self,
        owner: String,
        plan: InterpolatePlan,
    ) -> Result<CheckpointRow, EngineError> {
        let written = plan.meta.clone();
        let sources = plan.sources.clone();
        let write = self
            .blocking(move |store| {
                let base = written.base_model.clone();
                Ok(store.checkpoints().write_version(&written, |dir| {
                    crate::store::interpolate::interpolate(&sources, dir, &base).map(|_| ())
                })?)
            })
            .await;
        let checked = self.check_interpolated(owner, plan.clone()).await?;
        // A source taken away meanwhile is the answer, even if reading it failed.
        let (version, bytes) = match write {
            Ok(written) => written,
            Err(e) => return Err(checked.err().unwrap_or(e)),
        };
        let uri = plan.uri.clone();
        let discarded = version.clone();
        self.blocking(move |store| {
            if let Err(e) = checked {
                if let Err(io) = store.checkpoints().discard(&uri, &discarded) {
                    tracing::warn!("discarding interpolation {uri}: {io}");
                }
                return Err(e);
            }
            Ok(store.commit_save(&plan.meta, &version, bytes, false)?)
        })
        .await
    }
}
