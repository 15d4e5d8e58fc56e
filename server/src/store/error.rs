//! The store's error type.

/// Errors reading or writing checkpoint files.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Filesystem failure.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The files exist but do not describe a usable adapter for this model.
    #[error("invalid checkpoint: {0}")]
    Invalid(String),
    /// A checkpoint of that name exists and overwriting was not asked for.
    #[error("a checkpoint named {0:?} already exists (pass overwrite to replace it)")]
    Exists(String),
    /// The metadata database failed.
    #[error("metadata database: {0}")]
    Db(#[from] rusqlite::Error),
    /// Another server holds the data dir.
    #[error("the data dir {0} is in use by another lathe server (its lock file is held); stop it or choose another --data-dir")]
    Locked(String),
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
}
