//! The worker's checkpoint adapters opened for sampling: reading a checkpoint per
//! request would cost a disk read and a parse for every sample on it, and a copy in
//! memory for each.
//!
//! Two things keep them few. Every live decode of one checkpoint directory shares one
//! adapter (weakly tracked here while any decode holds it), so the engine can count
//! each directory's adapter once. And the recently used ones stay in a cache bounded by
//! bytes as well as entries ([`ByteLru`]), because its bytes count in the server's
//! `--max-total-adapter-bytes` (the engine keeps [`CACHE_SHARE`] of it for the cache);
//! a count alone would let large adapters hold memory outside every limit. An adapter
//! larger than the whole budget is used without being kept.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use crate::model::Adapter;

/// The share of `--max-total-adapter-bytes` kept for the cache: one part in this many.
pub const CACHE_SHARE: u64 = 8;

/// Most entries a [`ByteLru`] keeps, whatever their size (lookups are linear).
const MAX_ENTRIES: usize = 16;

/// Values by directory within a byte budget, least recently used first. The engine
/// keeps one of its own beside the worker's, fed the same directories in the same
/// order, to know which reads the worker will skip.
pub struct ByteLru<V> {
    entries: Vec<(PathBuf, V, u64)>,
    budget: u64,
}

impl<V: Clone> ByteLru<V> {
    /// An empty cache holding at most `budget` bytes.
    pub fn with_budget(budget: u64) -> Self {
        Self {
            entries: Vec::new(),
            budget,
        }
    }

    /// The value kept for `dir`, if any; it becomes the most recently used.
    pub fn get(&mut self, dir: &Path) -> Option<V> {
        let pos = self.entries.iter().position(|(p, _, _)| p == dir)?;
        let entry = self.entries.remove(pos);
        let value = entry.1.clone();
        self.entries.push(entry);
        Some(value)
    }

    /// Whether `dir` is kept (without making it the most recently used).
    pub fn contains(&self, dir: &Path) -> bool {
        self.entries.iter().any(|(p, _, _)| p == dir)
    }

    /// Keeps `value` of `bytes` for `dir`, dropping the least recently used entries
    /// until it fits; one larger than the budget is not kept.
    pub fn insert(&mut self, dir: PathBuf, value: V, bytes: u64) {
        if bytes > self.budget {
            return;
        }
        self.entries.retain(|(p, _, _)| *p != dir);
        while self.entries.len() >= MAX_ENTRIES || self.bytes().saturating_add(bytes) > self.budget
        {
            self.entries.remove(0);
        }
        self.entries.push((dir, value, bytes));
    }

    /// Forgets `dir`.
    pub fn remove(&mut self, dir: &Path) {
        self.entries.retain(|(p, _, _)| p != dir);
    }

    /// Bytes kept.
    pub fn bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|(_, _, b)| *b)
            .fold(0, u64::saturating_add)
    }
}

/// Bytes an adapter's factors hold in f32, as the engine reckons adapters (its
/// `LoraWidths::adapter_bytes`): the engine's picture of the cache must size entries
/// exactly as the cache does.
pub fn adapter_bytes(adapter: &Adapter) -> u64 {
    (adapter.num_params() as u64).saturating_mul(4)
}

/// The checkpoint adapters the worker holds for sampling.
pub struct SamplerAdapters {
    cached: ByteLru<Arc<Adapter>>,
    /// Every adapter handed out, while anything holds it.
    live: HashMap<PathBuf, Weak<Adapter>>,
}

impl SamplerAdapters {
    /// None held yet; at most `budget` bytes cached.
    pub fn with_budget(budget: u64) -> Self {
        Self {
            cached: ByteLru::with_budget(budget),
            live: HashMap::new(),
        }
    }

    /// The adapter of `dir`: the one a decode holds or the cache keeps, else `read`'s.
    pub fn get_or_read<E>(
        &mut self,
        dir: &Path,
        read: impl FnOnce() -> Result<Adapter, E>,
    ) -> Result<Arc<Adapter>, E> {
        let held = self.live.get(dir).and_then(Weak::upgrade);
        let adapter = match held.or_else(|| self.cached.get(dir)) {
            Some(adapter) => adapter,
            None => {
                let adapter = Arc::new(read()?);
                self.live.retain(|_, a| a.strong_count() > 0);
                self.live
                    .insert(dir.to_path_buf(), Arc::downgrade(&adapter));
                adapter
            }
        };
        let bytes = adapter_bytes(&adapter);
        self.cached
            .insert(dir.to_path_buf(), adapter.clone(), bytes);
        Ok(adapter)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::model::{Arch, LoraSpec};

    fn adapter(rank: usize) -> Adapter {
        let cfg = crate::model::tiny::tiny_config(Arch::Llama);
        let spec = LoraSpec {
            rank,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
        };
        Adapter::new(&cfg, spec, 1, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_cache_keeps_its_byte_budget_dropping_the_least_recently_used() {
        let (small, large) = (adapter(2), adapter(8));
        let unit = adapter_bytes(&small);
        assert_eq!(adapter_bytes(&large), 4 * unit, "bytes scale with rank");
        assert_eq!(unit, small.num_params() as u64 * 4);
        let mut cache = ByteLru::with_budget(3 * unit);
        for i in 0..3 {
            cache.insert(format!("/c/{i}").into(), i, unit);
        }
        assert_eq!(
            cache.get(Path::new("/c/0")),
            Some(0),
            "0 is now the most recent"
        );
        cache.insert("/c/3".into(), 3, unit);
        assert_eq!(cache.get(Path::new("/c/1")), None, "1 was the least recent");
        assert_eq!(cache.get(Path::new("/c/0")), Some(0));
        cache.insert("/c/big".into(), 9, 4 * unit);
        assert_eq!(
            cache.get(Path::new("/c/big")),
            None,
            "larger than the budget"
        );
        assert_eq!(cache.bytes(), 3 * unit, "nothing dropped for one not kept");
    }

    #[test]
    fn the_cache_keeps_at_most_sixteen_entries() {
        let mut cache = ByteLru::with_budget(u64::MAX);
        for i in 0..40 {
            cache.insert(format!("/c/{i}").into(), i, 1);
            cache.insert(format!("/c/{i}").into(), i, 1);
        }
        assert_eq!(cache.bytes(), MAX_ENTRIES as u64);
        assert_eq!(cache.get(Path::new("/c/39")), Some(39));
        assert_eq!(cache.get(Path::new("/c/23")), None);
    }

    #[test]
    fn decodes_of_one_directory_share_its_adapter_even_when_it_is_not_cached() {
        // Nothing fits in the cache.
        let mut held = SamplerAdapters::with_budget(0);
        let mut reads = 0;
        let mut open = |held: &mut SamplerAdapters| {
            held.get_or_read(Path::new("/c/a"), || {
                reads += 1;
                Ok::<_, ()>(adapter(2))
            })
            .unwrap()
        };
        let first = open(&mut held);
        let second = open(&mut held);
        assert!(
            Arc::ptr_eq(&first, &second),
            "one copy while a decode holds it"
        );
        drop((first, second));
        let _third = open(&mut held);
        assert_eq!(reads, 2, "read again once no decode held it");
    }
}
