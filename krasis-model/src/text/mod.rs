//! Text in and out: the tokenizer and chat template ([`tokenizer`]), sampling ([`sampling`]) and
//! the generation loop over any engine ([`generate`]).

pub mod generate;
pub mod sampling;
pub mod tokenizer;
