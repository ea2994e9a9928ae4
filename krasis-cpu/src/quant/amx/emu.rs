//! A scalar emulation of the AMX tile instructions [`super::matmul`] uses (Intel SDM semantics
//! of `ldtilecfg`, `tilezero`, `tileloadd`, `tdpbsud`, `tdpbf16ps`, `tilestored` for palette 1), so the AMX
//! kernel runs, and is checked against the scalar twin, on machines without AMX.

use super::tiles::{TileConfig, Tiles, TILE_A, TILE_B};

/// Eight 1 KiB tiles and the loaded configuration.
pub(crate) struct EmuTiles {
    cfg: Option<TileConfig>,
    t: [[u8; 1024]; 8],
}

impl EmuTiles {
    pub fn new() -> EmuTiles {
        EmuTiles { cfg: None, t: [[0; 1024]; 8] }
    }

    /// (rows, bytes per row) of tile `t`; panics without a configuration, as the hardware faults.
    fn shape(&self, t: usize) -> (usize, usize) {
        let c = self.cfg.as_ref().expect("AMX tile used before ldtilecfg");
        let (r, cb) = (c.rows[t] as usize, c.colsb[t] as usize);
        assert!(r > 0 && r <= 16 && cb > 0 && cb <= 64, "tile {t} unconfigured or invalid: {r} × {cb}");
        (r, cb)
    }
}

impl Tiles for EmuTiles {
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        assert_eq!(cfg.palette, 1);
        self.cfg = Some(*cfg);
        self.t = [[0; 1024]; 8]; // ldtilecfg zeroes the tiles
    }

    unsafe fn zero(&mut self, t: usize) {
        self.shape(t);
        self.t[t] = [0; 1024];
    }

    unsafe fn load(&mut self, t: usize, p: *const u8, stride: usize) {
        let (rows, cb) = self.shape(t);
        for r in 0..rows {
            // SAFETY: the caller guarantees the rows are readable.
            let src = unsafe { std::slice::from_raw_parts(p.add(r * stride), cb) };
            self.t[t][r * 64..r * 64 + cb].copy_from_slice(src);
        }
    }

    unsafe fn dp(&mut self, c: usize) {
        let (a, b) = (TILE_A + c / 2, TILE_B + c % 2);
        let ((mr, mcb), (ar, acb), (br, bcb)) = (self.shape(c), self.shape(a), self.shape(b));
        assert!(ar == mr && br * 4 == acb && bcb == mcb, "tdpbsud shapes C {mr}×{mcb} A {ar}×{acb} B {br}×{bcb}");
        for m in 0..mr {
            for n in 0..mcb / 4 {
                let mut acc = i32::from_le_bytes(self.t[c][m * 64 + 4 * n..m * 64 + 4 * n + 4].try_into().unwrap());
                for k in 0..acb / 4 {
                    for i in 0..4 {
                        let x = self.t[a][m * 64 + 4 * k + i] as i8 as i32;
                        let w = self.t[b][k * 64 + 4 * n + i] as i32;
                        acc = acc.wrapping_add(x * w);
                    }
                }
                self.t[c][m * 64 + 4 * n..m * 64 + 4 * n + 4].copy_from_slice(&acc.to_le_bytes());
            }
        }
    }

    unsafe fn dp_bf16(&mut self, c: usize) {
        let (a, b) = (TILE_A + c / 2, TILE_B + c % 2);
        let ((mr, mcb), (ar, acb), (br, bcb)) = (self.shape(c), self.shape(a), self.shape(b));
        assert!(ar == mr && br * 4 == acb && bcb == mcb, "tdpbf16ps shapes C {mr}×{mcb} A {ar}×{acb} B {br}×{bcb}");
        // BF16 → f32 with denormal inputs as zero (the instruction's DAZ).
        let f = |t: &[u8; 1024], at: usize| {
            let v = f32::from_bits((u16::from_le_bytes([t[at], t[at + 1]]) as u32) << 16);
            if v.is_subnormal() {
                0.0
            } else {
                v
            }
        };
        for m in 0..mr {
            for n in 0..mcb / 4 {
                let at = m * 64 + 4 * n;
                let mut acc = f32::from_le_bytes(self.t[c][at..at + 4].try_into().unwrap());
                for k in 0..acb / 4 {
                    for i in 0..2 {
                        acc += f(&self.t[a], m * 64 + 4 * k + 2 * i) * f(&self.t[b], k * 64 + 4 * n + 2 * i);
                    }
                }
                self.t[c][at..at + 4].copy_from_slice(&acc.to_le_bytes());
            }
        }
    }

    unsafe fn store(&mut self, t: usize, p: *mut u8, stride: usize) {
        let (rows, cb) = self.shape(t);
        for r in 0..rows {
            // SAFETY: the caller guarantees the rows are writable.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.add(r * stride), cb) };
            dst.copy_from_slice(&self.t[t][r * 64..r * 64 + cb]);
        }
    }

    unsafe fn release(&mut self) {
        self.cfg = None;
    }
}
