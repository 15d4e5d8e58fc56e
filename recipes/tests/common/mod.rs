//! What the recipes' end-to-end tests share.

use std::path::{Path, PathBuf};

use lathe_server::model::tiny::write_hf_dir;
use lathe_server::model::Arch;

/// A tiny random model whose context (1024 tokens; its tokenizer is byte-level) holds the
/// recipes' longest prompts.
pub fn tiny_model(dir: &Path) -> PathBuf {
    write_hf_dir(dir, Arch::Llama, 4).unwrap();
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["max_position_embeddings"] = 1024.into();
    std::fs::write(&path, config.to_string()).unwrap();
    dir.to_path_buf()
}
