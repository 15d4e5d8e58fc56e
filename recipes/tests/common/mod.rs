//! What the recipes' end-to-end tests share.

use std::path::{Path, PathBuf};

use lathe_server::model::tiny::write_hf_dir;
use lathe_server::model::Arch;

/// A tiny random model whose context (1024 tokens; its tokenizer is byte-level) holds the
/// recipes' longest prompts.
pub fn tiny_model(dir: &Path) -> PathBuf {
    tiny_model_with_context(dir, 1024)
}

/// A tiny random model with a context of `context` tokens.
#[allow(dead_code)] // not every test binary that shares this module uses it
pub fn tiny_model_with_context(dir: &Path, context: usize) -> PathBuf {
    write_hf_dir(dir, Arch::Llama, 4).unwrap();
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["max_position_embeddings"] = context.into();
    std::fs::write(&path, config.to_string()).unwrap();
    dir.to_path_buf()
}
