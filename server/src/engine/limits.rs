//! Per-key limits: what one API key may hold of the shared server at once. Occupancy
//! limits (live runs, queued operations, sampling tokens in flight, checkpoints and bytes
//! on disk) answer 429 with `Retry-After`, since they clear as the key's own work drains
//! or it deletes something; limits on one request's size (tokens, stop strings) answer
//! 400, since sending the same request again cannot succeed and the SDKs retry 429s for
//! minutes.

use super::sampling::SAMPLING_ADAPTER_COPIES;
use super::{Engine, EngineError};

/// What each API key may use. Every field is a `lathe serve` flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLimits {
    /// Training runs loaded at once.
    pub live_runs: usize,
    /// Operations and sampling requests queued and not yet finished, over all its runs.
    pub queued_operations: usize,
    /// Input tokens of one `forward` / `forward_backward` request.
    pub tokens_per_request: usize,
    /// Sampling tokens in flight: over its queued and running sampling requests, the sum
    /// of `num_samples x (prompt + max_tokens)`.
    pub sampling_tokens: usize,
    /// Stop strings of one sampling request.
    pub stop_strings: usize,
    /// Bytes of one stop string.
    pub stop_string_bytes: usize,
    /// Checkpoints stored.
    pub checkpoints: usize,
    /// Bytes of checkpoints stored.
    pub checkpoint_bytes: u64,
    /// Live sessions.
    pub sessions: usize,
    /// Open sampling sessions (each may hold an adapter snapshot in memory).
    pub samplers: usize,
    /// Bytes of adapter state its loaded runs hold in memory (see
    /// [`Engine::adapter_memory`]).
    pub adapter_bytes: u64,
}

impl Default for KeyLimits {
    fn default() -> Self {
        Self {
            live_runs: 16,
            queued_operations: 256,
            tokens_per_request: 262_144,
            sampling_tokens: 262_144,
            stop_strings: 16,
            stop_string_bytes: 256,
            checkpoints: 1000,
            checkpoint_bytes: 20 << 30,
            sessions: 64,
            samplers: 256,
            adapter_bytes: 8 << 30,
        }
    }
}

/// A key is at one of its occupancy limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitExceeded {
    /// The limit's name, as its `lathe serve` flag without dashes (`max_live_runs` ...).
    pub limit: &'static str,
    /// What happened and what to do.
    pub message: String,
    /// Seconds after which trying again may succeed.
    pub retry_after_s: u64,
}

/// Copies of its adapter that a loaded run holds: the weights, the gradient and AdamW's
/// two moments.
pub(super) const RUN_STATE_COPIES: u64 = 4;

/// A key has as many completion logs as it may (`retrieve_futures`).
pub(super) fn too_many_logs(message: String) -> EngineError {
    exceeded("max_completion_logs", 60, message)
}

fn exceeded(limit: &'static str, retry_after_s: u64, message: String) -> EngineError {
    EngineError::Limit(LimitExceeded {
        limit,
        message,
        retry_after_s,
    })
}

