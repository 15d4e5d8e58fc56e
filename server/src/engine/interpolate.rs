//! MinT's `checkpoints/interpolate`: a new sampler checkpoint whose adapter is the
//! weighted sum of other checkpoints' LoRA deltas (see [`crate::store::interpolate`]).
//!
//! The engine checks the request and resolves every source (the key must be able to
//! read each; the output goes under the first source's run, which must be the key's),
//! the files are combined and written off the actor, and the index commits the new
//! checkpoint before the future resolves. No model work is involved, so the worker is
//! not.

use std::path::PathBuf;

use lathe_sdk::types::{CheckpointKind, CheckpointUri, UntypedApiFuture};

use super::actor::EngineHandle;
use super::state::now_unix;
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
            resolved.push((row, dir, *c));
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
        Ok(InterpolatePlan {
            sources: resolved.into_iter().map(|(_, dir, c)| (dir, c)).collect(),
            meta,
        })
    }

    /// Records the written checkpoint and answers a future already resolved with it.
    pub fn finish_interpolate(
        &mut self,
        owner: &str,
        row: CheckpointRow,
        reply: Reply,
    ) -> UntypedApiFuture {
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
            let row = this
                .blocking(move |store| {
                    let base = plan.meta.base_model.clone();
                    let (version, bytes) =
                        store.checkpoints().write_version(&plan.meta, |dir| {
                            crate::store::interpolate::interpolate(&plan.sources, dir, &base)
                                .map(|_| ())
                        })?;
                    Ok(store.commit_save(&plan.meta, &version, bytes, false)?)
                })
                .await?;
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
}
