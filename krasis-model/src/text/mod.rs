//! Text in and out: the tokenizer and chat template ([`tokenizer`]; Kimi's tiktoken BPE in
//! [`tiktoken`]), sampling ([`sampling`]) and
//! the generation loop over any engine ([`generate`]).

pub mod chat_template;
pub mod generate;
pub mod sampling;
pub mod spm;
pub mod tiktoken;
pub mod tokenizer;
