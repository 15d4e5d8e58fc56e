//! What the engine asks the worker to do, and what comes back. Plain data: no tokio, no
//! HTTP, no candle types cross this boundary.

use std::path::PathBuf;

use lathe_sdk::types::{AdamParams, CheckpointUri};

use super::Reply;
use crate::model::LoraSpec;
use crate::sample::{SampleJob, TokenProgress};
use crate::store::checkpoints::CheckpointMeta;
use crate::store::db::CheckpointRow;
use crate::train::reverse_kl::KlDatum;
use crate::train::DatumJob;

/// One operation on one training run.
#[derive(Debug, Clone)]
pub enum RunOp {
    /// A fresh adapter (A seeded, B zero) with fresh optimizer state.
    Create {
        /// Rank and targets.
        spec: LoraSpec,
        /// Seed of A.
        seed: u64,
    },
    /// `forward` (no gradient) or `forward_backward` (gradient accumulated).
    Forward {
        /// The datums (their `adapter` field is set by the worker).
        data: Vec<DatumJob>,
        /// Accumulate gradients.
        with_grad: bool,
        /// Which pass of its request this is (the engine cuts a large request into
        /// passes; a request's gradient counts only once its last pass has run).
        pass: Pass,
    },
    /// AdamW on the accumulated gradient, then zero it.
    OptimStep(AdamParams),
    /// Write a checkpoint: training state (adapter and optimizer) or sampler weights.
    Save {
        /// Its metadata (kind, name, owner ...).
        meta: CheckpointMeta,
        /// Replace an existing one of the same name.
        overwrite: bool,
    },
    /// Keep the current adapter in memory as a sampler (no copy of the base model, no
    /// disk round trip).
    Snapshot {
        /// The sampling session that will use it.
        sampler_id: String,
    },
    /// Replace the run's adapter (and optionally optimizer state) from a checkpoint;
    /// with `create`, the run is new and takes the checkpoint's geometry.
    Load {
        /// The checkpoint, echoed in the result.
        uri: CheckpointUri,
        /// The directory of its current version, resolved by the engine when the load
        /// is dispatched (access is checked then, not when it was queued).
        dir: PathBuf,
        /// Also restore the optimizer state.
        optimizer: bool,
        /// The run does not exist yet (create-via-load).
        create: bool,
    },
    /// Free the run's adapter, optimizer state and gradient.
    Unload,
    /// MinT's reverse-KL distillation step: the run's gradient gains that of
    /// `T^2 sum w KL(student || reference)` (see [`crate::train::reverse_kl`]).
    ReverseKl {
        /// The datums.
        data: Vec<KlDatum>,
        /// The reference checkpoint; `None` is the base model.
        reference: Option<CheckpointUri>,
        /// The directory of its current version, resolved when the step is dispatched.
        dir: PathBuf,
        /// Softmax temperature.
        temperature: f64,
    },
}

/// Which part of its request a forward pass is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// The request's first pass: its gradient starts from zero.
    pub first: bool,
    /// The request's last pass: its gradient joins the run's accumulated gradient.
    pub last: bool,
}

impl Pass {
    /// A request run in one pass.
    pub const WHOLE: Pass = Pass {
        first: true,
        last: true,
    };
}

impl RunOp {
    /// Input tokens this op feeds through the model (for batch budgeting).
    pub fn tokens(&self) -> usize {
        match self {
            RunOp::Forward { data, .. } => data.iter().map(|d| d.tokens.len()).sum(),
            RunOp::ReverseKl { data, .. } => data.iter().map(KlDatum::tokens).sum(),
            _ => 0,
        }
    }
}

/// An operation with the future it completes.
#[derive(Debug, Clone)]
pub struct RunWork {
    /// The future to complete.
    pub request_id: String,
    /// The training run.
    pub run_id: String,
    /// What to do.
    pub op: RunOp,
}

/// Which adapter a sampling request uses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SamplerSource {
    /// The base model alone.
    Base,
    /// An in-memory snapshot taken by [`RunOp::Snapshot`].
    Snapshot(String),
    /// A checkpoint directory (loaded once, then cached).
    Checkpoint(PathBuf),
}

