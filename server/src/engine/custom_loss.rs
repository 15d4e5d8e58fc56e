//! Server-side custom losses: created in a session, used by that session's training
//! runs, dropped with the session.

use std::sync::Arc;

use lathe_sdk::types::UntypedApiFuture;

use super::{Engine, EngineError};
use crate::train::custom::CustomLoss;
use crate::worker::Reply;

/// Most custom losses one session may create.
pub const MAX_CUSTOM_LOSSES_PER_SESSION: usize = 64;

impl Engine {
    /// Registers a compiled loss as `custom_loss_seq_id` `seq` of the session and answers
    /// a future already resolved with its `loss_id`. The same number sent again (a
    /// client's retry) with the same loss answers the same id.
    pub fn create_custom_loss(
        &mut self,
        owner: &str,
        session_id: &str,
        seq: u64,
        loss: Arc<CustomLoss>,
    ) -> Result<UntypedApiFuture, EngineError> {
        self.check_open()?;
        let session = self.session_mut(owner, session_id)?;
        let loss_id = format!("{session_id}:loss:{seq}");
        match session.custom_losses.iter().find(|(id, _)| *id == loss_id) {
            Some((_, existing)) if **existing != *loss => {
                return Err(EngineError::BadRequest(format!(
                    "custom_loss_seq_id {seq} of this session already names another loss \
                     ({:?})",
                    existing.name()
                )))
            }
            Some(_) => {}
            None if session.custom_losses.len() >= MAX_CUSTOM_LOSSES_PER_SESSION => {
                return Err(EngineError::BadRequest(format!(
                    "this session has created {MAX_CUSTOM_LOSSES_PER_SESSION} custom losses, \
                     the limit; reuse their handles"
                )))
            }
            None => session.custom_losses.push((loss_id.clone(), loss)),
        }
        // A repeat answers with the first creation's future while the table keeps it, so
        // repeating a creation holds at most one future per loss.
        let first = session.custom_loss_futures.get(&loss_id).cloned();
        if let Some(request_id) = first.filter(|id| self.futures.is_pending(id, owner).is_some()) {
            return Ok(UntypedApiFuture {
                request_id,
                model_id: None,
                sample_sequence_ids: None,
            });
        }
        let request_id = uuid::Uuid::new_v4().to_string();
        self.session_mut(owner, session_id)?
            .custom_loss_futures
            .insert(loss_id.clone(), request_id.clone());
        self.futures.insert(request_id.clone(), owner);
        self.futures
            .resolve(&request_id, Ok(Reply::CustomLossCreated { loss_id }));
        Ok(UntypedApiFuture {
            request_id,
            model_id: None,
            sample_sequence_ids: None,
        })
    }

    /// The custom loss `loss_id` for a request on `run_id`: it must have been created
    /// in the run's session.
    pub fn custom_loss(
        &mut self,
        owner: &str,
        run_id: &str,
        loss_id: &str,
    ) -> Result<Arc<CustomLoss>, EngineError> {
        let session_id = self.loaded_run(owner, run_id)?.session_id.clone();
        self.sessions
            .get(&session_id)
            .and_then(|s| s.custom_losses.iter().find(|(id, _)| id == loss_id))
            .map(|(_, loss)| loss.clone())
            .ok_or_else(|| {
                EngineError::BadRequest(format!(
                    "unknown custom loss {loss_id:?} for training run {run_id}: a loss is used \
                     by the training clients of the session that created it"
                ))
            })
    }
}