impl Engine {
    /// Refuses a new session when `owner` has `sessions` live.
    pub(super) fn check_sessions(&self, owner: &str) -> Result<(), EngineError> {
        let live = self.sessions.values().filter(|s| s.owner == owner).count();
        let max = self.config.limits.sessions;
        if live >= max {
            return Err(exceeded(
                "max_sessions_per_key",
                30,
                format!(
                    "this key has {live} live sessions, its limit (--max-sessions-per-key {max}); \
                     close one (ServiceClient.close) or let it expire first"
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a new sampling session when `owner` has `samplers` open.
    pub(super) fn check_samplers(&self, owner: &str) -> Result<(), EngineError> {
        let open = self.samplers.values().filter(|s| s.owner == owner).count();
        let max = self.config.limits.samplers;
        if open >= max {
            return Err(exceeded(
                "max_samplers",
                30,
                format!(
                    "this key has {open} sampling sessions open, its limit (--max-samplers \
                     {max}); they close with their session"
                ),
            ));
        }
        Ok(())
    }

    /// Bytes of adapter state that `owner` (every key with `None`) holds in the worker:
    /// per loaded run its adapter, gradient and two AdamW moments (four times the
    /// adapter's f32 size) and a copy per sampler snapshot taken from it; and the
    /// checkpoint adapters its sampling requests hold while queued or decoding
    /// ([`Engine::sampling_adapter_memory`]).
    pub(super) fn adapter_memory(&self, owner: Option<&str>) -> u64 {
        self.run_adapter_memory(owner)
            .saturating_add(self.sampling_adapter_memory(owner))
    }

    /// The checkpoint adapters that `owner`'s (every key's) sampling requests hold,
    /// queued or decoding: each directory once, as the worker shares one adapter among
    /// the decodes of a directory.
    fn sampling_adapter_memory(&self, owner: Option<&str>) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.inflight
            .values()
            .filter(|f| owner.is_none_or(|o| f.owner == o))
            .filter_map(|f| f.adapter.as_ref())
            .filter(|(dir, _)| seen.insert(dir))
            .map(|&(_, bytes)| bytes.saturating_mul(SAMPLING_ADAPTER_COPIES))
            .fold(0u64, u64::saturating_add)
    }

    /// Whether sampling requests (only `owner`'s with `Some`) hold the adapter of
    /// `dir` already.
    pub(super) fn holds_sampling_adapter(
        &self,
        owner: Option<&str>,
        dir: &std::path::Path,
    ) -> bool {
        self.inflight.values().any(|f| {
            owner.is_none_or(|o| f.owner == o) && f.adapter.as_ref().is_some_and(|(d, _)| d == dir)
        })
    }

    fn run_adapter_memory(&self, owner: Option<&str>) -> u64 {
        self.runs
            .values()
            .filter(|r| owner.is_none_or(|o| r.owner == o))
            .map(|r| {
                let copies = RUN_STATE_COPIES + r.snapshots.len() as u64;
                self.model
                    .lora_widths
                    .adapter_bytes(&r.spec)
                    .saturating_mul(copies)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Refuses `extra` more bytes of adapter state for `owner` past its
    /// `--max-adapter-bytes`, or past the server's `--max-total-adapter-bytes`.
    pub(super) fn check_adapter_memory(&self, owner: &str, extra: u64) -> Result<(), EngineError> {
        self.check_adapter_memory_of(owner, extra, extra)
    }

    /// Refuses `mine` more bytes of adapter state for `owner` past its
    /// `--max-adapter-bytes`, or `all` more for the server (less where another key
    /// holds the same adapter already) past its `--max-total-adapter-bytes`.
    pub(super) fn check_adapter_memory_of(
        &self,
        owner: &str,
        mine: u64,
        all: u64,
    ) -> Result<(), EngineError> {
        let held = self.adapter_memory(Some(owner));
        let max = self.config.limits.adapter_bytes;
        if held.saturating_add(mine) > max {
            return Err(exceeded(
                "max_adapter_bytes",
                30,
                format!(
                    "this key's loaded runs, snapshots and sampling requests hold {held} \
                     bytes of adapter state and this needs {mine} more, past its limit \
                     (--max-adapter-bytes {max}); unload a run, wait for its samples, or \
                     use a smaller rank"
                ),
            ));
        }
        let held = self.adapter_memory(None);
        let max = self.config.max_adapter_bytes;
        let cache = self.config.sampler_cache_bytes();
        if held.saturating_add(cache).saturating_add(all) > max {
            return Err(exceeded(
                "max_total_adapter_bytes",
                30,
                format!(
                    "the server's loaded runs, snapshots and sampling requests hold {held} \
                     bytes of adapter state and this needs {all} more, past its limit \
                     (--max-total-adapter-bytes {max}, of which {cache} are kept for \
                     checkpoint adapters opened for sampling); try again later"
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a new run when `owner` has `live_runs` loaded.
    pub(super) fn check_live_runs(&self, owner: &str) -> Result<(), EngineError> {
        let live = self.runs.values().filter(|r| r.owner == owner).count();
        let max = self.config.limits.live_runs;
        if live >= max {
            return Err(exceeded(
                "max_live_runs",
                30,
                format!(
                    "this key has {live} training runs loaded, its limit (--max-live-runs {max}); \
                     unload one (or let its session expire) first"
                ),
            ));
        }
        Ok(())
    }

    /// Refuses one more queued operation when `owner` has `queued_operations` waiting.
    pub(super) fn check_queue(&self, owner: &str) -> Result<(), EngineError> {
        let queued = self
            .runs
            .values()
            .filter(|r| r.owner == owner)
            .map(|r| r.queue.len())
            .sum::<usize>()
            + self.samples.iter().filter(|q| q.owner == owner).count();
        let max = self.config.limits.queued_operations;
        if queued >= max {
            return Err(exceeded(
                "max_queued_operations",
                1,
                format!(
                    "this key has {queued} operations queued, its limit (--max-queued-operations \
                     {max}); wait for some to finish"
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a forward pass over more than `tokens_per_request` tokens (400).
    pub(super) fn check_request_tokens(&self, tokens: usize) -> Result<(), EngineError> {
        let max = self.config.limits.tokens_per_request;
        if tokens > max {
            return Err(EngineError::BadRequest(format!(
                "this request has {tokens} input tokens; the limit is {max} per request \
                 (--max-tokens-per-request): split it into several requests"
            )));
        }
        Ok(())
    }

    /// Refuses a sampling request that would take `owner` past `sampling_tokens` in
    /// flight.
    pub(super) fn check_sampling_tokens(
        &self,
        owner: &str,
        tokens: usize,
    ) -> Result<(), EngineError> {
        let max = self.config.limits.sampling_tokens;
        if tokens > max {
            return Err(EngineError::BadRequest(format!(
                "this sampling request needs {tokens} tokens (num_samples x (prompt + \
                 max_tokens)); the limit is {max} (--max-sampling-tokens)"
            )));
        }
        // Every sampling request, queued or running, is in `inflight` until answered.
        let in_flight = self
            .inflight
            .values()
            .filter(|i| i.owner == owner)
            .map(|i| i.sample_tokens)
            .sum::<usize>();
        if in_flight.saturating_add(tokens) > max {
            return Err(exceeded(
                "max_sampling_tokens",
                1,
                format!(
                    "this key has {in_flight} sampling tokens in flight and asks for {tokens} \
                     more; its limit is {max} (--max-sampling-tokens); wait for some to finish"
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a save of about `new_bytes` when `owner` would store more than
    /// `checkpoints` (for a new name) or `checkpoint_bytes`, counting its saves queued or
    /// being written as stored (those that add a name as names; each at its adapter's f32
    /// bytes, three times that with the optimizer state of a training checkpoint).
    /// Checked only against what is written, the quota would admit every save sent
    /// before the first one is. An overwrite (not `new_name`) adds no bytes once written.
    pub(super) fn check_checkpoint_quota(
        &self,
        owner: &str,
        new_name: bool,
        new_bytes: u64,
    ) -> Result<(), EngineError> {
        let (stored, stored_bytes) = self.catalog.usage_of(owner);
        let (queued, queued_bytes) = self.queued_saves(owner);
        let (count, bytes) = (stored + queued, stored_bytes.saturating_add(queued_bytes));
        let limits = &self.config.limits;
        if new_name && count >= limits.checkpoints {
            return Err(exceeded(
                "max_checkpoints",
                60,
                format!(
                    "this key stores {stored} checkpoints and has {queued} saves queued, its \
                     limit (--max-checkpoints {}); delete some first",
                    limits.checkpoints
                ),
            ));
        }
        let new_bytes = if new_name { new_bytes } else { 0 };
        if bytes.saturating_add(new_bytes) > limits.checkpoint_bytes {
            return Err(exceeded(
                "max_checkpoint_bytes",
                60,
                format!(
                    "this key stores {stored_bytes} bytes of checkpoints and has saves of \
                     about {queued_bytes} more queued; this one of about {new_bytes} would \
                     pass its limit (--max-checkpoint-bytes {}); delete some first",
                    limits.checkpoint_bytes
                ),
            ));
        }
        Ok(())
    }

    /// `owner`'s saves and interpolations queued or being written: how many add a
    /// name, and their estimated bytes.
    fn queued_saves(&self, owner: &str) -> (usize, u64) {
        let saves = self
            .inflight
            .values()
            .filter(|f| f.owner == owner)
            .filter_map(|f| f.save);
        let interpolations = self
            .interpolating
            .values()
            .filter(|(o, _)| o == owner)
            .map(|&(_, bytes)| (true, bytes));
        saves
            .chain(interpolations)
            .fold((0, 0u64), |(n, bytes), (new, b)| {
                (n + usize::from(new), bytes.saturating_add(b))
            })
    }
}