/// One sampling request.
#[derive(Debug, Clone)]
pub struct SampleWork {
    /// The future to complete.
    pub request_id: String,
    /// The adapter.
    pub source: SamplerSource,
    /// Prompt and sampling settings (`adapter` is set by the worker).
    pub job: SampleJob,
    /// Where the decode publishes tokens as they come, for a streaming client.
    pub progress: Option<TokenProgress>,
}

/// What the worker runs in one go: the runs' operations (all forward passes of the
/// batch fused into one multi-adapter pass), then new sampling requests join the running
/// decode (their prompts prefilled together), then, if asked, one decode step of every
/// live sequence.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    /// At most one operation per run, so per-run order is the engine's business.
    pub runs: Vec<RunWork>,
    /// Sampling requests to start decoding.
    pub samples: Vec<SampleWork>,
    /// Advance every live sequence by one token (a request whose sequences have all
    /// ended is answered).
    pub decode_step: bool,
    /// Sampling requests whose sampled tokens get one rescoring pass each (the rows the
    /// last report gave).
    pub rescore: Vec<String>,
    /// Sampler snapshots to free (their sampling sessions expired).
    pub drop_snapshots: Vec<String>,
    /// Sampling requests whose clients gave up on them (`cancel_future`): their
    /// sequences are dropped and they fail as cancelled.
    pub cancel: Vec<String>,
}

impl Batch {
    /// The futures the batch completes, runs' operations first.
    pub fn request_ids(&self) -> Vec<String> {
        self.runs
            .iter()
            .map(|w| w.request_id.clone())
            .chain(self.samples.iter().map(|s| s.request_id.clone()))
            .collect()
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
            && self.samples.is_empty()
            && self.drop_snapshots.is_empty()
            && self.cancel.is_empty()
            && self.rescore.is_empty()
            && !self.decode_step
    }
}

/// What the worker reports after a [`Batch`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchReport {
    /// The requests it finished (a sampling request finishes in the batch whose decode
    /// step ended its last sequence, not in the one that admitted it).
    pub outcomes: Vec<Outcome>,
    /// The sampling requests still decoding, with their sequences not yet ended (0 for
    /// one whose sequences all ended and whose tokens are being rescored).
    pub decoding: Vec<(String, usize)>,
    /// The sampling requests whose sequences all ended and whose tokens wait to be
    /// rescored, with the rows of each one's next pass.
    pub rescoring: Vec<(String, usize)>,
}

impl From<Vec<Outcome>> for BatchReport {
    /// A report of finished requests with nothing left decoding.
    fn from(outcomes: Vec<Outcome>) -> Self {
        Self {
            outcomes,
            decoding: Vec::new(),
            rescoring: Vec::new(),
        }
    }
}

pub use crate::panics::panic_message;

/// Who is to blame for a failure; decides the `category` the client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// Bad input: the same request will fail again.
    User,
    /// A fault on the server.
    Server,
}

/// A failed operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// `user` or `server`.
    pub blame: Blame,
    /// What went wrong.
    pub message: String,
}

impl Failure {
    /// Bad input.
    pub fn user(message: impl Into<String>) -> Self {
        Self {
            blame: Blame::User,
            message: message.into(),
        }
    }

    /// A server fault.
    pub fn server(message: impl Into<String>) -> Self {
        Self {
            blame: Blame::Server,
            message: message.into(),
        }
    }

    /// The wire category.
    pub fn category(&self) -> &'static str {
        match self.blame {
            Blame::User => "user",
            Blame::Server => "server",
        }
    }
}

/// A successful operation's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Done {
    /// The result the client retrieves.
    pub body: Reply,
    /// A saved checkpoint's index row, committed before the result is sent.
    pub saved: Option<CheckpointRow>,
}

/// The result of one request of a [`Batch`].
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The future it completes.
    pub request_id: String,
    /// Result or failure.
    pub result: Result<Done, Failure>,
}
