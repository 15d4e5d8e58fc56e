//! The engine's commands: one typed variant per operation the rest of the server may ask
//! of the engine, each with its reply channel, and the [`EngineHandle`] method that sends
//! it (text-generation-inference's router talks to its queue the same way). The actor
//! applies commands one at a time; nothing outside this list can run on the engine.

use std::path::PathBuf;
use std::sync::Arc;

use lathe_sdk::types::{
    CheckpointUri, GetInfoResponse, GetSamplerResponse, UntypedApiFuture, WeightsInfoResponse,
};
use tokio::sync::oneshot;

use super::actor::EngineHandle;
use super::futures::Poll;
use super::{
    CompletionPoll, Engine, EngineError, InterpolatePlan, NewRun, SamplerRef, SaveRequest, Ttl,
};
use crate::sample::{SampleJob, TokenProgress};
use crate::store::db::CheckpointRow;
use crate::train::custom::CustomLoss;
use crate::train::reverse_kl::KlDatum;
use crate::worker::{BatchReport, Reply, RunOp};

/// Declares the commands: for each, the [`Command`] variant (its arguments and a reply
/// sender), the arm of [`Command::apply`] that calls the engine, and the handle method.
macro_rules! commands {
    ($(
        $(#[$doc:meta])*
        $vis:vis fn $method:ident => $variant:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty
            = |$e:ident| $body:expr;
    )*) => {
        /// A request to the engine actor.
        pub enum Command {
            $(
                $(#[$doc])*
                $variant {
                    $(
                        #[allow(missing_docs)]
                        $arg: $ty,
                    )*
                    /// Where the answer goes.
                    reply: oneshot::Sender<$ret>,
                },
            )*
            /// The worker finished a batch.
            Complete(BatchReport),
            /// Expired checkpoints were deleted off the actor (URI, version, whether the
            /// delete succeeded).
            ExpiredDeleted(Vec<(CheckpointUri, String, Option<crate::store::ExpiredDelete>)>),
        }

        impl Command {
            /// Runs the command on `engine` and sends its answer (a caller that went
            /// away is not an error).
            pub(super) fn apply(self, engine: &mut Engine) {
                match self {
                    $(
                        Command::$variant { $($arg,)* reply } => {
                            let $e = &mut *engine;
                            let _ = reply.send($body);
                        }
                    )*
                    Command::Complete(report) => engine.complete(report),
                    Command::ExpiredDeleted(done) => {
                        for (uri, version, outcome) in done {
                            engine.finish_expired(&uri, &version, outcome);
                        }
                    }
                }
            }
        }

        impl EngineHandle {
            $(
                $(#[$doc])*
                $vis async fn $method(&self, $($arg: $ty),*) -> Result<$ret, EngineError> {
                    self.request(|reply| Command::$variant { $($arg,)* reply }).await
                }
            )*
        }
    };
}

commands! {
    /// Opens a session for `owner`.
    pub fn create_session => CreateSession(owner: String) -> Result<String, EngineError>
        = |e| e.create_session(&owner);
    /// Keeps a session alive.
    pub fn heartbeat => Heartbeat(owner: String, session_id: String) -> Result<(), EngineError>
        = |e| e.heartbeat(&owner, &session_id);
    /// Cancels a sampling request its client gave up on.
    pub fn cancel_future => CancelFuture(owner: String, request_id: String)
        -> Result<(), EngineError>
        = |e| e.cancel_future(&owner, &request_id);
    /// Ends a session at its client's request.
    pub fn finish_session => FinishSession(owner: String, session_id: String, status: String)
        -> Result<(), EngineError>
        = |e| e.finish_session(&owner, &session_id, &status);
    /// The owner's live sessions.
    pub fn list_sessions => ListSessions(owner: String) -> Vec<String>
        = |e| e.list_sessions(&owner);
    /// A session's training runs and samplers.
    pub fn get_session => GetSession(owner: String, session_id: String)
        -> Result<(Vec<String>, Vec<String>), EngineError>
        = |e| e.get_session(&owner, &session_id);
    /// A run's `seq_id` that will never arrive (its submission was refused for good).
    pub fn skip_seq => SkipSeq(owner: String, run_id: String, seq: u64) -> ()
        = |e| e.skip_seq(&owner, &run_id, seq);
    /// Creates a training run.
    pub fn create_model => CreateModel(owner: String, new: NewRun)
        -> Result<UntypedApiFuture, EngineError>
        = |e| e.create_model(&owner, new);
    /// Creates a training run from a checkpoint.
    pub fn create_from_checkpoint => CreateFromCheckpoint(
        owner: String,
        session_id: String,
        model_seq_id: u64,
        uri: CheckpointUri,
        optimizer: bool,
    ) -> Result<UntypedApiFuture, EngineError>
        = |e| e.create_from_checkpoint(&owner, &session_id, model_seq_id, &uri, optimizer);
    /// Registers a custom loss in a session; answers a resolved future of its id.
    pub fn create_custom_loss => CreateCustomLoss(
        owner: String,
        session_id: String,
        seq: u64,
        loss: Arc<CustomLoss>,
    ) -> Result<UntypedApiFuture, EngineError>
        = |e| e.create_custom_loss(&owner, &session_id, seq, loss);
    /// The custom loss a request on a run names.
    pub fn custom_loss => CustomLossOf(owner: String, run_id: String, loss_id: String)
        -> Result<Arc<CustomLoss>, EngineError>
        = |e| e.custom_loss(&owner, &run_id, &loss_id);
    /// A run's description.
    pub fn get_info => GetInfo(owner: String, run_id: String)
        -> Result<GetInfoResponse, EngineError>
        = |e| e.get_info(&owner, &run_id);
    /// Queues an operation on a run; returns its request id.
    pub fn submit => Submit(owner: String, run_id: String, seq_id: Option<u64>, op: RunOp)
        -> Result<String, EngineError>
        = |e| e.submit(&owner, &run_id, seq_id, op);
    /// Queues a checkpoint save; returns its request id.
    pub fn save => Save(owner: String, run_id: String, seq_id: Option<u64>, save: SaveRequest)
        -> Result<String, EngineError>
        = |e| e.save(&owner, &run_id, seq_id, save);
    /// Queues an in-memory sampler snapshot; returns its request id.
    pub fn snapshot_for_sampler => SnapshotForSampler(
        owner: String,
        run_id: String,
        seq_id: Option<u64>,
        sampling_session_seq_id: Option<u64>,
    ) -> Result<String, EngineError>
        = |e| e.snapshot_for_sampler(&owner, &run_id, seq_id, sampling_session_seq_id);
    /// Queues a load of a checkpoint into a run; returns its request id.
    pub fn load => Load(
        owner: String,
        run_id: String,
        seq_id: Option<u64>,
        uri: CheckpointUri,
        optimizer: bool,
    ) -> Result<String, EngineError>
        = |e| e.load(&owner, &run_id, seq_id, &uri, optimizer);
    /// A checkpoint's LoRA settings.
    pub fn weights_info => WeightsInfo(owner: String, uri: CheckpointUri)
        -> Result<WeightsInfoResponse, EngineError>
        = |e| e.weights_info(&owner, &uri);
    /// Opens a sampling session on the base model or a checkpoint.
    pub fn create_sampling_session => CreateSamplingSession(
        owner: String,
        session_id: String,
        seq: u64,
        model_path: Option<CheckpointUri>,
    ) -> Result<String, EngineError>
        = |e| e.create_sampling_session(&owner, &session_id, seq, model_path.as_ref());
    /// A sampling session's description.
    pub fn get_sampler => GetSampler(owner: String, sampler_id: String)
        -> Result<GetSamplerResponse, EngineError>
        = |e| e.get_sampler(&owner, &sampler_id);
    /// Queues a sampling request.
    pub fn sample => Sample(owner: String, sampler: SamplerRef, job: SampleJob)
        -> Result<UntypedApiFuture, EngineError>
        = |e| e.sample(&owner, sampler, job);
    /// Queues a sampling request that publishes its tokens as they come.
    pub fn sample_streamed => SampleStreamed(
        owner: String,
        sampler: SamplerRef,
        job: SampleJob,
        progress: Option<TokenProgress>,
        clone: Option<u64>,
    ) -> Result<UntypedApiFuture, EngineError>
        = |e| e.sample_streamed(&owner, sampler, job, progress, clone);
    /// `retrieve_futures`: a sampling session's completions after a cursor.
    pub fn poll_completions => PollCompletions(
        owner: String,
        sampler_id: String,
        clone: u64,
        prev_cursor: u64,
        wait: bool,
    ) -> Result<CompletionPoll, EngineError>
        = |e| e.poll_completions(&owner, &sampler_id, clone, prev_cursor, wait);
    /// `join_sampling_session`: a new client id within a sampling session.
    pub fn join_sampling_session => JoinSamplingSession(owner: String, sampler_id: String)
        -> Result<u64, EngineError>
        = |e| e.join_sampling_session(&owner, &sampler_id);
    /// The directory of the current version of a checkpoint `owner` may read.
    pub fn checkpoint_dir => CheckpointDir(owner: String, uri: CheckpointUri)
        -> Result<PathBuf, EngineError>
        = |e| e.checkpoint_dir(&owner, &uri);
    /// A future's state, for its owner.
    pub(super) fn poll_future => PollFuture(owner: String, request_id: String, mark: bool)
        -> Option<Poll>
        = |e| e.futures.poll(&request_id, &owner, mark);
    /// A finished future's answer was handed to its client.
    pub fn mark_retrieved => MarkRetrieved(owner: String, request_id: String) -> ()
        = |e| e.futures.mark_retrieved(&request_id, &owner);
    /// Queues MinT's reverse-KL step on a run.
    pub fn reverse_kl => ReverseKl(
        owner: String,
        run_id: String,
        seq_id: Option<u64>,
        reference: Option<CheckpointUri>,
        data: Vec<KlDatum>,
        temperature: f64,
    ) -> Result<String, EngineError>
        = |e| e.reverse_kl(&owner, &run_id, seq_id, reference, data, temperature);
    /// Checks an interpolation and resolves its sources.
    pub(super) fn begin_interpolate => BeginInterpolate(
        owner: String,
        sources: Vec<CheckpointUri>,
        coefficients: Vec<f64>,
        name: String,
    ) -> Result<InterpolatePlan, EngineError>
        = |e| e.begin_interpolate(&owner, &sources, &coefficients, name);
    /// Checks the key's access to an interpolation's sources again, once read.
    pub(super) fn check_interpolated => CheckInterpolated(owner: String, plan: InterpolatePlan)
        -> Result<(), EngineError>
        = |e| e.check_interpolated(&owner, &plan);
    /// Frees an abandoned interpolation's name and quota share.
    pub(super) fn end_interpolate => EndInterpolate(uri: CheckpointUri) -> ()
        = |e| e.end_interpolate(&uri);
    /// Records a written interpolation; answers its (resolved) future.
    pub(super) fn finish_interpolate => FinishInterpolate(
        owner: String,
        row: CheckpointRow,
        result: Reply,
    ) -> UntypedApiFuture
        = |e| e.finish_interpolate(&owner, row, result);
    /// Hides a checkpoint before its delete; returns the version to delete.
    pub(super) fn begin_delete => BeginDelete(owner: String, uri: CheckpointUri)
        -> Result<String, EngineError>
        = |e| e.begin_delete(&owner, &uri);
    /// A delete's end: forgotten if done, visible again if not.
    pub(super) fn finish_delete => FinishDelete(uri: CheckpointUri, version: String, deleted: bool)
        -> ()
        = |e| e.finish_delete(&uri, &version, deleted);
    /// Checks and applies a publish (revoking first when unpublishing).
    pub(super) fn begin_set_public => BeginSetPublic(owner: String, uri: CheckpointUri, public: bool)
        -> Result<(bool, String), EngineError>
        = |e| e.begin_set_public(&owner, &uri, public);
    /// A publish's end: kept if written, undone if not.
    pub(super) fn finish_set_public => FinishSetPublic(
        uri: CheckpointUri,
        version: String,
        public: bool,
        was: bool,
        written: bool,
    ) -> ()
        = |e| e.finish_set_public(&uri, &version, public, was, written);
    /// Checks a TTL change; returns the expiry and the version it applies to.
    pub(super) fn begin_set_ttl => BeginSetTtl(owner: String, uri: CheckpointUri, ttl: Option<Ttl>)
        -> Result<(Option<i64>, String), EngineError>
        = |e| e.begin_set_ttl(&owner, &uri, ttl);
    /// A TTL change written to the index.
    pub(super) fn finish_set_ttl => FinishSetTtl(uri: CheckpointUri, version: String, at: Option<i64>)
        -> ()
        = |e| e.finish_set_ttl(&uri, &version, at);
    /// Whether the engine and its worker can serve.
    pub(super) fn engine_health => Health() -> Result<(), String>
        = |e| e.health();
    /// Stops taking work and fails what is queued.
    pub(super) fn begin_shutdown => BeginShutdown() -> ()
        = |e| e.begin_shutdown();
    /// Whether nothing runs in the worker.
    pub(super) fn is_idle => IsIdle() -> bool
        = |e| e.is_idle();
}
