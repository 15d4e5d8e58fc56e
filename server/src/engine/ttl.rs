//! Checkpoint lifetimes: a TTL from the wire, bounded once, so every expiry the engine
//! computes or formats is a sane timestamp.

use super::EngineError;

/// The longest TTL a checkpoint may be given: 100 years. Longer is refused (400) rather
/// than clamped, so a client is never told something it did not get; no TTL at all means
/// the checkpoint never expires.
pub const MAX_TTL_SECONDS: u64 = 100 * 365 * 24 * 3600;

/// A checked checkpoint TTL in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ttl(u64);

impl Ttl {
    /// Checks a wire TTL; `None` stays `None` (never expires).
    pub fn from_wire(seconds: Option<u64>) -> Result<Option<Self>, EngineError> {
        match seconds {
            None => Ok(None),
            Some(s) if s <= MAX_TTL_SECONDS => Ok(Some(Self(s))),
            Some(s) => Err(EngineError::BadRequest(format!(
                "ttl_seconds {s} is longer than the limit of {MAX_TTL_SECONDS} (100 years); \
                 omit it for a checkpoint that never expires"
            ))),
        }
    }

    /// Seconds.
    pub fn seconds(self) -> u64 {
        self.0
    }

    /// The Unix time at which a checkpoint given this TTL at `now` expires. Cannot
    /// overflow: the TTL is bounded and `now` is a real clock.
    pub fn expires_at(self, now: i64) -> i64 {
        now.saturating_add(self.0 as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_are_bounded_and_never_wrap() {
        assert_eq!(Ttl::from_wire(None).unwrap(), None);
        let t = Ttl::from_wire(Some(60)).unwrap().unwrap();
        assert_eq!(t.expires_at(1_000), 1_060);
        assert!(Ttl::from_wire(Some(MAX_TTL_SECONDS)).unwrap().is_some());
        for bad in [MAX_TTL_SECONDS + 1, 1_000_000_000_000, u64::MAX] {
            let err = Ttl::from_wire(Some(bad)).unwrap_err();
            assert!(matches!(err, EngineError::BadRequest(_)), "{bad}");
        }
    }
}
