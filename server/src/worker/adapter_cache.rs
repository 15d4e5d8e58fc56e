//! The worker's cache of checkpoint adapters opened for sampling: reading a checkpoint
//! per request would cost a disk read and a parse for every sample on it.
//!
//! The cache is bounded by bytes as well as entries, because its bytes count in the
//! server's `--max-total-adapter-bytes` (the engine keeps [`CACHE_SHARE`] of it for
//! the cache): sixteen rank-256 adapters of a large model would otherwise hold
//! gigabytes outside every limit. An adapter larger than the whole budget is used
//! without being kept.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::model::Adapter;

/// The share of `--max-total-adapter-bytes` kept for this cache: one part in this many.
pub const CACHE_SHARE: u64 = 8;

/// Most adapters kept, whatever their size (lookups are linear).
const MAX_ENTRIES: usize = 16;

/// Checkpoint adapters by directory, least recently used first.
pub struct AdapterCache {
    entries: Vec<(PathBuf, Arc<Adapter>, u64)>,
    budget: u64,
}

/// Bytes an adapter's factors hold.
pub fn adapter_bytes(adapter: &Adapter) -> u64 {
    adapter
        .pairs
        .values()
        .map(|p| {
            let elems = p.a.elem_count() + p.b.elem_count();
            (elems as u64).saturating_mul(p.a.dtype().size_in_bytes() as u64)
        })
        .fold(0, u64::saturating_add)
}

impl AdapterCache {
    /// An empty cache holding at most `budget` bytes of adapters.
    pub fn with_budget(budget: u64) -> Self {
        Self {
            entries: Vec::new(),
            budget,
        }
    }

    /// The adapter read from `dir`, if kept; it becomes the most recently used.
    pub fn get(&mut self, dir: &Path) -> Option<Arc<Adapter>> {
        let pos = self.entries.iter().position(|(p, _, _)| p == dir)?;
        let entry = self.entries.remove(pos);
        let adapter = entry.1.clone();
        self.entries.push(entry);
        Some(adapter)
    }

    /// Keeps `adapter` (read from `dir`), dropping the least recently used ones until
    /// it fits; one larger than the budget is not kept.
    pub fn insert(&mut self, dir: PathBuf, adapter: Arc<Adapter>) {
        let bytes = adapter_bytes(&adapter);
        if bytes > self.budget {
            return;
        }
        self.entries.retain(|(p, _, _)| *p != dir);
        while self.entries.len() >= MAX_ENTRIES || self.bytes().saturating_add(bytes) > self.budget
        {
            self.entries.remove(0);
        }
        self.entries.push((dir, adapter, bytes));
    }

    /// Bytes of the adapters kept.
    pub fn bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|(_, _, b)| *b)
            .fold(0, u64::saturating_add)
    }

    /// How many adapters are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::model::{Arch, LoraSpec};

    fn adapter(rank: usize) -> Arc<Adapter> {
        let cfg = crate::model::tiny::tiny_config(Arch::Llama);
        let spec = LoraSpec {
            rank,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
        };
        Arc::new(Adapter::new(&cfg, spec, 1, DType::F32, &Device::Cpu).unwrap())
    }

    #[test]
    fn the_cache_keeps_its_byte_budget_dropping_the_least_recently_used() {
        let (small, large) = (adapter(2), adapter(8));
        let small_bytes = adapter_bytes(&small);
        assert_eq!(
            adapter_bytes(&large),
            4 * small_bytes,
            "bytes scale with rank"
        );
        assert_eq!(small_bytes, small.num_params() as u64 * 4);
        let mut cache = AdapterCache::with_budget(3 * small_bytes);
        for i in 0..3 {
            cache.insert(format!("/c/{i}").into(), small.clone());
        }
        assert_eq!(cache.len(), 3);
        assert!(
            cache.get(Path::new("/c/0")).is_some(),
            "0 is now the most recent"
        );
        cache.insert("/c/3".into(), small.clone());
        assert!(
            cache.get(Path::new("/c/1")).is_none(),
            "1 was the least recent"
        );
        assert!(cache.get(Path::new("/c/0")).is_some());
        cache.insert("/c/big".into(), large);
        assert!(
            cache.get(Path::new("/c/big")).is_none(),
            "larger than the budget"
        );
        assert_eq!(cache.len(), 3, "nothing dropped for an adapter not kept");
        assert!(cache.bytes() <= 3 * small_bytes);
    }

    #[test]
    fn the_cache_keeps_at_most_sixteen_adapters() {
        let a = adapter(2);
        let mut cache = AdapterCache::with_budget(u64::MAX);
        for i in 0..40 {
            cache.insert(format!("/c/{i}").into(), a.clone());
            cache.insert(format!("/c/{i}").into(), a.clone());
        }
        assert_eq!(cache.len(), MAX_ENTRIES);
        assert!(cache.get(Path::new("/c/39")).is_some());
        assert!(cache.get(Path::new("/c/23")).is_none());
    }
}
