//! Chat prompts rendered with the model's own Jinja template (minijinja, with Python
//! string methods such as `.strip()` that Hugging Face templates use).

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use super::ModelError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    bos: Option<String>,
    eos: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are exposed to it as `bos_token`/`eos_token`.
    pub fn new(
        source: String,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.clone())
            .map_err(|e| ModelError::Template(e.to_string()))?;
        Ok(Self {
            source,
            env,
            bos,
            eos,
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        })
        .map_err(|e| ModelError::Template(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template, as stored in its GGUF.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_smollm2_with_default_system_prompt() {
        let t = ChatTemplate::new(SMOLLM2.into(), None, Some("<|im_end|>".into())).unwrap();
        let out = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let src = "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}{{ messages[0]['content'].strip() }}";
        let t = ChatTemplate::new(src.into(), None, None).unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  x  ")], false)
                .unwrap(),
            "x"
        );
        let err = t
            .render(&[ChatMessage::new("bad", "x")], false)
            .unwrap_err();
        assert!(err.to_string().contains("no bad roles"));
    }
}
