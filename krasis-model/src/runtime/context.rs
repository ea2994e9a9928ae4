//! Context limits: how many tokens (prompt plus generated) one request may hold on an engine,
//! and the check that `krasis generate`, the server and [`crate::text::generate::generate_with`] all
//! make before running a request.

use super::Engine;
use crate::spec::ModelSpec;

/// A request that does not fit the context: `prompt + new_tokens > context`, or a prompt that
/// leaves no room for even one new token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextExceeded {
    /// The context: the most tokens (prompt plus generated) one request may hold.
    pub context: usize,
    /// Prompt tokens.
    pub prompt: usize,
    /// Tokens the request asks to generate (at least 1: a request always generates one).
    pub new_tokens: usize,
}

impl std::fmt::Display for ContextExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "this model's context is {} tokens; the request asks for {} ({} prompt + {} to generate)",
            self.context,
            self.prompt.saturating_add(self.new_tokens),
            self.prompt,
            self.new_tokens
        )
    }
}

impl std::error::Error for ContextExceeded {}

/// The context of a model before an engine is opened: `max_position_embeddings`, lowered to
/// `kv_tokens` where a KV capacity was asked for.
pub fn spec_context_limit(spec: &ModelSpec, kv_tokens: Option<usize>) -> usize {
    kv_tokens.map_or(spec.max_position_embeddings, |k| k.min(spec.max_position_embeddings))
}

/// The context of one session of `engine`: its KV capacity where that is fixed at load (the GPU
/// paths, or a CPU engine opened with a KV token limit), never above the model's
/// `max_position_embeddings` (positions past it are outside what the model was trained on).
pub fn context_limit(engine: &dyn Engine) -> usize {
    spec_context_limit(engine.spec(), engine.kv_capacity())
}

/// Checks a request of `prompt` tokens asking for `new_tokens` (`None`: as many as the context
/// leaves) against `context`. Returns the tokens to generate; an error when the prompt leaves no
/// room or the request asks for more than the room.
pub fn check_context(
    context: usize,
    prompt: usize,
    new_tokens: Option<usize>,
) -> std::result::Result<usize, ContextExceeded> {
    let room = context.saturating_sub(prompt);
    let n = new_tokens.unwrap_or(room);
    if room == 0 || n > room {
        return Err(ContextExceeded { context, prompt, new_tokens: n.max(1) });
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_within_the_context_pass_and_others_say_by_how_much() {
        assert_eq!(check_context(16, 10, Some(6)), Ok(6));
        assert_eq!(check_context(16, 10, None), Ok(6));
        assert_eq!(check_context(16, 10, Some(0)), Ok(0));
        let e = check_context(16, 10, Some(7)).unwrap_err();
        assert_eq!(e, ContextExceeded { context: 16, prompt: 10, new_tokens: 7 });
        assert_eq!(
            e.to_string(),
            "this model's context is 16 tokens; the request asks for 17 (10 prompt + 7 to generate)"
        );
        // A prompt that fills the context leaves no room for the one token every request makes.
        assert_eq!(check_context(16, 16, None).unwrap_err().new_tokens, 1);
        assert_eq!(check_context(16, 81, Some(40)).unwrap_err().to_string(), {
            "this model's context is 16 tokens; the request asks for 121 (81 prompt + 40 to generate)"
        });
    }
}
