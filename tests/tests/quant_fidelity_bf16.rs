//! `quant_fidelity`'s checks with the prefill matmuls on the BF16 tiles
//! (`krasis_cpu::prefill_bf16`): emulated, so they run on any CPU (the GPU box's hardware tiles
//! take that path in `quant_fidelity` itself with `KRASIS_BF16_MIN_TOKENS=1`). Fails if
//! the BF16 path did not run.

mod fidelity_checks;

use fidelity_checks::{check, check_int8dense};
use krasis_tests::{fixtures_dir, FIXTURE_NAMES};

/// Every test of this binary sets the same values before anything reads them (read once).
fn on_emulated_tiles() {
    std::env::set_var("KRASIS_PREFILL_MATMUL", "bf16-emulated");
    std::env::set_var("KRASIS_BF16_MIN_TOKENS", "1");
    assert_eq!(krasis_cpu::prefill_bf16::tiles(), Some(krasis_cpu::prefill_bf16::Bf16Tiles::Emulated));
}

fn ran_bf16() {
    if fixtures_dir().is_some() {
        assert!(krasis_cpu::prefill_bf16::calls() > 0, "the BF16 prefill path never ran");
    }
}

#[test]
fn experts_within_bounds_on_bf16_tiles() {
    on_emulated_tiles();
    for name in FIXTURE_NAMES {
        check(name);
    }
    ran_bf16();
}

#[test]
fn dense_int8_within_twice_ideal_int8dense_on_bf16_tiles() {
    on_emulated_tiles();
    for name in FIXTURE_NAMES {
        check_int8dense(name);
    }
    ran_bf16();
}
