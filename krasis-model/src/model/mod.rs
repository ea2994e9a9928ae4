//! What every device shares: the tensor inventory ([`tensors`]), typed weight loading
//! ([`weights`]), the build walk ([`build`]) and the forward walk ([`walk`]), and the math both
//! devices follow: rotary embeddings ([`rope`]), routing ([`router`]) and the reference linear
//! op ([`linear`]).

pub mod build;
pub mod linear;
pub mod rope;
pub mod router;
pub mod tensors;
pub mod walk;
pub mod weights;
