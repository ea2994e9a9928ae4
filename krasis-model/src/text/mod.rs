//! Text in and out: the tokenizer and chat template ([`tokenizer`]; Kimi's tiktoken BPE in
//! [`tiktoken`]), sampling ([`sampling`]),
//! the generation loop over any engine ([`generate`]), and tool calls and reasoning in generated
//! text per family ([`tool_calls`]).

pub mod chat_template;
pub mod generate;
pub mod sampling;
pub mod spm;
pub mod tiktoken;
pub mod tokenizer;
pub mod tool_calls;
